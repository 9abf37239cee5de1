# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-any-return"
"""Triton kernels for GefenMuon's quantised momentum (launched by :mod:`gefen_kernels.triton_ops`):
the momentum EMA requantised with Gefen's codebook and written out as the Newton-Schulz input.

They reuse the momentum helpers of :mod:`gefen_kernels.triton_kernels` and the requantisation of
:mod:`gefen_kernels.triton_elements`
(same numerics: ``enable_fp_fusion=False``, correctly rounded divisions). One-matrix form and a
list form that reads its entries from an int64 table (``triton_elements._entry_of``).
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .triton_elements import _entry_of, _requantize, _store_value, _to_param_dtype
from .triton_kernels import NO_DENOMINATOR, _block_stats, _momentum

# ruff: noqa: N803  (constexpr parameters are upper case)


@triton.jit
def _muon_momentum(
    pid,
    g_ptr,
    q_ptr,
    mag_ptr,
    cb_ptr,
    sc_ptr,
    seed_ptr,
    out_ptr,
    blocks,
    period,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    NESTEROV: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """GefenMuon: requantise the momentum EMA and write the Newton-Schulz input (bf16 or fp32)
    for program ``pid``'s blocks of one matrix."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < blocks
    numel = blocks.to(tl.int64) * period  # GefenMuon's blocks tile the matrix
    beta = tl.load(sc_ptr + 0)
    omb = tl.load(sc_ptr + 1)
    if STOCHASTIC:
        seed = tl.load(seed_ptr).to(tl.uint64)
    else:
        seed = 0
    m_old = tl.load(mag_ptr + rows, mask=row_ok, other=0.0)
    m_new = _block_stats(
        g_ptr,
        q_ptr,
        cb_ptr,
        rows,
        row_ok,
        m_old,
        1.0,
        beta,
        omb,
        period,
        numel,
        1.0,
        sc_ptr,
        sc_ptr,
        1,
        0.0,
        ROWS,
        COLS,
        NO_DENOMINATOR,
    )
    tl.store(mag_ptr + rows, m_new, mask=row_ok)
    safe = tl.where(m_new > 0.0, m_new, 1.0)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        g, u, m = _momentum(
            g_ptr,
            q_ptr,
            cb_ptr,
            offs,
            mask,
            m_old[:, None],
            1.0,
            beta,
            omb,
            1.0,
            sc_ptr,
            sc_ptr,
            1,
            0.0,
            NO_DENOMINATOR,
        )
        code, value = _requantize(u, g, m, m_new[:, None], safe[:, None], cb_ptr, mask, offs, seed, STOCHASTIC)
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=mask)
        if NESTEROV:
            value = value * beta + g * omb
        if OUT_BF16:
            _store_value(out_ptr, offs, _to_param_dtype(value, tl.bfloat16), mask)
        else:
            tl.store(out_ptr + offs, value, mask=mask)


@triton.jit
def muon_momentum_kernel(
    g_ptr, q_ptr, mag_ptr, cb_ptr, sc_ptr, seed_ptr, out_ptr, blocks, period,
    ROWS: tl.constexpr, COLS: tl.constexpr, STOCHASTIC: tl.constexpr, NESTEROV: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """One matrix's launch (what a captured CUDA graph replays; see ``muon_list_kernel``)."""
    _muon_momentum(
        tl.program_id(0), g_ptr, q_ptr, mag_ptr, cb_ptr, sc_ptr, seed_ptr, out_ptr, blocks, period, ROWS, COLS,
        STOCHASTIC, NESTEROV, OUT_BF16,
    )  # fmt: skip


#: int64 fields of one entry of ``muon_list_kernel``'s table: the addresses of the gradient,
#: codes, scales, output, step scalars and seed, then blocks and period.
MUON_FIELDS = tl.constexpr(8)


@triton.jit
def muon_list_kernel(
    table_ptr,
    starts_ptr,
    entries,
    cb_ptr,
    G_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    NESTEROV: tl.constexpr,
    OUT_BF16: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """:func:`_muon_momentum` for every matrix of a list sharing a dtype, an output dtype and a
    tile, in one launch (as ``step_list_kernel``; a bf16 output through its uint16 bits)."""
    entry, local = _entry_of(starts_ptr, entries, tl.program_id(0), SEARCH)
    row = table_ptr + entry.to(tl.int64) * MUON_FIELDS
    if OUT_BF16:
        out_ptr = tl.load(row + 3).to(tl.pointer_type(tl.uint16))
    else:
        out_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    _muon_momentum(
        local,
        tl.load(row + 0).to(tl.pointer_type(G_DTYPE)),
        tl.load(row + 1).to(tl.pointer_type(tl.uint8)),
        tl.load(row + 2).to(tl.pointer_type(tl.float32)),
        cb_ptr,
        tl.load(row + 4).to(tl.pointer_type(tl.float32)),
        tl.load(row + 5).to(tl.pointer_type(tl.int64)),
        out_ptr,
        tl.load(row + 6),
        tl.load(row + 7),
        ROWS,
        COLS,
        STOCHASTIC,
        NESTEROV,
        OUT_BF16,
    )

# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-any-return"
"""Triton kernels for Gefen's step ops (launched by :mod:`gefen_kernels.triton_ops`).

Numerics follow ``gefen_core.reference_ops``: every launch passes ``enable_fp_fusion=False``
so no multiply-add is contracted into an FMA, fp32 divisions and square roots use the
correctly rounded ``div_rn`` / ``sqrt_rn``, sums of squares are accumulated in float64 and
rounded once, and bf16/fp16 parameters are rounded to their dtype after the decay and
after the update. The codeword search is a branchless binary search over the 256 sorted
codewords (the true lower bound, which is what the reference's bucket table computes for
every valid codebook). Stochastic rounding uses the same SplitMix64 hash of
``(seed, flat index)`` as the reference, in uint64 arithmetic.

A program handles ``ROWS`` blocks and walks them in ``COLS``-wide column chunks. Gefen's
momentum is the EMA of the preconditioned gradient ``g / h``: the block path first sums the
block's ``g^2`` (its second moment gives ``h``), the factored path computes ``h`` per element
from the row and column roots; then pass 1 forms the momentum EMA and its block max, and
pass 2 recomputes the momentum (from the same inputs, bit for bit), quantises it and writes.
No full-size temporary is allocated.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .triton_elements import _entry_of, _load_value, _requantize, _store_value, _to_param_dtype, _widen

# ruff: noqa: N803, PLR0124  (constexpr parameters are upper case; x != x is the NaN test in Triton)

#: How the momentum's gradient is preconditioned: not at all (GefenMuon), by one ``h`` per
#: block, by the factored ``h = fl(fl(a_row * b_col) + eps)`` of each element, or by each
#: element's own Adam ``v`` (the element path: ``rf_ptr`` is ``v``, ``vc_ptr`` the scalars).
#: ``FACTORED_ROW_DENOMINATOR`` is the factored one where every block lies in one row (the row
#: length a multiple of the period, as Gefen's periods always are): the kernel takes each
#: block's row root ``a`` once (``h_rows``) and its row's first flat index (``ncols``), so no
#: element pays a 64-bit division for its row and column or a square root for its row.
NO_DENOMINATOR = tl.constexpr(0)
BLOCK_DENOMINATOR = tl.constexpr(1)
FACTORED_DENOMINATOR = tl.constexpr(2)
ELEMENT_DENOMINATOR = tl.constexpr(3)
FACTORED_ROW_DENOMINATOR = tl.constexpr(4)


@triton.jit
def _advanced_v(g, offs, mask, v_ptr, sc_ptr):
    """The element path's ``v' = fl(fl(v * BETA2) + fl(fl(g * g) * ONE_MINUS_BETA2))`` from the
    stored (not yet advanced) ``v``: both passes of a block compute it, the second stores it."""
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    return v * tl.load(sc_ptr + 6) + (g * g) * tl.load(sc_ptr + 7)


@triton.jit
def _denominator(g, offs, mask, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN: tl.constexpr):
    """Each element's ``h``: the block's (``h_rows``), factored from ``row_factor``/``v_col``, or
    the element path's ``fl(fl(sqrt(fl(v' * BC2))) + eps)``."""
    h = h_rows
    if DEN == FACTORED_DENOMINATOR:
        prow = offs // ncols
        pcol = offs - prow * ncols
        a = tl.math.sqrt_rn(tl.load(rf_ptr + prow, mask=mask, other=1.0))
        h = a * tl.math.sqrt_rn(tl.load(vc_ptr + pcol, mask=mask, other=1.0)) + eps
    if DEN == FACTORED_ROW_DENOMINATOR:  # h_rows: the block's a; ncols: its row's first flat index
        h = h_rows * tl.math.sqrt_rn(tl.load(vc_ptr + (offs - ncols), mask=mask, other=1.0)) + eps
    if DEN == ELEMENT_DENOMINATOR:
        h = tl.math.sqrt_rn(_advanced_v(g, offs, mask, rf_ptr, vc_ptr) * tl.load(vc_ptr + 2)) + eps
    return h


@triton.jit
def _momentum(
    g_ptr, q_ptr, cb_ptr, offs, mask, m_old, sign, beta1, omb1, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN: tl.constexpr
):
    """g (fp32, signed), u = fl(fl(fl(C[q] * M) * beta1) + fl(n * (1 - beta1))), with
    n = fl(g / h) (Gefen) or g (GefenMuon, ``DEN == NO_DENOMINATOR``), and the old momentum m = fl(C[q] * M)."""
    g = _widen(_load_value(g_ptr, offs, mask)).to(tl.float32) * sign
    n = g
    if DEN != NO_DENOMINATOR:
        n = tl.math.div_rn(g, _denominator(g, offs, mask, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN))
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    c = tl.load(cb_ptr + q, mask=mask, other=0.0)
    m = c * m_old
    u = m * beta1 + n * omb1
    return g, u, m


@triton.jit
def _write_param(p_ptr, offs, mask, d, decay, APPLY_DECAY: tl.constexpr, F64: tl.constexpr):
    p = _load_value(p_ptr, offs, mask)
    if F64:
        pc = p.to(tl.float64)
        if APPLY_DECAY:
            pc = pc * decay.to(tl.float64)
        out = (pc - d.to(tl.float64)).to(p.dtype)
    else:
        pc = _widen(p).to(tl.float32)
        if APPLY_DECAY:
            pc = _widen(_to_param_dtype(pc * decay, p.dtype)).to(tl.float32)
        out = _to_param_dtype(pc - d, p.dtype)
    _store_value(p_ptr, offs, out, mask)


@triton.jit
def _block_sumsq(g_ptr, rows, row_ok, period, numel, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The float64 sum of fl(g)^2 of each of ROWS blocks (the block path's statistic; blocks end
    at ``numel``, so a ragged last block is shorter)."""
    sumsq = tl.zeros((ROWS,), dtype=tl.float64)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        g64 = _widen(_load_value(g_ptr, offs, mask)).to(tl.float32).to(tl.float64)
        sumsq += tl.sum(g64 * g64, axis=1)
    return sumsq


@triton.jit
def _block_stats(
    g_ptr,
    q_ptr,
    cb_ptr,
    rows,
    row_ok,
    m_old,
    sign,
    beta1,
    omb1,
    period,
    numel,
    h_rows,
    rf_ptr,
    vc_ptr,
    ncols,
    eps,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DEN: tl.constexpr,
):
    """Pass 1 over ROWS blocks: max |u| with NaN propagated."""
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    nan = tl.zeros((ROWS,), dtype=tl.int32)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        _, u, _ = _momentum(
            g_ptr, q_ptr, cb_ptr, offs, mask, m_old[:, None], sign, beta1, omb1, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN
        )
        a = tl.where(mask, tl.abs(u), 0.0)
        amax = tl.maximum(amax, tl.max(a, axis=1))
        nan = nan | tl.max(((u != u) & mask).to(tl.int32), axis=1)
    return tl.where(nan != 0, float("nan"), amax)


@triton.jit
def _precondition_write(
    p_ptr,
    g_ptr,
    q_ptr,
    mag_ptr,
    cb_ptr,
    rows,
    row_ok,
    sign,
    beta1,
    omb1,
    inv_bc1,
    lr,
    decay,
    seed,
    period,
    numel,
    h_rows,
    rf_ptr,
    vc_ptr,
    ncols,
    eps,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    DEN: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    APPLY_DECAY: tl.constexpr,
    F64: tl.constexpr,
):
    """Both step paths after their second moment: the momentum of the preconditioned gradient,
    requantised, and the write d = fl(fl(fl(C[q'] * M') * INV_BC1) * LR)."""
    m_old = tl.load(mag_ptr + rows, mask=row_ok, other=0.0)
    m_new = _block_stats(
        g_ptr,
        q_ptr,
        cb_ptr,
        rows,
        row_ok,
        m_old,
        sign,
        beta1,
        omb1,
        period,
        numel,
        h_rows,
        rf_ptr,
        vc_ptr,
        ncols,
        eps,
        ROWS,
        COLS,
        DEN,
    )
    tl.store(mag_ptr + rows, m_new, mask=row_ok)
    safe = tl.where(m_new > 0.0, m_new, 1.0)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        g, u, m = _momentum(
            g_ptr, q_ptr, cb_ptr, offs, mask, m_old[:, None], sign, beta1, omb1, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN
        )
        if DEN == ELEMENT_DENOMINATOR:  # after this tile's last read of the stored v
            tl.store(rf_ptr + offs, _advanced_v(g, offs, mask, rf_ptr, vc_ptr), mask=mask)
        code, value = _requantize(u, g, m, m_new[:, None], safe[:, None], cb_ptr, mask, offs, seed, STOCHASTIC)
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=mask)
        d = (value * inv_bc1) * lr
        _write_param(p_ptr, offs, mask, d, decay, APPLY_DECAY, F64)


@triton.jit
def _step_scalars(sc_ptr, seed_ptr, STOCHASTIC: tl.constexpr):
    """The packet's ``LR``, ``INV_BC1``, ``DECAY``, ``BETA1``, ``ONE_MINUS_BETA1`` and ``EPS``
    (``gefen_core.step_scalars``), and the stochastic-rounding seed (0 for nearest rounding)."""
    if STOCHASTIC:
        seed = tl.load(seed_ptr).to(tl.uint64)
    else:
        seed = 0
    lr = tl.load(sc_ptr + 0)
    inv_bc1 = tl.load(sc_ptr + 1)
    decay = tl.load(sc_ptr + 3)
    return lr, inv_bc1, decay, tl.load(sc_ptr + 4), tl.load(sc_ptr + 5), tl.load(sc_ptr + 8), seed


@triton.jit
def _block_step(
    pid,
    p_ptr,
    g_ptr,
    q_ptr,
    mag_ptr,
    v_ptr,
    cb_ptr,
    sc_ptr,
    seed_ptr,
    blocks,
    period,
    numel,
    sign,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    APPLY_DECAY: tl.constexpr,
    F64: tl.constexpr,
):
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < blocks
    lr, inv_bc1, decay, beta1, omb1, eps, seed = _step_scalars(sc_ptr, seed_ptr, STOCHASTIC)
    bc2 = tl.load(sc_ptr + 2)
    beta2 = tl.load(sc_ptr + 6)
    omb2 = tl.load(sc_ptr + 7)
    count = tl.minimum(numel - rows.to(tl.int64) * period, period)  # a ragged last block is shorter
    count = tl.where(row_ok, count, 1).to(tl.float64)
    mean = (_block_sumsq(g_ptr, rows, row_ok, period, numel, ROWS, COLS) / count).to(tl.float32)
    v = tl.load(v_ptr + rows, mask=row_ok, other=0.0)
    v = v * beta2 + mean * omb2
    h = tl.math.sqrt_rn(v) * bc2 + eps
    tl.store(v_ptr + rows, v, mask=row_ok)
    _precondition_write(
        p_ptr, g_ptr, q_ptr, mag_ptr, cb_ptr, rows, row_ok, sign, beta1, omb1, inv_bc1, lr, decay, seed, period, numel,
        h[:, None], v_ptr, v_ptr, 1, eps, ROWS, COLS, BLOCK_DENOMINATOR, STOCHASTIC, APPLY_DECAY, F64
    )  # fmt: skip


@triton.jit
def block_step_kernel(
    p_ptr, g_ptr, q_ptr, mag_ptr, v_ptr, cb_ptr, sc_ptr, seed_ptr, blocks, period, numel, sign,
    ROWS: tl.constexpr, COLS: tl.constexpr, STOCHASTIC: tl.constexpr, APPLY_DECAY: tl.constexpr, F64: tl.constexpr,
):  # fmt: skip
    """One entry's launch (what a captured CUDA graph replays; see ``step_list_kernel``)."""
    _block_step(
        tl.program_id(0), p_ptr, g_ptr, q_ptr, mag_ptr, v_ptr, cb_ptr, sc_ptr, seed_ptr, blocks, period, numel,
        sign, ROWS, COLS, STOCHASTIC, APPLY_DECAY, F64
    )  # fmt: skip


@triton.jit
def _factored_step(
    pid,
    p_ptr,
    g_ptr,
    q_ptr,
    mag_ptr,
    rf_ptr,
    vc_ptr,
    cb_ptr,
    sc_ptr,
    seed_ptr,
    blocks,
    period,
    ncols,
    sign,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    APPLY_DECAY: tl.constexpr,
    F64: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
):
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < blocks
    numel = blocks.to(tl.int64) * period  # factored blocks tile the rows
    lr, inv_bc1, decay, beta1, omb1, eps, seed = _step_scalars(sc_ptr, seed_ptr, STOCHASTIC)
    if ROW_BLOCKS:  # each block in one row: its row root and row start once per block
        row = rows.to(tl.int64) * period // ncols
        h_rows = tl.math.sqrt_rn(tl.load(rf_ptr + row, mask=row_ok, other=1.0))[:, None]
        columns = (row * ncols)[:, None]  # the denominator's column: the flat index minus this
    else:  # blocks may cross rows: row and column per element
        h_rows = 1.0
        columns = ncols
    _precondition_write(
        p_ptr, g_ptr, q_ptr, mag_ptr, cb_ptr, rows, row_ok, sign, beta1, omb1, inv_bc1, lr, decay, seed, period, numel,
        h_rows, rf_ptr, vc_ptr, columns, eps, ROWS, COLS,
        FACTORED_ROW_DENOMINATOR if ROW_BLOCKS else FACTORED_DENOMINATOR, STOCHASTIC, APPLY_DECAY, F64
    )  # fmt: skip


@triton.jit
def factored_step_kernel(
    p_ptr, g_ptr, q_ptr, mag_ptr, rf_ptr, vc_ptr, cb_ptr, sc_ptr, seed_ptr, blocks, period, ncols, sign,
    ROWS: tl.constexpr, COLS: tl.constexpr, STOCHASTIC: tl.constexpr, APPLY_DECAY: tl.constexpr, F64: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
):  # fmt: skip
    """One entry's launch (what a captured CUDA graph replays; see ``step_list_kernel``)."""
    _factored_step(
        tl.program_id(0), p_ptr, g_ptr, q_ptr, mag_ptr, rf_ptr, vc_ptr, cb_ptr, sc_ptr, seed_ptr, blocks, period,
        ncols, sign, ROWS, COLS, STOCHASTIC, APPLY_DECAY, F64, ROW_BLOCKS
    )  # fmt: skip


@triton.jit
def _element_step(
    pid,
    p_ptr,
    g_ptr,
    q_ptr,
    mag_ptr,
    v_ptr,
    cb_ptr,
    sc_ptr,
    seed_ptr,
    blocks,
    period,
    sign,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    APPLY_DECAY: tl.constexpr,
    F64: tl.constexpr,
):
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < blocks
    numel = blocks.to(tl.int64) * period  # the blocks tile the parameter
    lr, inv_bc1, decay, beta1, omb1, eps, seed = _step_scalars(sc_ptr, seed_ptr, STOCHASTIC)
    _precondition_write(
        p_ptr, g_ptr, q_ptr, mag_ptr, cb_ptr, rows, row_ok, sign, beta1, omb1, inv_bc1, lr, decay, seed, period, numel,
        1.0, v_ptr, sc_ptr, 1, eps, ROWS, COLS, ELEMENT_DENOMINATOR, STOCHASTIC, APPLY_DECAY, F64
    )  # fmt: skip


@triton.jit
def element_step_kernel(
    p_ptr, g_ptr, q_ptr, mag_ptr, v_ptr, cb_ptr, sc_ptr, seed_ptr, blocks, period, sign,
    ROWS: tl.constexpr, COLS: tl.constexpr, STOCHASTIC: tl.constexpr, APPLY_DECAY: tl.constexpr, F64: tl.constexpr,
):  # fmt: skip
    """One entry's launch (what a captured CUDA graph replays; see ``step_list_kernel``)."""
    _element_step(
        tl.program_id(0), p_ptr, g_ptr, q_ptr, mag_ptr, v_ptr, cb_ptr, sc_ptr, seed_ptr, blocks, period, sign, ROWS,
        COLS, STOCHASTIC, APPLY_DECAY, F64
    )  # fmt: skip


#: Which step a list launch runs (``step_list_kernel``'s ``KIND``).
BLOCK_STEP = tl.constexpr(0)
ELEMENT_STEP = tl.constexpr(1)
FACTORED_STEP = tl.constexpr(2)
#: int64 fields of one entry of a list launch's table: the addresses of the parameter, gradient,
#: codes, scales, second moment (``vmean``, ``v`` or ``row_factor``), ``v_col`` (factored), step
#: scalars and seed, then blocks, period, elements and columns (factored).
TABLE_FIELDS = tl.constexpr(12)


@triton.jit
def step_list_kernel(
    table_ptr,
    starts_ptr,
    entries,
    cb_ptr,
    sign,
    KIND: tl.constexpr,
    P_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    APPLY_DECAY: tl.constexpr,
    F64: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """One launch for every entry of a list that shares a dtype and a tile (a step's launches
    grow with its groups, not its tensors). ``starts`` holds each entry's first
    program, ascending, then the total; a program finds its entry (:func:`_entry_of`) and runs
    that entry's blocks ``(pid - starts[e]) * ROWS + ...`` exactly as the one-entry kernels do."""
    lo, local = _entry_of(starts_ptr, entries, tl.program_id(0), SEARCH)
    row = table_ptr + lo.to(tl.int64) * TABLE_FIELDS
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(P_DTYPE))
    q_ptr = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
    mag_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    second_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    vc_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    scalars = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    seed = tl.load(row + 7).to(tl.pointer_type(tl.int64))
    blocks = tl.load(row + 8)
    period = tl.load(row + 9)
    numel = tl.load(row + 10)
    ncols = tl.load(row + 11)
    if KIND == BLOCK_STEP:
        _block_step(
            local, p_ptr, g_ptr, q_ptr, mag_ptr, second_ptr, cb_ptr, scalars, seed, blocks, period, numel, sign,
            ROWS, COLS, STOCHASTIC, APPLY_DECAY, F64,
        )  # fmt: skip
    if KIND == ELEMENT_STEP:
        _element_step(
            local, p_ptr, g_ptr, q_ptr, mag_ptr, second_ptr, cb_ptr, scalars, seed, blocks, period, sign,
            ROWS, COLS, STOCHASTIC, APPLY_DECAY, F64,
        )  # fmt: skip
    if KIND == FACTORED_STEP:
        _factored_step(
            local, p_ptr, g_ptr, q_ptr, mag_ptr, second_ptr, vc_ptr, cb_ptr, scalars, seed, blocks, period, ncols,
            sign, ROWS, COLS, STOCHASTIC, APPLY_DECAY, F64, ROW_BLOCKS,
        )  # fmt: skip

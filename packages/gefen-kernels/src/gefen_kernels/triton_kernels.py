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

# ruff: noqa: N803, PLR0124  (constexpr parameters are upper case; x != x is the NaN test in Triton)

# A compiled kernel reads only module globals that are tl.constexpr (the interpreter reads any):
# test_kernels_triton_parity.py checks what every kernel reads (a plain int ran on CPU, not on an H200).
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _uniform(seed, index):
    """SplitMix64-style uniform in [0, 1) from uint64 ``seed`` and ``index`` (24-bit resolution)."""
    z = seed + (index + 1) * _GOLDEN
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    z = z ^ (z >> 31)
    return (z >> 40).to(tl.float32) * (1.0 / 16777216.0)


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
def _load_value(ptr, offs, mask):
    """A parameter or gradient element in its dtype. The list kernel reaches a bf16 tensor
    through the uint16 pointer of its bits (Triton's interpreter reads a bf16 tensor at a raw
    address wrong, and the bits are the same on a GPU): those are bitcast back."""
    x = tl.load(ptr + offs, mask=mask, other=0)
    if tl.constexpr(x.dtype == tl.uint16):
        x = x.to(tl.bfloat16, bitcast=True)
    return x


@triton.jit
def _store_value(ptr, offs, x, mask):
    """Store a parameter element (bf16 as its bits where the pointer is uint16, see :func:`_load_value`)."""
    if tl.constexpr(ptr.dtype.element_ty == tl.uint16):
        x = x.to(tl.uint16, bitcast=True)
    tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _momentum(
    g_ptr, q_ptr, cb_ptr, offs, mask, m_old, sign, beta1, omb1, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN: tl.constexpr
):
    """g (fp32, signed) and u = fl(fl(fl(C[q] * M) * beta1) + fl(n * (1 - beta1))), with
    n = fl(g / h) (Gefen) or g (GefenMuon, ``DEN == NO_DENOMINATOR``)."""
    g = _load_value(g_ptr, offs, mask).to(tl.float32) * sign
    n = g
    if DEN != NO_DENOMINATOR:
        n = tl.math.div_rn(g, _denominator(g, offs, mask, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN))
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    c = tl.load(cb_ptr + q, mask=mask, other=0.0)
    m = c * m_old
    u = m * beta1 + n * omb1
    return g, u


@triton.jit
def _requantize(u, m_new, safe, cb_ptr, mask, flat, seed, STOCHASTIC: tl.constexpr):
    """New codes and their decoded momentum C[q'] * M' for momentum u of a block with scale m_new."""
    z = tl.math.div_rn(u, safe)
    k = tl.zeros(z.shape, dtype=tl.int32)
    for shift in tl.static_range(8):
        step = 128 >> shift
        probe = tl.load(cb_ptr + (k + step - 1), mask=mask, other=2.0)
        k = tl.where(probe < z, k + step, k)
    top = tl.load(cb_ptr + 255)
    k = tl.where(top < z, 256, k)
    lo = tl.maximum(k - 1, 0)
    hi = tl.minimum(k, 255)
    clo = tl.load(cb_ptr + lo, mask=mask, other=0.0)
    chi = tl.load(cb_ptr + hi, mask=mask, other=0.0)
    if STOCHASTIC:
        width = chi - clo
        clamped = tl.minimum(tl.maximum(z, clo), chi)
        up = tl.math.div_rn(clamped - clo, tl.where(width > 0.0, width, 1.0))
        up = tl.where(width > 0.0, up, 0.0)
        take_hi = _uniform(seed, flat.to(tl.uint64)) < up
    else:
        take_hi = tl.abs(z - clo) > tl.abs(z - chi)
    code = tl.where(take_hi, hi, lo)
    value = tl.where(take_hi, chi, clo) * m_new
    return code, value


@triton.jit
def _to_param_dtype(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to the parameter dtype to nearest even; bf16 by explicit bit arithmetic
    (the same on every backend, the interpreter included)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _write_param(p_ptr, offs, mask, d, decay, APPLY_DECAY: tl.constexpr, F64: tl.constexpr):
    p = _load_value(p_ptr, offs, mask)
    if F64:
        pc = p.to(tl.float64)
        if APPLY_DECAY:
            pc = pc * decay.to(tl.float64)
        out = (pc - d.to(tl.float64)).to(p.dtype)
    else:
        pc = p.to(tl.float32)
        if APPLY_DECAY:
            pc = _to_param_dtype(pc * decay, p.dtype).to(tl.float32)
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
        g64 = _load_value(g_ptr, offs, mask).to(tl.float32).to(tl.float64)
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
        _, u = _momentum(
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
        g, u = _momentum(
            g_ptr, q_ptr, cb_ptr, offs, mask, m_old[:, None], sign, beta1, omb1, h_rows, rf_ptr, vc_ptr, ncols, eps, DEN
        )
        if DEN == ELEMENT_DENOMINATOR:  # after this tile's last read of the stored v
            tl.store(rf_ptr + offs, _advanced_v(g, offs, mask, rf_ptr, vc_ptr), mask=mask)
        code, value = _requantize(u, m_new[:, None], safe[:, None], cb_ptr, mask, offs, seed, STOCHASTIC)
        tl.store(q_ptr + offs, code.to(tl.uint8), mask=mask)
        d = (value * inv_bc1) * lr
        _write_param(p_ptr, offs, mask, d, decay, APPLY_DECAY, F64)


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
    lr = tl.load(sc_ptr + 0)
    inv_bc1 = tl.load(sc_ptr + 1)
    bc2 = tl.load(sc_ptr + 2)
    decay = tl.load(sc_ptr + 3)
    beta1 = tl.load(sc_ptr + 4)
    omb1 = tl.load(sc_ptr + 5)
    beta2 = tl.load(sc_ptr + 6)
    omb2 = tl.load(sc_ptr + 7)
    eps = tl.load(sc_ptr + 8)
    if STOCHASTIC:
        seed = tl.load(seed_ptr).to(tl.uint64)
    else:
        seed = 0
    count = tl.minimum(numel - rows.to(tl.int64) * period, period)  # a ragged last block is shorter
    count = tl.where(row_ok, count, 1).to(tl.float64)
    mean = (_block_sumsq(g_ptr, rows, row_ok, period, numel, ROWS, COLS) / count).to(tl.float32)
    v = tl.load(v_ptr + rows, mask=row_ok, other=0.0)
    v = v * beta2 + mean * omb2
    h = tl.math.sqrt_rn(v) * bc2 + eps
    tl.store(v_ptr + rows, v, mask=row_ok)
    _precondition_write(
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
        h[:, None],
        v_ptr,
        v_ptr,
        1,
        eps,
        ROWS,
        COLS,
        BLOCK_DENOMINATOR,
        STOCHASTIC,
        APPLY_DECAY,
        F64,
    )


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
    lr = tl.load(sc_ptr + 0)
    inv_bc1 = tl.load(sc_ptr + 1)
    decay = tl.load(sc_ptr + 3)
    beta1 = tl.load(sc_ptr + 4)
    omb1 = tl.load(sc_ptr + 5)
    eps = tl.load(sc_ptr + 8)
    if STOCHASTIC:
        seed = tl.load(seed_ptr).to(tl.uint64)
    else:
        seed = 0
    if ROW_BLOCKS:  # each block in one row: its row, row root and row start once per block
        row = rows.to(tl.int64) * period // ncols
        a = tl.math.sqrt_rn(tl.load(rf_ptr + row, mask=row_ok, other=1.0))
        _precondition_write(
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
            a[:, None],
            rf_ptr,
            vc_ptr,
            (row * ncols)[:, None],
            eps,
            ROWS,
            COLS,
            FACTORED_ROW_DENOMINATOR,
            STOCHASTIC,
            APPLY_DECAY,
            F64,
        )
    else:
        _precondition_write(
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
            1.0,
            rf_ptr,
            vc_ptr,
            ncols,
            eps,
            ROWS,
            COLS,
            FACTORED_DENOMINATOR,
            STOCHASTIC,
            APPLY_DECAY,
            F64,
        )


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
    lr = tl.load(sc_ptr + 0)
    inv_bc1 = tl.load(sc_ptr + 1)
    decay = tl.load(sc_ptr + 3)
    beta1 = tl.load(sc_ptr + 4)
    omb1 = tl.load(sc_ptr + 5)
    eps = tl.load(sc_ptr + 8)
    if STOCHASTIC:
        seed = tl.load(seed_ptr).to(tl.uint64)
    else:
        seed = 0
    _precondition_write(
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
        1.0,
        v_ptr,
        sc_ptr,
        1,
        eps,
        ROWS,
        COLS,
        ELEMENT_DENOMINATOR,
        STOCHASTIC,
        APPLY_DECAY,
        F64,
    )


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


@triton.jit
def _entry_of(starts_ptr, entries, pid, SEARCH: tl.constexpr):
    """The entry whose programs hold ``pid`` (``starts``: each entry's first program, ascending,
    then the total) and ``pid``'s index among them, by ``SEARCH`` halvings."""
    lo = pid * 0
    hi = lo + entries
    for _ in tl.static_range(SEARCH):  # keeps starts[lo] <= pid < starts[hi]
        mid = (lo + hi) // 2
        below = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo, pid - tl.load(starts_ptr + lo)


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
    """One launch for every entry of a list that shares a dtype and a tile (issue 17: a step's
    launches grow with its groups, not its tensors). ``starts`` holds each entry's first
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
        g, u = _momentum(
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
        code, value = _requantize(u, m_new[:, None], safe[:, None], cb_ptr, mask, offs, seed, STOCHASTIC)
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


@triton.jit
def _stats_program(
    group, tile, g_ptr, row_part_ptr, col_part_ptr, nrows, ncols, rows_per_group, RB: tl.constexpr, CT: tl.constexpr
):
    """Program (group, column tile): float64 partial sums of g^2 of its rows and of its columns.

    Row partials go to ``row_part[tile, row]``, column partials to ``col_part[group, col]``;
    they are added in a fixed order afterwards (no atomics: deterministic).
    """
    cols = tile * CT + tl.arange(0, CT)
    col_ok = cols < ncols
    col_acc = tl.zeros((CT,), dtype=tl.float64)
    first = group * rows_per_group
    for r0 in range(0, rows_per_group, RB):
        rows = first + r0 + tl.arange(0, RB)
        row_ok = (rows < nrows) & (r0 + tl.arange(0, RB) < rows_per_group)
        mask = row_ok[:, None] & col_ok[None, :]
        g64 = _load_value(g_ptr, rows.to(tl.int64)[:, None] * ncols + cols[None, :], mask).to(tl.float64)
        sq = g64 * g64
        tl.store(row_part_ptr + tile.to(tl.int64) * nrows + rows, tl.sum(sq, axis=1), mask=row_ok)
        col_acc += tl.sum(sq, axis=0)
    tl.store(col_part_ptr + group.to(tl.int64) * ncols + cols, col_acc, mask=col_ok)


@triton.jit
def factored_stats_kernel(
    g_ptr, row_part_ptr, col_part_ptr, nrows, ncols, rows_per_group, RB: tl.constexpr, CT: tl.constexpr
):
    """:func:`_stats_program` of program ``(group, tile)`` of one matrix."""
    _stats_program(
        tl.program_id(0), tl.program_id(1), g_ptr, row_part_ptr, col_part_ptr, nrows, ncols, rows_per_group, RB, CT
    )


@triton.jit
def _moments(
    row_part_ptr,
    col_part_ptr,
    tiles,
    groups,
    v_row_ptr,
    v_col_ptr,
    sc_ptr,
    rf_ptr,
    nrows,
    ncols,
    BLOCK: tl.constexpr,
):
    """One matrix's ``v_row``/``v_col`` EMA from the float64 partials of :func:`_stats_program`
    (``tiles`` row partials of each row and ``groups`` column partials of each column, added in
    order), divided by the float64 ``max(rows, 1)``, ``max(cols, 1)`` (exact conversions of the
    sizes), the float64 mean of ``v_col`` (tiles added in order: deterministic) and
    ``row_factor = fl(fl(v_row / d) * BC2)``. float64 ``/`` is IEEE division on every backend
    (only fp32 division has an approximate form, hence ``div_rn`` there)."""
    bc2 = tl.load(sc_ptr + 2)
    beta2 = tl.load(sc_ptr + 6)
    omb2 = tl.load(sc_ptr + 7)
    # an empty dimension has means of 0; the sizes arrive as kernel arguments (a float64 tensor of
    # them from the host was a synchronising host-to-device copy per matrix and step)
    rows_f64 = tl.maximum(nrows, 1).to(tl.float64)
    cols_f64 = tl.maximum(ncols, 1).to(tl.float64)
    total = tl.zeros((), dtype=tl.float64)
    for c0 in range(0, ncols, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < ncols
        sums = tl.zeros((BLOCK,), dtype=tl.float64)
        part = col_part_ptr + cols
        for _ in range(0, groups):  # one row of partials after another (64-bit pointer steps)
            sums += tl.load(part, mask=ok, other=0.0)
            part += ncols
        mean = (sums / rows_f64).to(tl.float32)
        v = tl.load(v_col_ptr + cols, mask=ok, other=0.0) * beta2 + mean * omb2
        tl.store(v_col_ptr + cols, v, mask=ok)
        total += tl.sum(tl.where(ok, v.to(tl.float64), 0.0), axis=0)
    d = (total / cols_f64).to(tl.float32)
    d = tl.where(d < 1.1754943508222875e-38, 1.1754943508222875e-38, d)
    for r0 in range(0, nrows, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        ok = rows < nrows
        sums = tl.zeros((BLOCK,), dtype=tl.float64)
        part = row_part_ptr + rows
        for _ in range(0, tiles):
            sums += tl.load(part, mask=ok, other=0.0)
            part += nrows
        mean = (sums / cols_f64).to(tl.float32)
        v = tl.load(v_row_ptr + rows, mask=ok, other=0.0) * beta2 + mean * omb2
        tl.store(v_row_ptr + rows, v, mask=ok)
        tl.store(rf_ptr + rows, tl.math.div_rn(v, d + tl.zeros_like(v)) * bc2, mask=ok)


@triton.jit(do_not_specialize=["tiles", "groups", "nrows", "ncols"])  # a 1 stays a tensor (converted above)
def factored_moments_kernel(
    row_part_ptr, col_part_ptr, tiles, groups, v_row_ptr, v_col_ptr, sc_ptr, rf_ptr, nrows, ncols, BLOCK: tl.constexpr
):
    """:func:`_moments` of one matrix, one program."""
    _moments(row_part_ptr, col_part_ptr, tiles, groups, v_row_ptr, v_col_ptr, sc_ptr, rf_ptr, nrows, ncols, BLOCK)


#: int64 fields of one entry of ``stats_list_kernel``'s table: the addresses of the gradient and
#: of its row and column partials, then rows, columns, rows per group and column tiles.
STATS_FIELDS = tl.constexpr(7)
#: int64 fields of one entry of ``moments_list_kernel``'s table: the addresses of the row and
#: column partials, ``v_row``, ``v_col``, the step scalars and the row factors, then column
#: tiles, row groups, rows and columns.
MOMENTS_FIELDS = tl.constexpr(10)


@triton.jit
def stats_list_kernel(
    table_ptr, starts_ptr, entries, G_DTYPE: tl.constexpr, RB: tl.constexpr, CT: tl.constexpr, SEARCH: tl.constexpr
):
    """:func:`_stats_program` for every (group, tile) of every matrix of a list sharing a dtype
    and a column tile, in one launch."""
    entry, local = _entry_of(starts_ptr, entries, tl.program_id(0), SEARCH)
    row = table_ptr + entry.to(tl.int64) * STATS_FIELDS
    tiles = tl.load(row + 6)
    group = local // tiles
    _stats_program(
        group,
        local - group * tiles,
        tl.load(row + 0).to(tl.pointer_type(G_DTYPE)),
        tl.load(row + 1).to(tl.pointer_type(tl.float64)),
        tl.load(row + 2).to(tl.pointer_type(tl.float64)),
        tl.load(row + 3),
        tl.load(row + 4),
        tl.load(row + 5),
        RB,
        CT,
    )


@triton.jit
def _sum_partials(part_ptr, count, stride, out_ptr, n, BLOCK: tl.constexpr):
    """``out[i] = sum_k part[k * stride + i]`` over ``k < count``, added in order, for ``i < n``."""
    for i0 in range(0, n, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.zeros((BLOCK,), dtype=tl.float64)
        part = part_ptr + offs
        for _ in range(0, count):  # 64-bit pointer steps
            acc += tl.load(part, mask=ok, other=0.0)
            part += stride
        tl.store(out_ptr + offs, acc, mask=ok)


#: int64 fields of one entry of ``sums_list_kernel``'s table: the addresses of the row and column
#: partials and of the row and column sums, then column tiles, row groups, rows and columns.
SUMS_FIELDS = tl.constexpr(8)


@triton.jit
def sums_list_kernel(table_ptr, BLOCK: tl.constexpr):
    """Matrix ``program_id(0)``'s row and column sums from :func:`_stats_program`'s partials
    (``gefen::factored_stats.v2``), one program each, one launch for the list."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * SUMS_FIELDS
    rows = tl.load(row + 6)
    cols = tl.load(row + 7)
    _sum_partials(
        tl.load(row + 0).to(tl.pointer_type(tl.float64)),
        tl.load(row + 4),
        rows,
        tl.load(row + 2).to(tl.pointer_type(tl.float64)),
        rows,
        BLOCK,
    )
    _sum_partials(
        tl.load(row + 1).to(tl.pointer_type(tl.float64)),
        tl.load(row + 5),
        cols,
        tl.load(row + 3).to(tl.pointer_type(tl.float64)),
        cols,
        BLOCK,
    )


@triton.jit
def moments_list_kernel(table_ptr, BLOCK: tl.constexpr):
    """:func:`_moments` of matrix ``program_id(0)`` of a list, one program each, one launch."""
    row = table_ptr + tl.program_id(0).to(tl.int64) * MOMENTS_FIELDS
    _moments(
        tl.load(row + 0).to(tl.pointer_type(tl.float64)),
        tl.load(row + 1).to(tl.pointer_type(tl.float64)),
        tl.load(row + 6),
        tl.load(row + 7),
        tl.load(row + 2).to(tl.pointer_type(tl.float32)),
        tl.load(row + 3).to(tl.pointer_type(tl.float32)),
        tl.load(row + 4).to(tl.pointer_type(tl.float32)),
        tl.load(row + 5).to(tl.pointer_type(tl.float32)),
        tl.load(row + 8),
        tl.load(row + 9),
        BLOCK,
    )


@triton.jit
def _histogram(pid, g_ptr, counts_ptr, blocks, period, numel, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Adds each element's bin clamp(floor(fl(fl(g / max_block |g|) + 1) * 2048), 0, 4095)
    (blocks end at ``numel``: a ragged last block is shorter)."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < blocks
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        g = _load_value(g_ptr, offs, mask).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(g), axis=1))
    safe = tl.where(amax > 0.0, amax, 1.0)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        g = _load_value(g_ptr, offs, mask).to(tl.float32)
        z = tl.math.div_rn(g, safe[:, None])
        t = tl.floor((z + 1.0) * 2048.0)
        t = tl.minimum(tl.maximum(t, 0.0), 4095.0)
        ones = tl.full(t.shape, 1, dtype=tl.int64)
        tl.atomic_add(counts_ptr + t.to(tl.int32), ones, mask=mask)


@triton.jit
def histogram_kernel(g_ptr, counts_ptr, blocks, period, numel, ROWS: tl.constexpr, COLS: tl.constexpr):
    """One gradient's launch (what a captured CUDA graph replays; see ``histogram_list_kernel``)."""
    _histogram(tl.program_id(0), g_ptr, counts_ptr, blocks, period, numel, ROWS, COLS)


#: int64 fields of one entry of ``histogram_list_kernel``'s table: the gradient's address, then
#: its blocks, period and elements.
HISTOGRAM_FIELDS = tl.constexpr(4)


@triton.jit
def histogram_list_kernel(
    table_ptr, starts_ptr, entries, counts_ptr, G_DTYPE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    SEARCH: tl.constexpr,
):  # fmt: skip
    """:func:`_histogram` for every gradient of a list sharing a dtype and a tile, in one launch
    (as ``step_list_kernel``)."""
    entry, local = _entry_of(starts_ptr, entries, tl.program_id(0), SEARCH)
    row = table_ptr + entry.to(tl.int64) * HISTOGRAM_FIELDS
    _histogram(
        local,
        tl.load(row + 0).to(tl.pointer_type(G_DTYPE)),
        counts_ptr,
        tl.load(row + 1),
        tl.load(row + 2),
        tl.load(row + 3),
        ROWS,
        COLS,
    )


@triton.jit
def uniform_kernel(seed_ptr, index_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    index = tl.load(index_ptr + offs, mask=mask, other=0)
    seed = tl.load(seed_ptr).to(tl.uint64)
    tl.store(out_ptr + offs, _uniform(seed, index.to(tl.uint64)), mask=mask)

# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-any-return"
"""Triton kernels for the gradient statistics (launched by :mod:`gefen_kernels.triton_ops`):
the float64 sums of squares of factored matrices and the ``v_row``/``v_col`` update built on
them, and the codebook histogram of block-normalised gradients.

Numerics as in :mod:`gefen_kernels.triton_kernels` (``enable_fp_fusion=False``, correctly
rounded ``div_rn``, float64 sums added in a fixed order: no float atomics; the histogram's
integer atomics are exact in any order). Each kernel has a one-matrix form and a list form
that reads its entries from an int64 table (``triton_elements._entry_of``).
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from .triton_elements import _entry_of, _load_value, _widen

# ruff: noqa: N803  (constexpr parameters are upper case)


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
        g64 = _widen(_load_value(g_ptr, rows.to(tl.int64)[:, None] * ncols + cols[None, :], mask)).to(tl.float64)
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
        g = _widen(_load_value(g_ptr, offs, mask)).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(g), axis=1))
    safe = tl.where(amax > 0.0, amax, 1.0)
    for c0 in range(0, period, COLS):
        cols = c0 + tl.arange(0, COLS)
        offs = rows.to(tl.int64)[:, None] * period + cols[None, :]
        mask = row_ok[:, None] & (cols < period)[None, :] & (offs < numel)
        g = _widen(_load_value(g_ptr, offs, mask)).to(tl.float32)
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

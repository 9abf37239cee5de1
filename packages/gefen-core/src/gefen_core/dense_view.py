"""Dense fp32 views of the compact per-parameter state, by flat element range.

Portable documents carry the *meaning* of the state, not
its encoding: for one local tensor of ``n`` elements (row-major), period ``P`` and
``B = n / P`` blocks,

* **momentum** ``m_i = C[q_i] * M_b`` (fp32, bit for bit what the step decodes);
* **block second moment** ``v_i = vmean_b``: each block's value repeated over its elements;
* **factored second moment** of an ``R x K`` matrix: the estimate the step uses before bias
  correction, ``V_ij = v_row_i * v_col_j / d`` with ``d = max(fl(mean(v_col)), FLT_MIN)``
  (:func:`gefen_core.second_moment.column_scale`), computed in float64 and rounded once;
* **NorMuon row statistic** ``normuon_v_i`` repeated along row ``i``.

Every function reads a flat range ``[start, stop)`` (or a row range) in sub-chunks of at
most :data:`DECODE_CHUNK_ELEMENTS` elements on the state's device and returns a fresh,
contiguous fp32 CPU tensor, so decoding a slice of a huge tensor never materialises the
whole of it and never aliases live state.

:func:`factored_statistics` is the way back for the factored representation: float64 row
means and column sums of a dense field (a rank-1 field ``outer(r, c) / mean(c)`` gives back
``r`` and ``c * mean(r) / mean(c)``, which reproduce it to fp32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .second_moment import column_scale

__all__ = [
    "DECODE_CHUNK_ELEMENTS",
    "block_values",
    "decode_momentum",
    "factored_rows",
    "factored_statistics",
    "factored_values",
    "row_values",
]

#: Elements decoded per sub-chunk: about 1 MiB of transient buffers (int32 codes, fp32
#: gather, fp32 scales, fp32 product), small next to any chunk a checkpoint writer holds
#: (a DCP save's bound is per parameter held, so this fixed transient weighs more on more ranks).
DECODE_CHUNK_ELEMENTS = 1 << 16


def _range(numel: int, start: int, stop: int | None) -> tuple[int, int]:
    end = numel if stop is None else stop
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {numel} elements")
    return start, end


def _blockwise(
    period: int,
    start: int,
    stop: int,
    out: torch.Tensor,
    block_values_of: Callable[[int, int, int, int], torch.Tensor],
) -> None:
    """Fill ``out`` (the flat range ``[start, stop)``) block range by block range.

    ``block_values_of(first_block, last_block, lo, hi)`` returns the fp32 values of flat
    elements ``[lo, hi)``, which lie in blocks ``[first_block, last_block)``.
    """
    position = start
    while position < stop:
        block = position // period
        if period <= DECODE_CHUNK_ELEMENTS:
            count = max(1, DECODE_CHUNK_ELEMENTS // period)
            hi = min(stop, (block + count) * period)
            last = -(-hi // period)
        else:  # one huge block: a sub-range of it
            hi = min(stop, (block + 1) * period, position + DECODE_CHUNK_ELEMENTS)
            last = block + 1
        values = block_values_of(block, last, position, hi)
        out[position - start : hi - start].copy_(values)
        position = hi


def decode_momentum(
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    codebook: torch.Tensor,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """Flat elements ``[start, stop)`` of the momentum ``C[q] * M`` (fresh fp32 CPU tensor).

    ``indices`` uint8 ``[B, P]``, ``magnitude`` fp32 ``[B, 1]``, ``codebook`` fp32 (any
    device: moved to the state's device for the gather). Equal bit for bit to
    :func:`gefen_core.momentum_codec.dequantize` over the whole tensor.
    """
    blocks, period = indices.shape
    first, last = _range(blocks * period, start, stop)
    out = torch.empty(last - first, dtype=torch.float32)
    if last == first:
        return out
    table = codebook.to(device=indices.device, dtype=torch.float32)
    flat_indices = indices.reshape(-1)
    scales = magnitude.reshape(-1)

    def values(block: int, end_block: int, lo: int, hi: int) -> torch.Tensor:
        codes = flat_indices[lo:hi].to(torch.int32)
        gathered = table.index_select(0, codes)
        if end_block - block == 1:
            return gathered * scales[block : block + 1]
        span = scales[block:end_block].repeat_interleave(period)[lo - block * period : hi - block * period]
        return gathered * span

    _blockwise(period, first, last, out, values)
    return out


def block_values(vmean: torch.Tensor, period: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Flat elements ``[start, stop)`` of a block field (``vmean`` ``[B, 1]`` repeated ``period`` times)."""
    blocks = vmean.shape[0]
    first, last = _range(blocks * period, start, stop)
    out = torch.empty(last - first, dtype=torch.float32)
    if last == first:
        return out
    flat = vmean.reshape(-1).to(torch.float32)

    def values(block: int, end_block: int, lo: int, hi: int) -> torch.Tensor:
        if end_block - block == 1:
            return flat[block : block + 1].expand(hi - lo)
        return flat[block:end_block].repeat_interleave(period)[lo - block * period : hi - block * period]

    _blockwise(period, first, last, out, values)
    return out


def factored_rows(
    v_row: torch.Tensor, v_col: torch.Tensor, row_start: int = 0, row_stop: int | None = None
) -> torch.Tensor:
    """Rows ``[row_start, row_stop)`` of the dense factored second moment (fresh fp32 CPU ``[rows, K]``).

    ``v_row`` holds the rows this process keeps (all of them, or a row shard's), ``v_col``
    every column; the normaliser ``d`` is computed from ``v_col`` as the step computes it.
    """
    rows = v_row.numel()
    first, last = _range(rows, row_start, row_stop)
    cols = v_col.numel()
    out = torch.empty(last - first, cols, dtype=torch.float32)
    if last == first or cols == 0:
        return out
    scale = column_scale(v_col.to(torch.float32)).to(torch.float64)
    columns = v_col.to(torch.float64).reshape(1, cols) / scale
    step = max(1, DECODE_CHUNK_ELEMENTS // cols)
    for lo in range(first, last, step):
        hi = min(last, lo + step)
        block = v_row[lo:hi].to(torch.float64).reshape(-1, 1) * columns
        out[lo - first : hi - first].copy_(block.to(torch.float32))
    return out


def factored_values(v_row: torch.Tensor, v_col: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Flat elements ``[start, stop)`` of the dense factored second moment (fresh fp32 CPU tensor)."""
    cols = v_col.numel()
    first, last = _range(v_row.numel() * cols, start, stop)
    out = torch.empty(last - first, dtype=torch.float32)
    if last == first:
        return out
    rows_per_chunk = max(1, DECODE_CHUNK_ELEMENTS // cols)
    position = first
    while position < last:
        row = position // cols
        end_row = min(-(-last // cols), row + rows_per_chunk)
        hi = min(last, end_row * cols)
        dense = factored_rows(v_row, v_col, row, end_row).reshape(-1)
        out[position - first : hi - first].copy_(dense[position - row * cols : hi - row * cols])
        position = hi
    return out


def row_values(per_row: torch.Tensor, cols: int, row_start: int = 0, row_stop: int | None = None) -> torch.Tensor:
    """Rows ``[row_start, row_stop)`` of a per-row statistic (``[R, 1]``) repeated over ``cols`` columns."""
    rows = per_row.shape[0]
    first, last = _range(rows, row_start, row_stop)
    values = per_row.reshape(-1)[first:last].to(device="cpu", dtype=torch.float32)
    return values.reshape(-1, 1).expand(last - first, cols).contiguous()


def factored_statistics(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row means, column sums)`` of a dense ``[rows, K]`` field, both float64.

    Row means re-factor exactly what a row shard holds; column *sums* must be added over
    every row of the parameter (all shards) and divided by the global row count to give the
    column statistic, which is why they are returned unreduced.
    """
    if dense.dim() != 2:
        raise ValueError(f"factored_statistics needs a 2-D field, got shape {tuple(dense.shape)}")
    rows, cols = dense.shape
    row_means = torch.zeros(rows, dtype=torch.float64)
    col_sums = torch.zeros(cols, dtype=torch.float64)
    if rows == 0 or cols == 0:
        return row_means, col_sums
    step = max(1, DECODE_CHUNK_ELEMENTS // cols)
    for lo in range(0, rows, step):
        wide = dense[lo : lo + step].to(torch.float64)
        row_means[lo : lo + wide.shape[0]] = wide.sum(dim=1) / cols
        col_sums += wide.sum(dim=0)
    return row_means, col_sums

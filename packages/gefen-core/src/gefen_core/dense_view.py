"""The dense factored second moment, by flat element range, and the way back.

When a portable import re-blocks a factored source for a target that keeps a block second
moment (or a piece of the matrix), it needs the dense values the step uses before bias
correction: for an ``R x K`` matrix ``V_ij = v_row_i * v_col_j / d`` with
``d = max(fl(mean(v_col)), FLT_MIN)`` (:func:`gefen_core.second_moment.column_scale`),
computed in float64 and rounded once. The functions read a flat range ``[start, stop)``
(or a row range) in sub-chunks of at most :data:`DECODE_CHUNK_ELEMENTS` elements and
return a fresh, contiguous fp32 CPU tensor, so a slice of a huge matrix never
materialises the whole of it.

:func:`factored_statistics` is the way back for the factored representation: float64 row
means and column sums of a dense field (a rank-1 field ``outer(r, c) / mean(c)`` gives back
``r`` and ``c * mean(r) / mean(c)``, which reproduce it to fp32 rounding).
"""

from __future__ import annotations

import torch

from .second_moment import column_scale

__all__ = ["DECODE_CHUNK_ELEMENTS", "factored_rows", "factored_statistics", "factored_values"]

#: Elements computed per sub-chunk: about 1 MiB of transient float64 buffers, small next to
#: the piece an import re-encodes.
DECODE_CHUNK_ELEMENTS = 1 << 16


def _range(numel: int, start: int, stop: int | None) -> tuple[int, int]:
    end = numel if stop is None else stop
    if not 0 <= start <= end <= numel:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {numel} elements")
    return start, end


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

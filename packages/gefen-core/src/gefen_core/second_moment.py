"""Factored (Adafactor-style) second moment of a 2-D parameter: the small O(R + K) part.

For an ``R x K`` parameter Gefen keeps ``v_row`` (fp32 ``[R]``) and ``v_col`` (fp32 ``[K]``),
EMAs of the row and column means of ``g^2``, and estimates the per-element second moment as
``V_ij = v_row_i * v_col_j / max(mean(v_col), FLT_MIN)``, bias-corrected by the EMA's own age.

``mean(v_col)`` replaces the reference's ``mean(v_row)``: both are the EMA of the global
mean of ``g^2`` and are equal in exact arithmetic, and the column vector is replicated
when the rows are sharded (FSDP2 ``Shard(0)``), so no extra collective is needed.

Exact arithmetic (``fl`` = round to fp32; ``S`` = the packed step scalars)::

    row_mean_i = fl(row_sumsq_i / K)           col_mean_j = fl(col_sumsq_j / R)   (float64 /; a 0 divisor counts as 1)
    v_row_i    = fl( fl(v_row_i * BETA2) + fl(row_mean_i * ONE_MINUS_BETA2) )      (same for v_col)
    d          = max( fl( (sum_j float64(v_col_j)) / K ), FLT_MIN )
    row_factor_i = fl( fl(v_row_i / d) * BC2 )                                       (BC2 = 1/(1-beta2^tau))

``R`` is the parameter's global row count; ``row_sumsq`` covers the local rows.

Update clipping (Adafactor's, threshold ``D``; the group option ``clip_threshold``). The
preconditioned gradient ``n = g / h`` that enters the momentum, with the kernels' per-element
denominators ``h_ij = fl(fl(a_i * b_j) + EPS)``, ``a_i = fl(sqrt(row_factor_i))``,
``b_j = fl(sqrt(v_col_j))``, is scaled down when its RMS over the whole matrix exceeds ``D``::

    n_ij  = fl(g_ij / h_ij)
    ms    = fl( (sum_ij float64(n_ij)^2) / (R K) )     # float64 sum over every row (all shards)
    kappa = max( fl( fl(sqrt(ms)) / D ), 1 )
    row_factor_i' = fl(row_factor_i * fl(kappa * kappa))

The kernels then run with ``row_factor'``, so every denominator grows by about ``kappa`` and the
matrix's preconditioned gradient has RMS about ``D``; the second moment's state is not changed.
With ``kappa = 1`` (no clipping) ``row_factor'`` is ``row_factor`` bit for bit. A factored ``V``
lets a few elements whose ``g^2`` is far above their row and column means take steps far
beyond Adam's (whose per-element ``v`` bounds each one); clipping bounds the matrix's steps
as a whole. Off by default (``clip_threshold=None``): at ``D = 1`` it wins 1.9-3.3 % of loss on
``char-mini`` and costs 2.2 % on real text (``pydoc-bytes``); the gefen-core README has the figures.
"""

from __future__ import annotations

import functools

import torch

from . import step_scalars as S

#: Elements per chunk of :func:`preconditioned_sumsq` (bounds its temporaries).
_CHUNK_ELEMENTS = 1 << 20

__all__ = [
    "FLT_MIN",
    "clip_row_factor",
    "column_scale",
    "fp32_sqrt",
    "preconditioned_sumsq",
    "update_factored_moments",
]

#: Smallest normal fp32 number; the floor of the factored normaliser.
FLT_MIN = float(torch.finfo(torch.float32).tiny)


@functools.lru_cache(maxsize=512)
def _divisor(value: float, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``value`` as a ``[1]`` tensor to divide by (a tensor, not a Python number: some backends
    turn a division by a scalar into a multiplication by its reciprocal). Cached: a step divides
    by the same few values every time, and a fresh tensor costs more than the division."""
    return torch.full((1,), float(value), dtype=dtype, device=device)


def _divide(total: torch.Tensor, count: int) -> torch.Tensor:
    """``total / count`` in float64; a count of 0 (an empty matrix: every sum is 0) divides by 1,
    so an empty dimension gives means of 0, not NaN."""
    return torch.div(total, _divisor(max(count, 1), total.device))


def column_scale(v_col: torch.Tensor) -> torch.Tensor:
    """``max(fl(mean(v_col)), FLT_MIN)`` as a fp32 ``[1]`` tensor (mean accumulated in float64)."""
    return _divide(v_col.to(torch.float64).sum(), v_col.numel()).to(torch.float32).clamp_(min=FLT_MIN)


def update_factored_moments(
    v_row: torch.Tensor,
    v_col: torch.Tensor,
    row_sumsq: torch.Tensor,
    col_sumsq: torch.Tensor,
    global_rows: int,
    scalars: torch.Tensor,
) -> torch.Tensor:
    """Advance ``v_row``/``v_col`` in place from float64 sums of squares; return ``row_factor``.

    ``col_sumsq`` must already be summed over every row of the parameter (all shards). Every
    operation is one elementwise op rounded to fp32 (in place where the operand is a
    temporary), so the results are those of the formulas in the module docstring bit for bit.
    """
    beta2 = scalars[S.BETA2]
    one_minus_beta2 = scalars[S.ONE_MINUS_BETA2]
    row_mean = _divide(row_sumsq, v_col.numel()).to(torch.float32)
    col_mean = _divide(col_sumsq, global_rows).to(torch.float32)
    v_row.mul_(beta2).add_(row_mean.mul_(one_minus_beta2))
    v_col.mul_(beta2).add_(col_mean.mul_(one_minus_beta2))
    return torch.div(v_row, column_scale(v_col)).mul_(scalars[S.BC2])


def fp32_sqrt(values: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root, as the kernels' ``sqrtf``: through float64, which is
    exact enough that the one rounding back to fp32 is the correct one (torch's vectorised fp32
    ``sqrt`` on CPU is sometimes one ulp off, e.g. for 0.010247663)."""
    return values.double().sqrt().float()


def preconditioned_sumsq(
    grad: torch.Tensor, row_factor: torch.Tensor, v_col: torch.Tensor, scalars: torch.Tensor
) -> torch.Tensor:
    """``sum_ij float64(fl(g_ij / h_ij))^2`` over the local rows of ``grad`` (float64 ``[1]``),
    with the factored step's denominators (module docstring); chunked by rows."""
    rows, cols = grad.shape
    row_roots, col_roots = fp32_sqrt(row_factor), fp32_sqrt(v_col)
    eps = scalars[S.EPS]
    total = torch.zeros(1, dtype=torch.float64, device=grad.device)
    per_chunk = max(1, _CHUNK_ELEMENTS // max(1, cols))
    for first in range(0, rows, per_chunk):
        last = min(rows, first + per_chunk)
        denominator = (row_roots[first:last, None] * col_roots[None, :]).add_(eps)
        preconditioned = torch.div(grad[first:last].to(torch.float32), denominator).double()
        total += preconditioned.square_().sum()
    return total


def clip_row_factor(row_factor: torch.Tensor, sumsq: torch.Tensor, elements: int, threshold: float) -> torch.Tensor:
    """``row_factor'`` of the module docstring: ``sumsq`` is :func:`preconditioned_sumsq` summed
    over every row of the matrix (``elements = R K``). No host synchronisation."""
    rms = fp32_sqrt(_divide(sumsq, elements).to(torch.float32))
    kappa = torch.div(rms, _divisor(threshold, rms.device, torch.float32)).clamp_(min=1.0)
    return row_factor * kappa.mul_(kappa)

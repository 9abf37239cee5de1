"""Shape-batched Newton-Schulz (``batched_ns=True``, opt-in, approximate).

Many small matrices of one shape run the iteration as ``[B, m, n]`` batched GEMMs
(``bmm`` / ``baddbmm``) instead of ``B`` separate calls, which pays on devices where one small
GEMM cannot fill the machine. The result is close to the serial iteration but not bit-equal
(another reduction order; tested within 2e-2 relative L2 and 2e-2 max abs), and it depends on
how items were chunked. The quantized momentum state is bit-identical either way.

Eligibility (:func:`shape_eligible`): ``rows, cols > 0``, ``min(rows, cols) <= 512`` and
``rows * cols <= 2**20``. The optimizer adds: the group opted in, the parameter is not a
sharded DTensor, ``fp8_ns`` is off, no CUDA-graph capture and no ``torch.compile`` tracing.

Memory (:func:`workspace_bytes`, bf16, ``m``/``n`` the small/large dimension):
``W(B) = B * 2 * (3 m n + 2 m^2)`` bytes (three ``m x n`` buffers, two ``m x m`` Gram buffers).
:func:`plan_chunks` cuts ``count`` same-shape items into chunks of at most
``cap = budget // W(1)`` and at least :data:`MIN_BATCH` items; what cannot form such a chunk
runs serially (bit-identical to ``batched_ns=False``).
"""

from __future__ import annotations

import torch

from .newton_schulz import Schedule

__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "MAX_MIN_DIM",
    "MAX_NUMEL",
    "MIN_BATCH",
    "chunk_capacity",
    "newton_schulz_batched",
    "plan_chunks",
    "shape_eligible",
    "workspace_bytes",
]

MIN_BATCH = 8
MAX_MIN_DIM = 512
MAX_NUMEL = 1 << 20
DEFAULT_WORKSPACE_BYTES = 256 << 20


def shape_eligible(rows: int, cols: int) -> bool:
    """The shape gate of the module docstring."""
    return rows > 0 and cols > 0 and min(rows, cols) <= MAX_MIN_DIM and rows * cols <= MAX_NUMEL


def workspace_bytes(batch: int, rows: int, cols: int) -> int:
    """``W(B) = B * 2 * (3 m n + 2 m^2)`` bytes for ``batch`` matrices of ``rows x cols``."""
    small, large = min(rows, cols), max(rows, cols)
    return batch * 2 * (3 * small * large + 2 * small * small)


def chunk_capacity(rows: int, cols: int, budget: int) -> int:
    """The most matrices of this shape one chunk may hold within ``budget`` bytes."""
    return budget // workspace_bytes(1, rows, cols)


def plan_chunks(count: int, cap: int) -> tuple[list[int], int]:
    """Chunk sizes for ``count`` items with at most ``cap`` per chunk, and the serial remainder.

    Every chunk holds between :data:`MIN_BATCH` and ``cap`` items. With ``full, rem =
    divmod(count, min(cap, count))``: a remainder of at least 8 is its own chunk; a smaller one
    is merged with the last full chunk into two near-equal chunks when both reach 8 items;
    otherwise it runs serially. ``count < 8`` or ``cap < 8`` runs everything serially.
    """
    if count < MIN_BATCH or cap < MIN_BATCH:
        return [], count
    cap = min(cap, count)
    full, rem = divmod(count, cap)
    if rem == 0:
        return [cap] * full, 0
    if rem >= MIN_BATCH:
        return [cap] * full + [rem], 0
    merged = cap + rem
    if merged >= 2 * MIN_BATCH:
        return [cap] * (full - 1) + [(merged + 1) // 2, merged // 2], 0
    return [cap] * full, rem


def newton_schulz_batched(stack: torch.Tensor, schedule: Schedule, eps: float) -> torch.Tensor:
    """Orthogonalise each matrix of a ``[batch, rows, cols]`` stack (bf16 result, same orientation).

    Each matrix is scaled by its own Frobenius norm (floored at ``eps``); tall stacks are
    transposed to wide for the iteration and back for the result.
    """
    if stack.dim() != 3:
        raise ValueError(f"newton_schulz_batched needs a [batch, rows, cols] stack, got shape {tuple(stack.shape)}")
    x = stack.to(dtype=torch.bfloat16)  # (no copy: the division below writes a new tensor)
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.transpose(1, 2)
    norms = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    x = (x / norms).contiguous()
    other = torch.empty_like(x)
    for a, b, c in schedule:
        gram = torch.bmm(x, x.transpose(1, 2))
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        torch.baddbmm(x, update, x, beta=a, out=other)
        x, other = other, x
    return x.transpose(1, 2) if tall else x

"""Learning the shared momentum codebook, and re-expressing indices in a new one.

One fp32 256-entry codebook serves every parameter of an optimizer. It is learned from a
4096-bin histogram of block-normalised gradients (each block divided by its own max |g|)
by the exact pinned k-means of :mod:`gefen_core.exact_dp`. Histograms of several devices
are summed as int64 on the host; the solve runs on the host in float64 and is rounded
once to fp32, so identical inputs give byte-identical codebooks everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .exact_dp import codebook_solve_reference
from .momentum_codec import CODEBOOK_SIZE, bucket_occupancy_ok, nearest_codeword
from .reference_ops import CHUNK_ELEMENTS, HISTOGRAM_BINS

__all__ = ["HISTOGRAM_BATCH_ELEMENTS", "codebook_from_counts", "gradient_histogram", "requantize", "validate_codebook"]

#: Elements :func:`gradient_histogram` passes to one call of the histogram op at most (the
#: items of one call stay alive together; 2^26 fp32 elements are 256 MiB).
HISTOGRAM_BATCH_ELEMENTS = 1 << 26

OpRunner = Callable[..., Any]


def gradient_histogram(
    items: Iterable[tuple[torch.Tensor, int]], histogram: OpRunner, *, deterministic: bool
) -> torch.Tensor:
    """Sum of the block-normalised histograms of ``(gradient, period)`` items (int64 CPU ``[4096]``).

    ``histogram`` runs the ``gefen::histogram.v2`` op (``Kernels.op(HISTOGRAM)``): one call per
    device for up to :data:`HISTOGRAM_BATCH_ELEMENTS` elements, since the items may be copies
    made for the histogram (negated gradients of ``maximize``), which a call keeps alive together.
    """
    pending: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
    held: dict[torch.device, int] = {}  # elements pending per device
    counts: dict[torch.device, torch.Tensor] = {}

    def flush(device: torch.device) -> None:
        grads, periods = pending.pop(device)
        held.pop(device)
        if device not in counts:
            counts[device] = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64, device=device)
        histogram(grads, periods, counts[device], deterministic=deterministic)

    for gradient, period in items:
        if gradient.numel():
            grads, periods = pending.setdefault(gradient.device, ([], []))
            grads.append(gradient.contiguous())
            periods.append(period)
            held[gradient.device] = held.get(gradient.device, 0) + gradient.numel()
            if held[gradient.device] >= HISTOGRAM_BATCH_ELEMENTS:
                flush(gradient.device)
    for device in list(pending):
        flush(device)
    total = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    for device_counts in counts.values():
        total += device_counts.cpu()
    return total


#: The largest histogram total the exact DP's int64 sums hold (weights times squared positions
#: of up to ``HISTOGRAM_BINS``), less one count per bin for the rounding of :func:`_in_exact_range`.
_EXACT_TOTAL = (2**62 - 1) // HISTOGRAM_BINS**2 - HISTOGRAM_BINS


def _in_exact_range(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``counts`` halved as often as the exact DP needs (about 2.7e11 elements: a histogram summed
    over a mesh or scope of a very large model), every occupied bin kept occupied. The counts are
    the same on every rank, so is the result; the solve is then optimal for weights rounded to
    about 38 bits."""
    if total <= _EXACT_TOTAL:
        return counts
    shift = (total // _EXACT_TOTAL).bit_length()
    return torch.where(counts > 0, (counts >> shift).clamp(min=1), counts)


def codebook_from_counts(counts: torch.Tensor, solve: OpRunner = codebook_solve_reference) -> torch.Tensor | None:
    """The optimal fp32 CPU codebook for a histogram, or ``None`` when it holds no shape: empty,
    or every count in zero's bin (every block it counted was all zero; a block with any non-zero
    value puts its maximum in an end bin). ``solve`` runs the ``gefen::codebook_solve.v2`` op
    (``Kernels.op(CODEBOOK_SOLVE)``: gefen-kernels' C solve, about 10x the numpy reference's
    speed, gives the same codebook bit for bit); the reference by default."""
    total = sum(counts.tolist())  # Python ints: an int64 sum wraps past 2^63 and slipped through
    # a refresh counts zero gradients too: from zeros alone it would learn {-1, ~0, +1} and
    # requantise every live momentum into three levels
    if total == 0 or int(counts[HISTOGRAM_BINS // 2]) == total:
        return None
    codebook: torch.Tensor = solve(_in_exact_range(counts, total)).to(torch.float32)
    # Free centres are at least one bin apart, and 0 shares its bucket with at most the centre
    # of bin 2048 (the centres of one side's points lie on that side), so this always holds.
    assert bucket_occupancy_ok(codebook), "a learned codebook broke the lookup precondition"
    return codebook


def validate_codebook(codebook: object, where: str) -> torch.Tensor:
    """A codebook must be a finite, ascending fp32 ``[256]`` tensor from exactly -1 to +1."""
    from gefen_contracts import StateValidationError

    if not isinstance(codebook, torch.Tensor):
        raise StateValidationError(f"{where} must be a tensor, got {type(codebook).__name__}")
    if codebook.dtype is not torch.float32 or tuple(codebook.shape) != (CODEBOOK_SIZE,):
        raise StateValidationError(
            f"{where} must be float32 of shape ({CODEBOOK_SIZE},), got {codebook.dtype} {tuple(codebook.shape)}"
        )
    values = codebook.detach().cpu()
    if not torch.isfinite(values).all():
        raise StateValidationError(f"{where} must be finite")
    if (values[1:] < values[:-1]).any():
        raise StateValidationError(f"{where} must be sorted in non-decreasing order")
    if float(values[0]) != -1.0 or float(values[-1]) != 1.0:
        raise StateValidationError(f"{where} must start at exactly -1 and end at exactly +1")
    if not bucket_occupancy_ok(values):
        raise StateValidationError(f"{where} packs more than two codewords below +1 into one 1/2048-wide bucket")
    return values


def requantize(indices: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """New uint8 indices: each old coefficient ``old[q]`` mapped to its nearest codeword in ``new``."""
    flat = indices.reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        stop = min(flat.numel(), start + CHUNK_ELEMENTS)
        out[start:stop] = nearest_codeword(new, old.index_select(0, flat[start:stop].to(torch.int32)))
    return out.view_as(indices)

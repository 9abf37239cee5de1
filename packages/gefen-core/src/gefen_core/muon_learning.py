"""Learning GefenMuon's codebook and periods at its first step with a non-zero gradient.

The codebook and periods are Gefen's (:mod:`gefen_core.codebook`, :mod:`gefen_core.periods`):
each matrix's period follows its shape (:func:`gefen_core.periods.shape_period`; GefenMuon
has no period-one overrides), and one codebook is solved
from the 4096-bin histogram of every contributing, block-normalised gradient.

What contributes, and where:

* local matrices (plain tensors, replicated DTensors) and ``"approx"`` shards: this rank's
  own gradient;
* ``"exact"`` and ``"distributed"`` DTensors: the **full** gradient, brought to one rank (the
  matrix's owner, :func:`gefen_core.muon_owners.gather_to_owners`), which computes its period
  and histogram. Each matrix is counted once, on one rank, so the summed histogram equals a
  single process's on the same gradients (the reference all-gathered every matrix to every
  rank instead).

With a scope (:mod:`gefen_core.muon_distributed`), one ``all_reduce`` sums the histograms and
shares the scope matrices' periods, so every member solves the identical codebook (exact and
distributed updates need it) and knows every exact matrix's period. Without one, learning is
rank-local. A matrix whose (full) gradient is all zero contributes nothing and gets no period
yet; if nothing contributes, no codebook is learned and the next step tries again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .codebook import codebook_from_counts, gradient_histogram
from .muon_distributed import APPROX, DISTRIBUTED, EXACT, LOCAL, MuonScope, vote
from .muon_owners import BucketItem, gather_to_owners, owner_buckets
from .muon_plan import MuonItem
from .ops import CODEBOOK_SOLVE, HISTOGRAM, Kernels
from .periods import shape_period
from .reference_ops import HISTOGRAM_BINS

__all__ = ["LearningResult", "is_nonzero", "learn_codebook"]


@dataclass(slots=True)
class LearningResult:
    """The codebook (``None`` when nothing contributed), periods by slot, and the full gradients
    of the distributed matrices this rank owns (reused by the step, so they travel once)."""

    codebook: torch.Tensor | None
    periods: dict[int, int] = field(default_factory=dict)
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)


def is_nonzero(gradient: torch.Tensor) -> bool:
    """Whether a gradient has a non-zero element (an empty one has none)."""
    return bool(gradient.numel()) and bool(gradient.ne(0).any())


def _contribute(
    gradient: torch.Tensor, shape: tuple[int, int], dispatch: Kernels, deterministic: bool, counts: torch.Tensor
) -> int:
    period = shape_period(shape, gradient.numel())
    counts += gradient_histogram([(gradient, period)], dispatch.op(HISTOGRAM), deterministic=deterministic)
    return period


def learn_codebook(
    active: Sequence[MuonItem], scope: MuonScope | None, dispatch: Kernels, *, deterministic: bool
) -> LearningResult:
    """Learn from this step's gradients (module docstring); collective over ``scope``."""
    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    result = LearningResult(None)
    error: BaseException | None = None
    try:
        for item in active:
            if item.mode in (LOCAL, APPROX) and is_nonzero(item.local_grad):
                result.periods[item.slot] = _contribute(item.local_grad, item.shape, dispatch, deterministic, counts)
    except Exception as exc:
        error = exc
    shared = [item for item in active if item.mode in (EXACT, DISTRIBUTED)]
    if scope is None or not shared:
        vote(scope, "codebook learning", error)
        if scope is not None:
            counts = _reduce(scope, counts, [], {})[0]
        result.codebook = codebook_from_counts(counts, dispatch.op(CODEBOOK_SOLVE))
        return result
    for bucket in owner_buckets([item.owner or 0 for item in shared], scope.world):
        items = [shared[index] for index in bucket]
        pieces: list[torch.Tensor] = []
        try:
            pieces = [item.local_grad.contiguous() for item in items]
        except Exception as exc:
            error = error or exc
        vote(scope, "bucket gather", error)
        metadata = [BucketItem(item.owner or 0, item.shape, item.local_grad.dtype) for item in items]
        full = gather_to_owners(scope, metadata, pieces)
        try:
            for item, gradient in zip(items, full):
                if gradient is None:
                    continue
                if item.mode == DISTRIBUTED:
                    result.gathered[item.slot] = gradient
                if is_nonzero(gradient):
                    result.periods[item.slot] = _contribute(gradient, item.shape, dispatch, deterministic, counts)
        except Exception as exc:
            error = exc
    vote(scope, "codebook learning", error)
    counts, periods = _reduce(scope, counts, shared, result.periods)
    result.periods.update(periods)
    result.codebook = codebook_from_counts(counts, dispatch.op(CODEBOOK_SOLVE))
    return result


def _reduce(
    scope: MuonScope, counts: torch.Tensor, shared: Sequence[MuonItem], periods: dict[int, int]
) -> tuple[torch.Tensor, dict[int, int]]:
    """Sum the histograms and the owners' periods over the scope (one ``all_reduce``)."""
    import torch.distributed as dist

    owned = [periods.get(item.slot, 0) if item.owner == scope.rank else 0 for item in shared]
    packet = torch.cat([counts, torch.tensor(owned, dtype=torch.int64)]).to(scope.device)
    dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=scope.group)
    packet = packet.cpu()
    reduced = packet[HISTOGRAM_BINS:].tolist()
    return packet[:HISTOGRAM_BINS].clone(), {item.slot: int(period) for item, period in zip(shared, reduced) if period}

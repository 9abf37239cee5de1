"""Learning periods and the codebook over a codebook scope, one logical parameter at a time.

The aim is what one process would learn from the complete logical gradients, whatever the
placement: every member ends with the same codebook and, for shared parameters, the same
periods. Parameters are named by FQN (the manifest's sorted FQNs are the common index):

1. **Which parameters start.** A parameter's state starts at its first gradient, zero or
   not (the state's shapes follow from the shape alone). One ``all_reduce(MAX)`` of per-FQN
   flags tells every member which parameters are non-zero anywhere (only those feed a first
   codebook) and which have state (a member holding a shared parameter with state while
   another holds it without raises everywhere).
2. **Periods** follow from the shape (:func:`gefen_core.periods.shape_period`), so no
   gradient is gathered: a ``FLATTENED_ELEMENT_SHARD`` member whose slice starts and ends
   on multiples of the logical parameter's period uses it (its blocks are then one
   process's blocks); otherwise it cuts its own slice (as without a scope).
3. **Codebook.** Each logical parameter is counted once in the 4096-bin histogram: a
   replicated parameter by member 0, a flattened one by every non-empty slice, a
   whole-parameter one by its owner. One ``all_reduce(SUM)`` of int64 counts (exact, order
   free) gives every member the same histogram and so the same exact-DP codebook.

Every collective round carries the sender's failure flag (see :mod:`gefen_core.codebook_scope`);
a failure after the last collective here (the solve) is returned for the commit vote.
Nothing is published here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.torch_support import ProcessGroupBinding

from .codebook import codebook_from_counts, gradient_histogram
from .codebook_scope import (
    HISTOGRAM_PHASE,
    PERIOD_PHASE,
    Failure,
    digest_words,
    reduce_with_failure,
)
from .errors import ShardAgreementError
from .ops import CODEBOOK_SOLVE, HISTOGRAM, Kernels
from .periods import aligned_period

__all__ = ["LearnItem", "LearningOutcome", "PeriodOf", "learn_over_scope", "periods_digest"]

#: The period of a piece of a given number of elements.
PeriodOf = Callable[[int], int]


@dataclass(slots=True, eq=False)
class LearnItem:
    """One local parameter as the learning sees it.

    ``shard`` is ``None`` for a slot of an unfinalized optimizer (learned locally). ``grad``
    is this member's local gradient, already unscaled (``None`` without one, or for a pruned
    non-owner slot). ``period`` is the stored period when the parameter has state.
    ``local_period`` is the period of the local piece (the rule without a scope), by its
    number of elements; ``logical_period`` that of the whole logical parameter.
    """

    fqn: str
    shard: ShardIdentity | None
    grad: torch.Tensor | None
    has_state: bool
    period: int | None
    signed: bool
    local_period: PeriodOf
    logical_period: PeriodOf

    @property
    def layout(self) -> ParameterLayout:
        return ParameterLayout.REPLICATED if self.shard is None else self.shard.layout


@dataclass(slots=True)
class LearningOutcome:
    """What this member learned: parameters that start now (by FQN, the same everywhere),
    their periods on this member, the new codebook (``None`` when none was learned), the
    shared periods every member must agree on, and a failure left for the commit vote."""

    starting: frozenset[str] = frozenset()
    periods: dict[str, int] = field(default_factory=dict)
    codebook: torch.Tensor | None = None
    shared_periods: dict[str, int] = field(default_factory=dict)
    failure: Failure | None = None


def periods_digest(periods: dict[str, int]) -> list[int]:
    """Two int64 over the sorted ``(fqn, period)`` pairs (what the commit vote compares)."""
    text = "\x1f".join(f"{fqn}\x1e{period}" for fqn, period in sorted(periods.items()))
    return digest_words(text.encode(), 2)


def _shared(item: LearnItem) -> bool:
    """Held (possibly empty) by every member of the scope: replicated and flattened parameters."""
    return item.shard is not None and item.layout is not ParameterLayout.WHOLE_PARAMETER_OWNER


def _contributes(item: LearnItem, binding: ProcessGroupBinding | None) -> bool:
    """Whether this member's gradient of ``item`` enters the shared histogram (once per parameter)."""
    if item.shard is None or binding is None:
        return True
    layout = item.layout
    if layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        return item.shard.local_numel > 0
    if layout is ParameterLayout.WHOLE_PARAMETER_OWNER:
        return item.shard.is_owner
    group = item.shard.process_group
    return group is None or item.shard.member_index == 0


def _decide_starts(
    binding: ProcessGroupBinding | None,
    fqns: Sequence[str],
    items: Sequence[LearnItem],
    failure: Failure | None,
    who: str,
) -> tuple[frozenset[str], frozenset[str]]:
    """Globally non-zero FQNs and FQNs that start now (one ``all_reduce(MAX)``)."""
    index = {fqn: i for i, fqn in enumerate(fqns)}
    count = len(fqns)
    flags = torch.zeros(3 * count, dtype=torch.int64)
    if failure is None:
        try:
            for item in items:
                if item.grad is None:
                    continue
                i = index[item.fqn]
                if item.grad.numel() and bool(item.grad.ne(0).any()):
                    flags[i] = 1
                if _shared(item):
                    flags[count + i + (count if item.has_state else 0)] = 1
        except Exception as exc:
            failure = Failure(PERIOD_PHASE, exc)
    reduced = reduce_with_failure(binding, flags, maximum=True, failure=failure, phase=PERIOD_PHASE, who=who)
    both = (reduced[count : 2 * count] * reduced[2 * count :]).nonzero().flatten().tolist()
    if both:
        raise ShardAgreementError(
            f"{who}: members disagree on whether {[fqns[i] for i in both]} already have optimizer state (a "
            "checkpoint was loaded on some members only?); nothing was changed"
        )
    nonzero = frozenset(fqns[i] for i in reduced[:count].nonzero().flatten().tolist())
    starting = frozenset(item.fqn for item in items if item.grad is not None and not item.has_state)
    return nonzero, starting


def learn_over_scope(
    binding: ProcessGroupBinding | None,
    fqns: Sequence[str],
    items: Sequence[LearnItem],
    *,
    decide_starts: bool,
    learn_codebook: bool,
    refresh: bool,
    dispatch: Kernels,
    deterministic: bool,
    failure: Failure | None = None,
    who: str,
) -> LearningOutcome:
    """Learn over ``binding`` (see the module docstring); collective, publishes nothing.

    ``decide_starts``: decide which stateless parameters start and choose their periods.
    ``learn_codebook``: solve a codebook from the parameters that have state or start, with a
    non-zero gradient somewhere. ``refresh``: solve one from every such parameter with a
    gradient (zero or not), with its stored period; no codebook when every one is zero.
    ``items`` lists this member's parameters in FQN order; ``fqns`` is the manifest's FQN list,
    the same on every member. ``failure`` is a local failure that happened before (it is voted
    at the first collective round).
    """
    assert decide_starts or not learn_codebook, "learning a codebook needs the non-zero decision"
    outcome = LearningOutcome()
    nonzero: frozenset[str] = frozenset()
    if decide_starts:
        nonzero, outcome.starting = _decide_starts(binding, fqns, items, failure, who)
    selected = [item for item in items if item.fqn in outcome.starting and item.grad is not None]
    if failure is None:
        try:
            for item in selected:
                assert item.grad is not None
                period = item.local_period(item.grad.numel())
                if item.shard is not None and item.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
                    total = item.shard.parameter.numel
                    logical = item.logical_period(total)
                    offset, length = item.shard.extent.flat_offset, item.shard.local_numel  # type: ignore[union-attr]
                    period = aligned_period(logical, offset, length, period, total)
                    outcome.shared_periods[item.fqn] = logical
                elif _shared(item):
                    outcome.shared_periods[item.fqn] = period
                outcome.periods[item.fqn] = period
        except Exception as exc:
            failure = Failure(PERIOD_PHASE, exc)
    if not (learn_codebook or refresh):
        outcome.failure = failure
        return outcome
    counts = torch.zeros(4096, dtype=torch.int64)
    if failure is None:
        try:
            contributions = []
            for item in items:
                if item.grad is None or not (item.has_state or item.fqn in outcome.starting):
                    continue
                if learn_codebook and not refresh and item.fqn not in nonzero:
                    continue
                if not _contributes(item, binding):
                    continue
                period = outcome.periods[item.fqn] if item.period is None else item.period
                contributions.append((item.grad.neg() if item.signed else item.grad, period))
            counts = gradient_histogram(contributions, dispatch.op(HISTOGRAM), deterministic=deterministic)
        except Exception as exc:
            failure = Failure(HISTOGRAM_PHASE, exc)
    counts = reduce_with_failure(binding, counts, maximum=False, failure=failure, phase=HISTOGRAM_PHASE, who=who)
    try:
        outcome.codebook = codebook_from_counts(counts, dispatch.op(CODEBOOK_SOLVE))
    except Exception as exc:
        outcome.failure = Failure(HISTOGRAM_PHASE, exc)
    return outcome

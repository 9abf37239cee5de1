"""What is specific to ``Gefen`` in post-sharding, the codebook scope and canonical local state.

:class:`GefenBinding` is ``Gefen._binding`` (an object the class owns, not a base class); the generic
parts live in :mod:`gefen_core.identity`, :mod:`gefen_core.scoped_step` and
:mod:`gefen_core.canonical_state`. Gefen adds:

* **layouts**: ``REPLICATED`` (the target has the global shape) and
  ``FLATTENED_ELEMENT_SHARD`` (a contiguous 1-D run of the row-major flattened parameter).
  Every other layout is refused. A flattened 2-D parameter keeps the block second moment
  (factored row and column statistics would need a collective per step); that is the only
  representation change. Without a scope, a flattened shard trains exactly like a Gefen
  built directly on the 1-D shard (its period, policies and codebook are local); with one,
  periods are chosen on the complete logical gradient and the codebook is learned over the
  scope, so a layout whose cuts fall on block boundaries trains exactly like one process
  (``factored_v_2d=False``, or parameters that are not 2-D);
* **pristine**: no parameter state, global step 0, no codebook, no device counters;
* **the scope protocol's host side**: the step plan with its presence bytes and needs bits,
  learning items per FQN (gradients unscaled by the agreed scaler scale), staging of new
  states and re-quantised indices, and publication;
* **canonical local state** (:data:`CANONICAL`): the policy ``{momentum, state_format,
  codebook_refresh_every, stochastic_round, deterministic}``, the native record the rebuilt
  state dict carries, and tensors viewed like their parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from gefen_contracts import ContractError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ShardIdentity

from . import gefen_step
from . import native_format as F
from .amp import unscale_gradients
from .canonical_state import CanonicalRole
from .codebook_scope import NEEDS_GRAD, NEEDS_NONZERO, NEEDS_START, AmpReading
from .contract import CANONICAL_LAYOUTS, STATE_LAYOUT
from .native_format import VERSION as NATIVE_VERSION
from .native_records import codebook_record
from .param_state import BLOCK, COUNTER_KEYS, INDICES, MOMENTUM_MEANING, period_of, state_variant
from .periods import PeriodPolicy, period_policy
from .scoped_learning import LearningOutcome, LearnItem, PeriodOf
from .scoped_step import ScopePlan, scoped_initialize, scoped_refresh
from .state_placement import export_tensors
from .step_plan import ParamWork, StepDecision, StepPlan

if TYPE_CHECKING:
    from .gefen import Gefen

__all__ = ["CANONICAL", "GEFEN_BINDABLE_LAYOUTS", "GefenBinding"]

#: The layouts ``Gefen.post_sharding`` binds.
GEFEN_BINDABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD})


def _period_search(policy: PeriodPolicy, name: str | None, shape: tuple[int, ...]) -> PeriodOf:
    """The period of a piece of ``shape`` of a parameter named ``name``, by its number of
    elements (overrides, then the shape rule)."""

    def period(numel: int) -> int:
        return policy.resolve(name, shape, numel)

    return period


class GefenBinding:
    """Gefen's rules for ``post_sharding`` (the layouts it binds, what pristine means, the
    scope policy) and its host side of the codebook scope protocol (:mod:`gefen_core.scoped_step`).

    Stateless: every method takes the optimizer. One instance is the optimizer class's
    ``_binding``, which :mod:`gefen_core.identity` and the scope drivers call.
    """

    who = "Gefen"

    # -- identity rules --------------------------------------------------------------------------

    def check_layout(self, shard: ShardIdentity, target: torch.Tensor | None) -> None:
        if shard.layout not in GEFEN_BINDABLE_LAYOUTS:
            allowed = ", ".join(sorted(layout.value for layout in GEFEN_BINDABLE_LAYOUTS))
            raise ContractError(f"post_sharding: Gefen binds {allowed} shards; {shard.fqn!r} is {shard.layout.value}")

    def pristine_blockers(self, optimizer: Gefen) -> tuple[str, ...]:
        reasons = []
        stepped = sum(1 for entry in optimizer.state.values() if entry)
        if stepped:
            reasons.append(
                f"{stepped} parameter(s) already have Gefen state: post_sharding binds a pristine optimizer, before "
                "its first step"
            )
        if optimizer._global_step:
            reasons.append(f"the optimizer already took {optimizer._global_step} step(s)")
        if optimizer._codebook is not None:
            reasons.append("a codebook was already learned")
        if optimizer._device_global_steps:
            reasons.append("device step counters already exist (a capturable step ran)")
        return tuple(reasons)

    def scope_policy(self, optimizer: Gefen) -> dict[str, object]:
        return {
            "deterministic": optimizer._deterministic,
            "codebook_refresh_every": optimizer._refresh_every,
            "stochastic_round": optimizer._stochastic_round,
        }

    def refresh_due(self, optimizer: Gefen) -> bool:
        return gefen_step.refresh_due(optimizer)

    def initialize(self, optimizer: Gefen) -> bool:
        return scoped_initialize(optimizer)

    def refresh(self, optimizer: Gefen) -> bool:
        return scoped_refresh(optimizer)

    # -- the scope protocol's host side -----------------------------------------------------------

    def plan(self, optimizer: Gefen) -> ScopePlan:
        plan = gefen_step.plan(optimizer)
        identity = optimizer._identity
        presence = b"" if identity is None else bytes(int(t.grad is not None) for t in identity.shared)
        needs = NEEDS_GRAD if plan.works else 0
        if plan.starting:
            needs |= NEEDS_START
        if optimizer._codebook is None and any(gefen_step.locally_nonzero(w) for w in plan.works):
            needs |= NEEDS_NONZERO
        grads = [w.param.grad for w in plan.works if w.param.grad is not None]
        return ScopePlan(plan, presence, needs, grads)

    def key(self, optimizer: Gefen, work: ParamWork) -> str:
        identity = optimizer._identity
        return f"slot {work.slot}" if identity is None else identity.sealed.shard_identity(work.param).fqn

    def items(self, optimizer: Gefen, plan: ScopePlan, inverse: float | None) -> list[LearnItem]:
        inner: StepPlan = plan.inner
        works = {id(work.param): work for work in inner.works}
        identity = optimizer._identity
        items: list[LearnItem] = []
        slot = 0
        for group in optimizer.param_groups:
            policy = period_policy(group)
            for param in group["params"]:
                work = works.get(id(param))
                shard = None if identity is None else identity.sealed.shard_identity(param)
                entry = optimizer.state.get(param)
                name = None if work is None else work.name
                local_shape = tuple(param.shape)
                logical_shape = local_shape if shard is None else shard.parameter.global_shape
                grad = None
                if work is not None:
                    grad = work.grad if inverse is None else work.grad.mul(inverse)
                items.append(
                    LearnItem(
                        fqn=f"slot {slot}" if shard is None else shard.fqn,
                        shard=shard,
                        grad=grad,
                        has_state=bool(entry),
                        period=period_of(entry) if entry else None,
                        signed=bool(group["maximize"]),
                        local_period=_period_search(policy, name, local_shape),
                        logical_period=_period_search(policy, name, logical_shape),
                    )
                )
                slot += 1
        items.sort(key=lambda item: item.fqn if identity is not None else 0)
        return items

    def stage(self, optimizer: Gefen, plan: ScopePlan, outcome: LearningOutcome) -> StepDecision:
        inner: StepPlan = plan.inner
        starting = [w for w in inner.starting if self.key(optimizer, w) in outcome.starting]
        idle = [w for w in inner.starting if self.key(optimizer, w) not in outcome.starting]
        periods = {w.slot: outcome.periods[self.key(optimizer, w)] for w in starting}
        codebook = outcome.codebook if outcome.codebook is not None else optimizer._codebook
        return gefen_step.stage_decision(optimizer, starting, idle, periods, codebook, [])

    def requantize(self, optimizer: Gefen, codebook: torch.Tensor) -> list[tuple[dict[str, Any], torch.Tensor]]:
        assert optimizer._codebook is not None
        return gefen_step.requantize_all(optimizer, optimizer._codebook, codebook)

    def publish(self, optimizer: Gefen, plan: ScopePlan, staged: Any, requantized: Any, amp: AmpReading) -> None:
        inner: StepPlan = plan.inner
        unscale_gradients(optimizer, plan.grads)
        for work in inner.moving:
            gefen_step.move_state(work)
        stats = gefen_step.factored_stats(optimizer, inner)
        decision = staged if isinstance(staged, StepDecision) else None
        if decision is None:
            decision = StepDecision(idle=list(inner.starting), codebook=optimizer._codebook)
        if requantized:
            decision.refreshed = requantized
        gefen_step.publish(optimizer, inner, decision, stats)

    def publish_codebook(self, optimizer: Gefen, codebook: torch.Tensor, requantized: Any) -> None:
        for state, indices in requantized or ():
            state[INDICES].copy_(indices)
        optimizer._codebook = codebook
        optimizer._codebook_copies = {}
        optimizer._version += 1


# -- canonical local state (the role: :class:`gefen_core.canonical_state.CanonicalRole`) ----------


def _canonical_tensors(param: torch.Tensor, entry: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return export_tensors(param, entry, state_variant(dict(entry)) or BLOCK)


def _canonical_policy(optimizer: Any) -> dict[str, Any]:
    return {
        "momentum": MOMENTUM_MEANING,
        "state_format": NATIVE_VERSION,
        "codebook_refresh_every": optimizer._refresh_every,
        "stochastic_round": optimizer._stochastic_round,
        "deterministic": optimizer._deterministic,
    }


def _canonical_record(optimizer: Any, common: Mapping[str, Any]) -> dict[str, Any]:
    fields = codebook_record(common["codebook"])
    return {
        F.FORMAT_VERSION: F.VERSION,
        F.GLOBAL_STEP: common["global_step"],
        **{F.CODEBOOK: fields["codebook"], F.CODEBOOK_LEARNED: fields["codebook_learned"]},
        F.DETERMINISTIC: optimizer._deterministic,
    }


def _canonical_blockers(optimizer: Any) -> tuple[str, ...]:
    if optimizer._capturable:
        return ("capturable=True keeps counters on the device; canonical documents hold int counters",)
    return ()


#: Gefen's canonical local state role (``Gefen.export_local_state`` and its import delegate to it).
CANONICAL = CanonicalRole(
    STATE_LAYOUT,
    CANONICAL_LAYOUTS,
    COUNTER_KEYS,
    F.FORMAT,
    policy=_canonical_policy,
    record=_canonical_record,
    blockers=_canonical_blockers,
    tensors=_canonical_tensors,
)

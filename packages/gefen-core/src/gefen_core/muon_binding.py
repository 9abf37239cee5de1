"""What is specific to ``GefenMuon`` in post-sharding, the codebook scope and canonical local state.

:class:`MuonBinding` is ``GefenMuon._binding`` (an object the class owns, not a base class); the generic
parts live in :mod:`gefen_core.identity`, :mod:`gefen_core.scoped_step` and
:mod:`gefen_core.canonical_state`. GefenMuon adds:

* **layouts**: complete 2-D matrices only: ``REPLICATED`` (the target is the whole matrix)
  and ``WHOLE_PARAMETER_OWNER`` (the owner's target is the whole matrix; a non-owner passes
  ``new_parameter=None`` and its slot is pruned). Flattened and DTensor targets are refused:
  Newton-Schulz needs the complete logical matrix.
* **whole-parameter owners**: the owner holds the matrix, its state and computes its update;
  non-owners keep nothing. The adapter broadcasts the owner's matrix after ``step()``
  (the contract says ``requires_post_step_parameter_sync``). Stepping requires a codebook
  scope (several members), because every owner must quantise with one codebook learned from
  every owner's gradients; without one ``step()`` raises before running its closure.
* **the scope protocol's host side** and the canonical policy ``{stochastic_round,
  deterministic}`` (canonical documents cover replicated matrices only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from gefen_contracts import ContractError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ShardIdentity

from . import muon_execution
from .amp import unscale_gradients
from .canonical_state import CanonicalRole
from .codebook import requantize
from .codebook_scope import NEEDS_GRAD, NEEDS_NONZERO, NEEDS_START, AmpReading
from .muon_contract import REPLICATED_STATE_LAYOUT
from .muon_learning import LearningResult, is_nonzero
from .muon_native_state import FORMAT
from .muon_native_state import FORMAT as MUON_FORMAT
from .muon_plan import MuonItem, MuonPlan
from .muon_state import NORMUON_STEP
from .native_records import DIGEST_FIELD, codebook_record
from .param_state import INDICES, STEP, period_of
from .periods import shape_period
from .scoped_learning import LearningOutcome, LearnItem, PeriodOf
from .scoped_step import ScopePlan, scoped_initialize, scoped_refresh

if TYPE_CHECKING:
    from .muon import GefenMuon

__all__ = ["CANONICAL", "MUON_BINDABLE_LAYOUTS", "MuonBinding"]

#: The layouts ``GefenMuon.post_sharding`` binds.
MUON_BINDABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER})


def _matrix_period(shape: tuple[int, int]) -> PeriodOf:
    def period(numel: int) -> int:
        return shape_period(shape, numel)

    return period


def _learn_item(fqn: str, shard: ShardIdentity | None, item: MuonItem | None, inverse: float | None) -> LearnItem:
    grad = None
    if item is not None and item.grad is not None:
        grad = item.local_grad if inverse is None else item.local_grad.mul(inverse)
    state = None if item is None else item.state
    shape = (0, 0) if item is None else item.shape
    period = _matrix_period(shape)
    return LearnItem(
        fqn=fqn,
        shard=shard,
        grad=grad,
        has_state=bool(state),
        period=period_of(state) if state else None,
        signed=False,
        local_period=period,
        logical_period=period,
    )


class MuonBinding:
    """GefenMuon's rules for ``post_sharding`` (the layouts it binds, what pristine means, the
    scope policy) and its host side of the codebook scope protocol (:mod:`gefen_core.scoped_step`).

    Stateless: every method takes the optimizer. One instance is the optimizer class's
    ``_binding``, which :mod:`gefen_core.identity` and the scope drivers call.
    """

    who = "GefenMuon"

    # -- identity rules --------------------------------------------------------------------------

    def check_layout(self, shard: ShardIdentity, target: torch.Tensor | None) -> None:
        if shard.layout not in MUON_BINDABLE_LAYOUTS:
            raise ContractError(
                f"post_sharding: GefenMuon binds complete matrices (replicated or whole_parameter_owner shards); "
                f"{shard.fqn!r} is {shard.layout.value}"
            )
        if len(shard.parameter.global_shape) != 2:
            raise ContractError(
                f"post_sharding: GefenMuon optimizes 2-D matrices; {shard.fqn!r} has shape {shard.parameter.global_shape}"
            )

    def pristine_blockers(self, optimizer: GefenMuon) -> tuple[str, ...]:
        reasons = []
        stepped = sum(1 for entry in optimizer.state.values() if entry)
        if stepped:
            reasons.append(
                f"{stepped} matrix(es) already have GefenMuon state: post_sharding binds a pristine optimizer, before "
                "its first step"
            )
        if optimizer._global_step:
            reasons.append(f"the optimizer already took {optimizer._global_step} step(s)")
        if optimizer._codebook is not None:
            reasons.append("a codebook was already learned")
        return tuple(reasons)

    def scope_policy(self, optimizer: GefenMuon) -> dict[str, object]:
        return {"deterministic": optimizer._deterministic, "stochastic_round": optimizer._stochastic_round}

    def initialize(self, optimizer: GefenMuon) -> bool:
        return scoped_initialize(optimizer)

    def refresh(self, optimizer: GefenMuon) -> bool:
        return scoped_refresh(optimizer)

    def refresh_due(self, optimizer: GefenMuon) -> bool:
        return False  # GefenMuon relearns its codebook only on request (refresh_collective_state)

    def whole_owner_blocker(self, optimizer: GefenMuon) -> str | None:
        """Why a finalized whole-parameter layout cannot step here (``None`` when it can)."""
        identity = optimizer._identity
        if identity is None or ParameterLayout.WHOLE_PARAMETER_OWNER not in identity.layouts:
            return None
        shards = [shard for _, shard in identity.sealed.bindings]
        if all(shard.process_group is None or len(shard.process_group.ordered_members) == 1 for shard in shards):
            return None
        if identity.scope is None:
            return (
                "whole_parameter_owner matrices are quantised with one codebook learned from every owner's gradients: "
                "finalize with a codebook scope (post_sharding(..., scope=CodebookProcessGroupBinding(...)))"
            )
        return None

    # -- the scope protocol's host side -----------------------------------------------------------

    def plan(self, optimizer: GefenMuon) -> ScopePlan:
        plan = muon_execution.plan(optimizer)
        identity = optimizer._identity
        presence = b"" if identity is None else bytes(int(t.grad is not None) for t in identity.shared)
        active = plan.active
        needs = NEEDS_GRAD if active else 0
        if any(item.state is None for item in active):
            needs |= NEEDS_START
        if optimizer._codebook is None and any(is_nonzero(item.local_grad) for item in active):
            needs |= NEEDS_NONZERO
        return ScopePlan(plan, presence, needs, [item.local_grad for item in active])

    def items(self, optimizer: GefenMuon, plan: ScopePlan, inverse: float | None) -> list[LearnItem]:
        inner: MuonPlan = plan.inner
        identity = optimizer._identity
        by_param = {id(item.param): item for item in inner.items}
        items: list[LearnItem] = []
        if identity is None:
            for item in inner.items:
                items.append(_learn_item(f"slot {item.slot}", None, item, inverse))
            return items
        for tensor, shard in identity.sealed.bindings:
            bound = None if tensor is None else by_param.get(id(tensor))
            items.append(_learn_item(shard.fqn, shard, bound, inverse))
        return items

    def key(self, optimizer: GefenMuon, item: MuonItem) -> str:
        identity = optimizer._identity
        return f"slot {item.slot}" if identity is None else identity.sealed.shard_identity(item.param).fqn

    def stage(self, optimizer: GefenMuon, plan: ScopePlan, outcome: LearningOutcome) -> LearningResult:
        inner: MuonPlan = plan.inner
        periods = {
            item.slot: outcome.periods[self.key(optimizer, item)]
            for item in inner.active
            if item.state is None and self.key(optimizer, item) in outcome.starting
        }
        return LearningResult(outcome.codebook, periods)

    def requantize(self, optimizer: GefenMuon, codebook: torch.Tensor) -> list[tuple[dict[str, Any], torch.Tensor]]:
        old = optimizer._codebook
        assert old is not None
        staged = []
        for state in optimizer.state.values():
            if state and state[INDICES].numel():
                device = state[INDICES].device
                staged.append((state, requantize(state[INDICES], old.to(device), codebook.to(device))))
        return staged

    def publish(self, optimizer: GefenMuon, plan: ScopePlan, staged: Any, requantized: Any, amp: AmpReading) -> None:
        inner: MuonPlan = plan.inner
        unscale_gradients(optimizer, plan.grads)
        learned = staged if isinstance(staged, LearningResult) else LearningResult(None)
        muon_execution.execute(optimizer, inner, learned)

    def publish_codebook(self, optimizer: GefenMuon, codebook: torch.Tensor, requantized: Any) -> None:
        for state, indices in requantized or ():
            state[INDICES].copy_(indices)
        optimizer._codebook = codebook
        optimizer._codebook_copies = {}
        optimizer._version += 1


# -- canonical local state (the role: :class:`gefen_core.canonical_state.CanonicalRole`) ----------


def _canonical_policy(optimizer: Any) -> dict[str, Any]:
    return {
        "state_format": MUON_FORMAT.version,
        "stochastic_round": optimizer._stochastic_round,
        "deterministic": optimizer._deterministic,
    }


def _canonical_record(optimizer: Any, common: Mapping[str, Any]) -> dict[str, Any]:
    values = {"global_step": common["global_step"], **codebook_record(common["codebook"])}
    values.update(deterministic=optimizer._deterministic, topology=None, owners=None)
    return {
        "gefen_format_version": FORMAT.version,
        **{key: values[name] for name, key in FORMAT.records if key != DIGEST_FIELD[1]},
    }


#: GefenMuon's canonical local state role (replicated matrices only; ``GefenMuon.export_local_state``
#: and its import delegate to it).
CANONICAL = CanonicalRole(
    REPLICATED_STATE_LAYOUT,
    frozenset({ParameterLayout.REPLICATED}),
    (STEP, NORMUON_STEP),
    FORMAT,
    policy=_canonical_policy,
    record=_canonical_record,
    blockers=lambda optimizer: (),
)

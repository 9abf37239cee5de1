"""What is specific to ``GefenMuon`` in post-sharding, the codebook scope and canonical local state.

:class:`MuonBindingMethods` is a base class of :class:`~gefen_core.muon.GefenMuon`; the generic
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
from typing import TYPE_CHECKING, Any, cast

import torch
from gefen_contracts import ContractError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ShardIdentity

from . import muon_execution
from .amp import unscale_gradients
from .canonical_state import CanonicalRole
from .codebook import requantize
from .codebook_scope import NEEDS_GRAD, NEEDS_NONZERO, NEEDS_START, AmpReading
from .identity import IdentityMethods
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
    from .ops import Kernels

__all__ = ["CANONICAL", "MUON_BINDABLE_LAYOUTS", "MuonBindingMethods"]

#: The layouts ``GefenMuon.post_sharding`` binds.
MUON_BINDABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER})


def _matrix_period(shape: tuple[int, int]) -> PeriodOf:
    def period(numel: int) -> int:
        return shape_period(shape, numel)

    return period


def _muon(host: MuonBindingMethods) -> GefenMuon:
    return cast("GefenMuon", host)  # this class is a base of GefenMuon only


class MuonBindingMethods(IdentityMethods):
    """GefenMuon's side of ``IdentityBindable`` and ``CollectiveScoped``."""

    _scope_who = "GefenMuon"
    _codebook: torch.Tensor | None
    _codebook_copies: dict[torch.device, torch.Tensor]
    _global_step: int
    _stochastic_round: bool
    _deterministic: bool
    _dispatch: Kernels

    if TYPE_CHECKING:  # provided by GefenMuon

        def _plan(self) -> MuonPlan: ...

    # -- identity rules --------------------------------------------------------------------------

    def _check_bind_layout(self, shard: ShardIdentity, target: torch.Tensor | None) -> None:
        if shard.layout not in MUON_BINDABLE_LAYOUTS:
            raise ContractError(
                f"post_sharding: GefenMuon binds complete matrices (replicated or whole_parameter_owner shards); "
                f"{shard.fqn!r} is {shard.layout.value}"
            )
        if len(shard.parameter.global_shape) != 2:
            raise ContractError(
                f"post_sharding: GefenMuon optimizes 2-D matrices; {shard.fqn!r} has shape {shard.parameter.global_shape}"
            )

    def _pristine_blockers(self) -> tuple[str, ...]:
        reasons = []
        stepped = sum(1 for entry in self.state.values() if entry)
        if stepped:
            reasons.append(
                f"{stepped} matrix(es) already have GefenMuon state: post_sharding binds a pristine optimizer, before "
                "its first step"
            )
        if self._global_step:
            reasons.append(f"the optimizer already took {self._global_step} step(s)")
        if self._codebook is not None:
            reasons.append("a codebook was already learned")
        return tuple(reasons)

    def _scope_policy(self) -> dict[str, object]:
        return {"deterministic": self._deterministic, "stochastic_round": self._stochastic_round}

    def _run_initialize(self) -> bool:
        return scoped_initialize(self)

    def _run_refresh(self) -> bool:
        return scoped_refresh(self)

    def _refresh_due(self) -> bool:
        return False  # GefenMuon relearns its codebook only on request (refresh_collective_state)

    def _whole_owner_blocker(self) -> str | None:
        """Why a finalized whole-parameter layout cannot step here (``None`` when it can)."""
        identity = self._identity
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

    def _scope_plan(self) -> ScopePlan:
        plan = self._plan()
        identity = self._identity
        presence = b"" if identity is None else bytes(int(t.grad is not None) for t in identity.shared)
        active = plan.active
        needs = NEEDS_GRAD if active else 0
        if any(item.state is None for item in active):
            needs |= NEEDS_START
        if self._codebook is None and any(is_nonzero(item.local_grad) for item in active):
            needs |= NEEDS_NONZERO
        return ScopePlan(plan, presence, needs, [item.local_grad for item in active])

    def _scope_items(self, plan: ScopePlan, inverse: float | None) -> list[LearnItem]:
        inner: MuonPlan = plan.inner
        identity = self._identity
        by_param = {id(item.param): item for item in inner.items}
        items: list[LearnItem] = []
        if identity is None:
            for item in inner.items:
                items.append(self._learn_item(f"slot {item.slot}", None, item, inverse))
            return items
        for tensor, shard in identity.sealed.bindings:
            bound = None if tensor is None else by_param.get(id(tensor))
            items.append(self._learn_item(shard.fqn, shard, bound, inverse))
        return items

    def _learn_item(
        self, fqn: str, shard: ShardIdentity | None, item: MuonItem | None, inverse: float | None
    ) -> LearnItem:
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

    def _scope_key(self, item: MuonItem) -> str:
        identity = self._identity
        return f"slot {item.slot}" if identity is None else identity.sealed.shard_identity(item.param).fqn

    def _scope_stage(self, plan: ScopePlan, outcome: LearningOutcome) -> LearningResult:
        inner: MuonPlan = plan.inner
        periods = {
            item.slot: outcome.periods[self._scope_key(item)]
            for item in inner.active
            if item.state is None and self._scope_key(item) in outcome.starting
        }
        return LearningResult(outcome.codebook, periods)

    def _scope_requantize(self, codebook: torch.Tensor) -> list[tuple[dict[str, Any], torch.Tensor]]:
        old = self._codebook
        assert old is not None
        staged = []
        for state in self.state.values():
            if state and state[INDICES].numel():
                device = state[INDICES].device
                staged.append((state, requantize(state[INDICES], old.to(device), codebook.to(device))))
        return staged

    def _scope_publish(self, plan: ScopePlan, staged: Any, requantized: Any, amp: AmpReading) -> None:
        inner: MuonPlan = plan.inner
        unscale_gradients(self, plan.grads)
        learned = staged if isinstance(staged, LearningResult) else LearningResult(None)
        muon_execution.execute(_muon(self), inner, learned)

    def _scope_publish_codebook(self, codebook: torch.Tensor, requantized: Any) -> None:
        for state, indices in requantized or ():
            state[INDICES].copy_(indices)
        self._codebook = codebook
        self._codebook_copies = {}
        self._version += 1


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

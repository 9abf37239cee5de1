"""``IdentityBinding``: the ``IdentityBindable`` role as one object a torch optimizer owns.

An optimizer that binds its slots to shards after sharding (FSDP, ZeRO, owner layouts) owns
one and delegates ``prepare_post_sharding`` / ``commit_post_sharding`` / ``post_sharding``,
the identity queries, the seal checks and the native checkpoint's identity guard to it. What
stays the optimizer's own is what only it knows: which layouts it binds (``check_layout``),
why it is not pristine (the ``blockers`` it passes to :meth:`prepare`), and its freshness
token (what a commit compares with the prepare's). A torch optimizer adopts it in a few
lines::

    class MySGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})
            self._binding = IdentityBinding("MySGD", refuse_unless_replicated_or_flattened)

        def _token(self):
            return state_version_token(self.param_groups, self.state)

        def prepare_post_sharding(self, rebindings, *, manifest, scope=None):
            blockers = ("MySGD has state: bind before the first step",) if any(self.state.values()) else ()
            return self._binding.prepare(self, rebindings, manifest=manifest, scope=scope,
                                         blockers=blockers, token=self._token())

        def commit_post_sharding(self, staged):
            self._binding.commit(self, staged, token=self._token())

        # post_sharding, sharding_manifest, shard_bindings, shard_identity delegate alike;
        # step() and state_dict() call self._binding.verify(self, where) first, state_dict()
        # adds self._binding.guard(), and a load passes the dict through self._binding.unguard();
        # __getstate__ adds self._binding.record() (torch keeps only defaults, state and groups)
        # and __setstate__ builds a new IdentityBinding and restore()s it on the copy.

The request is validated by :func:`~gefen_contracts.torch_support.plan_rebinding`; a commit
publishes by swaps that cannot raise (:func:`~gefen_contracts.torch_support.publish_binding`)
and seals the layout in a :class:`~gefen_contracts.torch_support.SealedLayout`. An optimizer
that learns state across processes takes a ``scope`` too: it passes ``check_scope``, which
sees the validated plan (Gefen and GefenMuon check their codebook scope there); without it a
scope is refused. What an optimizer derives from its seal (Gefen's scope fingerprint) is
computed by ``derive`` while staging, so a commit never fails half-way, and kept beside the
seal as :attr:`IdentityBinding.derived`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..capabilities import FEATURE_COLLECTIVE_SCOPE, FEATURE_POST_SHARDING
from ..errors import NotSupportedError
from ..identity import ShardIdentity
from ..manifest import ShardingManifest
from ..rebinding import LogicalSlotBinding, ParameterRebinding
from ..transactions import StagedTransaction, require_transaction
from .bindings import ProcessGroupBinding
from .native_identity import IDENTITY_KEY, identity_guard, split_identity_guard
from .rebinding_plan import (
    LayoutCheck,
    RebindingPlan,
    compatibility_names,
    plan_rebinding,
    publish_binding,
    rebuilt_plan,
    staged_groups,
)
from .sealed_layout import SealedLayout

__all__ = ["Derive", "IdentityBinding", "ScopeCheck"]

#: ``(optimizer, plan) -> None``: raises for a plan whose scope the optimizer cannot take.
ScopeCheck = Callable[[Any, RebindingPlan], None]
#: ``(optimizer, sealed) -> what the optimizer keeps beside its seal``.
Derive = Callable[[Any, SealedLayout], object]


@dataclass(frozen=True, slots=True, eq=False)
class _StagedSeal:
    groups: tuple[dict[str, Any], ...]
    sealed: SealedLayout
    derived: object


class IdentityBinding:
    """Post-sharding binding and the sealed layout of one torch optimizer (``owner`` names it in
    errors; ``check_layout`` raises ``ContractError`` for a shard it does not bind;
    ``check_scope``, when given, admits a ``scope``; ``derive`` computes :attr:`derived`)."""

    __slots__ = ("_check_layout", "_check_scope", "_derive", "_kind", "derived", "owner", "sealed")

    def __init__(
        self,
        owner: str,
        check_layout: LayoutCheck,
        check_scope: ScopeCheck | None = None,
        derive: Derive | None = None,
    ) -> None:
        self.owner = owner
        self._check_layout = check_layout
        self._check_scope = check_scope
        self._derive = derive
        self._kind = f"{owner}.post_sharding"
        #: the finalized layout (``None`` until a commit)
        self.sealed: SealedLayout | None = None
        #: what ``derive`` computed from the seal (``None`` until a commit, or without ``derive``)
        self.derived: object = None

    # -- IdentityBindable ---------------------------------------------------------------

    def prepare(
        self,
        optimizer: Any,
        rebindings: Sequence[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        scope: object | None,
        blockers: Sequence[str],
        token: Hashable,
    ) -> StagedTransaction:
        """Validate a request and stage the new groups and sealed layout; nothing is mutated.

        ``RuntimeError`` when already finalized; ``NotSupportedError`` when ``blockers`` (the
        optimizer's reasons it is not pristine) are given, or for a ``scope`` without
        ``check_scope``; then ``plan_rebinding``'s errors and ``check_scope``'s.
        """
        if self.sealed is not None:
            raise RuntimeError(f"post_sharding: this {self.owner} is already finalized (its layout is sealed)")
        if blockers:
            raise NotSupportedError(FEATURE_POST_SHARDING, tuple(blockers))
        if scope is not None and self._check_scope is None:
            raise NotSupportedError(
                FEATURE_COLLECTIVE_SCOPE, (f"{self.owner} learns nothing collectively; it takes no scope",)
            )
        groups = optimizer.param_groups
        plan = plan_rebinding(
            groups,
            rebindings,
            manifest=manifest,
            scope=scope,
            name_of=compatibility_names(groups),
            check_layout=self._check_layout,
        )
        if self._check_scope is not None:
            self._check_scope(optimizer, plan)
        sealed = SealedLayout(plan, len(groups))
        derived = None if self._derive is None else self._derive(optimizer, sealed)
        payload = _StagedSeal(staged_groups(groups, plan), sealed, derived)
        return StagedTransaction(optimizer, kind=self._kind, token=token, payload=payload)

    def commit(self, optimizer: Any, staged: StagedTransaction, *, token: Hashable) -> None:
        """Publish a staged binding by swaps that cannot raise, and seal the layout.

        ``StaleTransactionError`` (nothing changed) for a foreign, consumed or stale
        transaction (``token`` differs from the prepare's).
        """
        payload = require_transaction(staged).claim(optimizer, kind=self._kind, current_token=token)
        assert isinstance(payload, _StagedSeal)
        publish_binding(optimizer, payload.groups)
        self.sealed, self.derived = payload.sealed, payload.derived

    def manifest(self, optimizer: Any) -> ShardingManifest | None:
        """The finalized manifest (``None`` before ``post_sharding``); verifies the layout first."""
        self.verify(optimizer, "sharding_manifest")
        return None if self.sealed is None else self.sealed.manifest

    def bindings(self, optimizer: Any) -> tuple[tuple[Any | None, ShardIdentity], ...]:
        """``(tensor or None, shard)`` per local slot, sorted by ``sort_key`` (``()`` before binding)."""
        self.verify(optimizer, "shard_bindings")
        return () if self.sealed is None else self.sealed.bindings

    def shard_identity(self, optimizer: Any, parameter: Any) -> ShardIdentity:
        """The shard bound to ``parameter`` (``KeyError`` for an unbound tensor or before binding)."""
        self.verify(optimizer, "shard_identity")
        if self.sealed is None:
            raise KeyError("no shard identity is bound: call post_sharding first")
        return self.sealed.shard_identity(parameter)

    # -- the seal ---------------------------------------------------------------------

    def verify(self, optimizer: Any, where: str) -> None:
        """``LayoutTamperedError`` if the public containers left the sealed layout (no-op before binding)."""
        if self.sealed is not None:
            self.sealed.verify(optimizer.param_groups, optimizer.state, where=where)

    def refuse_new_group(self) -> None:
        """``RuntimeError`` once sealed: ``add_param_group`` would add slots no shard describes."""
        if self.sealed is not None:
            raise RuntimeError(
                "add_param_group: the parameter layout was sealed by post_sharding; build the optimizer with every "
                "parameter group before calling post_sharding"
            )

    def guard(self, exported: dict[str, Any]) -> dict[str, Any]:
        """``exported`` (a native state dict) with the identity guard once sealed (``IDENTITY_KEY``)."""
        if self.sealed is not None:
            exported[IDENTITY_KEY] = identity_guard(self.sealed)
        return exported

    def unguard(self, state_dict: Mapping[str, Any]) -> object:
        """Check a native state dict's guard against the seal and return it without the guard
        (``StateValidationError`` for another member's or layout's checkpoint)."""
        return split_identity_guard(state_dict, self.sealed)

    # -- copies ---------------------------------------------------------------------------

    def record(self) -> object:
        """The tensor-free record a pickled or deep-copied optimizer carries of its seal."""
        return None if self.sealed is None else (self.sealed.manifest, self.sealed.slots, self.sealed.scope)

    def restore(self, optimizer: Any, record: object) -> None:
        """Rebuild the seal of a copy (``optimizer``) from :meth:`record`, around its own tensors."""
        if record is None:
            self.sealed = self.derived = None
            return
        fields = cast(tuple[Any, ...], record)
        if len(fields) == 2:  # ContractedAdamW's record before it carried the scope (it has none)
            fields = (*fields, None)
        manifest, slots, scope = cast(
            tuple[ShardingManifest, Sequence[LogicalSlotBinding], "ProcessGroupBinding | None"], fields
        )
        groups = optimizer.param_groups
        self.sealed = SealedLayout(rebuilt_plan(groups, manifest, slots, scope), len(groups))
        self.derived = None if self._derive is None else self._derive(optimizer, self.sealed)

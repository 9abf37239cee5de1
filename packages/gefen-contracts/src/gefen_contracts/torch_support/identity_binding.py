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
        # adds self._binding.guard(), and a load passes the dict through self._binding.unguard().

The request is validated by :func:`~gefen_contracts.torch_support.plan_rebinding`; a commit
publishes by swaps that cannot raise (:func:`~gefen_contracts.torch_support.publish_binding`)
and seals the layout in a :class:`~gefen_contracts.torch_support.SealedLayout`. An optimizer
that learns state across processes (a codebook scope) needs more than this role: Gefen's and
GefenMuon's binding adds the scope's checks and fingerprint (``gefen_core.identity``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..capabilities import FEATURE_COLLECTIVE_SCOPE, FEATURE_POST_SHARDING
from ..errors import NotSupportedError
from ..identity import ShardIdentity
from ..manifest import ShardingManifest
from ..rebinding import LogicalSlotBinding, ParameterRebinding
from ..transactions import StagedTransaction, require_transaction
from .native_identity import IDENTITY_KEY, identity_guard, split_identity_guard
from .rebinding_plan import (
    LayoutCheck,
    compatibility_names,
    plan_rebinding,
    publish_binding,
    rebuilt_plan,
    staged_groups,
)
from .sealed_layout import SealedLayout

__all__ = ["IdentityBinding"]


@dataclass(frozen=True, slots=True, eq=False)
class _StagedSeal:
    groups: tuple[dict[str, Any], ...]
    sealed: SealedLayout


class IdentityBinding:
    """Post-sharding binding and the sealed layout of one torch optimizer (``owner`` names it in
    errors; ``check_layout`` raises ``ContractError`` for a shard it does not bind)."""

    __slots__ = ("_check_layout", "_kind", "owner", "sealed")

    def __init__(self, owner: str, check_layout: LayoutCheck) -> None:
        self.owner = owner
        self._check_layout = check_layout
        self._kind = f"{owner}.post_sharding"
        #: the finalized layout (``None`` until a commit)
        self.sealed: SealedLayout | None = None

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
        optimizer's reasons it is not pristine) are given, or for a ``scope`` (this role keeps
        no state shared across processes); then ``plan_rebinding``'s errors.
        """
        if self.sealed is not None:
            raise RuntimeError(f"post_sharding: this {self.owner} is already finalized (its layout is sealed)")
        if blockers:
            raise NotSupportedError(FEATURE_POST_SHARDING, tuple(blockers))
        if scope is not None:
            raise NotSupportedError(
                FEATURE_COLLECTIVE_SCOPE, (f"{self.owner} learns nothing collectively; it takes no scope",)
            )
        groups = optimizer.param_groups
        plan = plan_rebinding(
            groups,
            rebindings,
            manifest=manifest,
            scope=None,
            name_of=compatibility_names(groups),
            check_layout=self._check_layout,
        )
        payload = _StagedSeal(staged_groups(groups, plan), SealedLayout(plan, len(groups)))
        return StagedTransaction(optimizer, kind=self._kind, token=token, payload=payload)

    def commit(self, optimizer: Any, staged: StagedTransaction, *, token: Hashable) -> None:
        """Publish a staged binding by swaps that cannot raise, and seal the layout.

        ``StaleTransactionError`` (nothing changed) for a foreign, consumed or stale
        transaction (``token`` differs from the prepare's).
        """
        payload = require_transaction(staged).claim(optimizer, kind=self._kind, current_token=token)
        assert isinstance(payload, _StagedSeal)
        publish_binding(optimizer, payload.groups)
        self.sealed = payload.sealed

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
        return None if self.sealed is None else (self.sealed.manifest, self.sealed.slots)

    def restore(self, param_groups: Sequence[Mapping[str, Any]], record: object) -> None:
        """Rebuild the seal of a copy from :meth:`record`, around the copy's own tensors."""
        if record is None:
            self.sealed = None
            return
        manifest, slots = cast(tuple[ShardingManifest, Sequence[LogicalSlotBinding]], record)
        self.sealed = SealedLayout(rebuilt_plan(param_groups, manifest, slots, None), len(param_groups))

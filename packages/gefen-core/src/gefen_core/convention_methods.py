"""The convention's Protocol methods of ``Gefen`` and ``GefenMuon``, written once.

Each method is one line that calls a role the optimizer class declares (``_native``, a
:class:`~gefen_core.optimizer_support.NativeCheckpoint`; ``_portable``, a
:class:`~gefen_core.portable_adapter.PortableRole`; ``_canonical``, a
:class:`~gefen_core.canonical_state.CanonicalRole`) or a function of :mod:`gefen_core.identity`.
No logic lives here: the roles hold it, each in its own module; this class only puts the
methods the contracts' Protocols require on the optimizer, once for both classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import ProcessGroupBinding
from gefen_contracts.transactions import StagedTransaction

from . import identity
from .canonical_state import CanonicalRole
from .codebook_scope import STEADY_STEP_BUDGET
from .optimizer_support import NativeCheckpoint
from .portable_adapter import PortableRole

__all__ = ["ConventionMethods"]


class ConventionMethods:
    """Base class (before ``torch.optim.Optimizer``) of ``Gefen`` and ``GefenMuon``: the
    ``IdentityBindable``, ``CollectiveScoped``, ``CanonicalLocalState``, ``PortableAdapter`` and
    staged-native-load methods, each delegating to the class's role (module docstring)."""

    _native: NativeCheckpoint
    _portable: PortableRole
    _canonical: CanonicalRole

    # -- IdentityBindable and CollectiveScoped (:mod:`gefen_core.identity`) -----------------------

    def prepare_post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> StagedTransaction:
        """Validate a post-sharding request and stage the new layout; nothing is mutated."""
        return identity.prepare_post_sharding(self, rebindings, manifest=manifest, scope=scope)

    def commit_post_sharding(self, staged: StagedTransaction) -> None:
        """Publish a staged binding by swaps that cannot raise, and seal the layout."""
        identity.commit_post_sharding(self, staged)

    def post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> None:
        """``prepare_post_sharding`` then ``commit_post_sharding`` (one atomic transaction)."""
        self.commit_post_sharding(self.prepare_post_sharding(rebindings, manifest=manifest, scope=scope))

    def sharding_manifest(self) -> ShardingManifest | None:
        """The finalized manifest (``None`` before ``post_sharding``)."""
        return identity.sharding_manifest(self)

    def shard_bindings(self) -> tuple[tuple[Any | None, ShardIdentity], ...]:
        """``(tensor or None, shard)`` per local slot, sorted by ``sort_key``."""
        return identity.shard_bindings(self)

    def shard_identity(self, parameter: Any) -> ShardIdentity:
        """The shard bound to ``parameter`` (``KeyError`` for an unbound tensor)."""
        return identity.shard_identity(self, parameter)

    def collective_scope(self) -> ProcessGroupBinding | None:
        """The installed codebook scope binding (``None`` when unscoped)."""
        return identity.collective_scope(self)

    def collective_budget(self) -> int:
        """Most host-synchronising collectives of one steady-state scoped ``step()`` (2: an entry
        vote when a closure is given, and the operation header)."""
        return STEADY_STEP_BUDGET

    def initialize_collective_state(self) -> bool:
        """Learn the codebook if none exists (collective under a scope); whether one exists after."""
        return identity.initialize_collective_state(self)

    def refresh_collective_state(self) -> bool:
        """Relearn the codebook and re-express every momentum index in it; whether it changed."""
        return identity.refresh_collective_state(self)

    # -- canonical local state (the role: :class:`gefen_core.canonical_state.CanonicalRole`) --------

    def export_local_state(self) -> dict[str, Any]:
        """This member's ``gefen.bound_state`` document (owned CPU copies; no collectives)."""
        return self._canonical.export(self)

    def prepare_local_import(self, document: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``document`` and stage it, routed by FQN into this optimizer's groups (no mutation)."""
        return self._canonical.prepare_import(self, document)

    def commit_local_import(self, staged: StagedTransaction) -> None:
        """Publish a prepared import (single use; ``StaleTransactionError`` and no change when stale)."""
        self._canonical.commit_import(self, staged)

    # -- portable state (the role: :class:`gefen_core.portable_adapter.PortableRole`) ----------

    def portable_layout(self) -> PortableLayout:
        """The local target layout of portable state: the sealed one, or the implicit one."""
        return self._portable.layout(self)

    def portable_export(self) -> PortableExport:
        """This member's compact state as portable records (fresh CPU copies; no collective)."""
        return self._portable.export(self)

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        """Check, re-encode and stage projected portable records for this layout (no mutation)."""
        return self._portable.prepare_import(
            self, implementation=implementation, policy=policy, common=common, slots=slots
        )

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        """Publish a staged portable import by the native load's swaps."""
        self._portable.commit_import(self, staged)

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The native state dict (``gefen.native_state`` / ``gefen.muon_native_state``: tensors and
        primitives only; a bound optimizer adds its shard-identity guard). GefenMuon's is collective
        when a group uses ``sharded_mode="distributed"`` under FSDP2: every rank of the mesh must
        call it, and every rank returns the complete, consolidated state."""
        return self._native.state_dict(self)

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``state_dict`` completely and stage the new state; changes nothing."""
        return self._native.stage_state_dict(self, state_dict)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        """Publish a staged load by swaps that cannot raise (stale or foreign stages are refused)."""
        self._native.commit_staged_state_dict(self, staged)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load pre-hooks, stage, commit, load post-hooks (fail-before-mutation; no collective)."""
        self._native.load_state_dict(self, state_dict)

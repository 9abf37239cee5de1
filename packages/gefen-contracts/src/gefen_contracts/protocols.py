"""The seams of the convention: one ``typing.Protocol`` per capability.

Each Protocol states exact signatures and the semantics an implementation promises, so a
second optimizer can implement it from this page alone. ``isinstance`` checks only that
the methods exist; the conformance kit (:mod:`gefen_contracts.testing`) executes the
promises. Claiming a feature in the contract obliges the matching Protocol
(:data:`FEATURE_PROTOCOLS`); implementing a Protocol obliges an explicit status for its
feature, supported or not (with reasons), and an implemented-but-unsupported Protocol
must raise :class:`~gefen_contracts.errors.NotSupportedError` and change nothing.

Common rules for every two-phase Protocol here:

* *prepare/stage* validates everything against a shadow and never mutates the live
  optimizer, its tensors or the caller's inputs; it returns a
  :class:`~gefen_contracts.transactions.StagedTransaction`.
* *commit* first checks the token (owner, kind, single use, freshness) and raises
  :class:`~gefen_contracts.errors.StaleTransactionError` without mutating on mismatch;
  otherwise it publishes by swaps that cannot raise.
* Nothing here runs user hooks unless the method says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .capabilities import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
)
from .contract import OptimizerContract
from .exchange import PortableExport, PortableLayout, PortableSlotState
from .identity import ShardIdentity
from .manifest import ShardingManifest
from .rebinding import ParameterRebinding
from .transactions import StagedTransaction

__all__ = [
    "FEATURE_PROTOCOLS",
    "PROTOCOL_FEATURES",
    "CanonicalLocalState",
    "CollectiveScoped",
    "Composite",
    "ContractProvider",
    "IdentityBindable",
    "ModeTaggedState",
    "ParameterShapedState",
    "PortableAdapter",
    "StagedNativeLoad",
    "StepPreflight",
]


@runtime_checkable
class ContractProvider(Protocol):
    """Publishes an :class:`~gefen_contracts.contract.OptimizerContract` (required of every adopter).

    ``optimizer_contract()`` is pure and cheap: O(local parameters), no collectives, no
    mutation of anything reachable from the optimizer (a deep snapshot is unchanged), and
    two calls on an unchanged optimizer return equal contracts. Claims are dynamic: a
    feature is supported only while the live optimizer is ready for it, and an unsupported
    feature carries the reasons why.
    """

    def optimizer_contract(self) -> OptimizerContract: ...


@runtime_checkable
class ModeTaggedState(Protocol):
    """Optional: the mode tags that select state variants for one parameter.

    ``state_mode_tags(parameter)`` returns the tags (e.g. ``{"gefen.muon.sharded_mode=exact"}``)
    that :func:`~gefen_contracts.state_layout.match_variants` should use for ``parameter``.
    Optimizers without mode-dependent variants need not implement it (no tags).
    """

    def state_mode_tags(self, parameter: Any) -> frozenset[str]: ...


@runtime_checkable
class StepPreflight(Protocol):
    """A step split into a side-effect-free preflight and the step proper.

    ``preflight_step()`` runs every check ``step()`` would run before mutating anything
    (gradient layout, dtype, shape and device, sparse or complex gradients, the sealed
    layout, option combinations) against the gradients currently attached, and raises the
    same specific error ``step()`` would raise, changing nothing. It runs no closure and no
    collective. A composite calls it on every child (and votes across ranks) before it lets
    any child step, so a bad gradient in one child cannot leave the other stepped.
    """

    def preflight_step(self) -> None: ...


@runtime_checkable
class StagedNativeLoad(Protocol):
    """Atomic native ``load_state_dict`` in two phases (feature ``staged_native_load``).

    ``stage_state_dict(state_dict)`` validates a native state dict completely (keys, types,
    shapes, dtypes, finiteness, counters, group count and sizes, hyperparameters) and builds
    the new state on a shadow; it raises a ``ValueError``/``TypeError``/``KeyError`` subclass
    naming the problem and changes nothing (not the optimizer, not its tensors, not the
    caller's dict). No hooks run. ``commit_staged_state_dict(staged)`` publishes the staged
    state (see the module rules). ``load_state_dict`` must equal: load pre-hooks, stage,
    commit, load post-hooks. A composite stages every child before committing any.
    """

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction: ...

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None: ...


@runtime_checkable
class IdentityBindable(Protocol):
    """Post-sharding rebinding of every optimizer slot to its live local tensor (feature
    ``post_sharding``; ``canonical_identity`` once finalized).

    ``prepare_post_sharding(rebindings, *, manifest, scope=None)`` requires a pristine
    optimizer (no step taken, no state beyond names), exactly one rebinding per current
    slot, unique and storage-disjoint targets free of self-overlap, local shards that are
    elements of ``manifest`` and whose FQN set equals it, and layouts the optimizer claims
    in its contract. ``scope`` is an optional collective binding (for example a
    ``CodebookProcessGroupBinding``) installed with the layout. It returns a staged
    transaction and mutates nothing. ``commit_post_sharding(staged)`` publishes the new
    groups, state and identity map in one swap and seals the layout: ``add_param_group``
    and a second ``post_sharding`` (or ``prepare_post_sharding``) raise ``RuntimeError``
    afterwards, changing nothing, and any later change to the published
    layout through public containers raises
    :class:`~gefen_contracts.errors.LayoutTamperedError` before mutation.
    ``post_sharding(...)`` is prepare + commit. Training after rebinding is bit-identical to
    an optimizer built directly on the final tensors.

    Queries: ``sharding_manifest()`` (``None`` before finalization), ``shard_bindings()``
    (``(tensor or None, ShardIdentity)`` per local slot sorted by ``sort_key``; pruned
    non-owner slots carry ``None``; ``()`` before finalization), ``shard_identity(parameter)``
    (``KeyError`` for an unknown tensor, and before finalization). On each member they name
    that member's own shards, never another member's.

    A finalized optimizer's native ``state_dict()`` carries its identity under
    :data:`gefen_contracts.torch_support.IDENTITY_KEY` and a load refuses another member's
    (``identity_guard`` / ``split_identity_guard`` there).
    """

    def prepare_post_sharding(
        self,
        rebindings: Sequence[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        scope: object | None = None,
    ) -> StagedTransaction: ...

    def commit_post_sharding(self, staged: StagedTransaction) -> None: ...

    def post_sharding(
        self,
        rebindings: Sequence[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        scope: object | None = None,
    ) -> None: ...

    def sharding_manifest(self) -> ShardingManifest | None: ...

    def shard_bindings(self) -> tuple[tuple[Any | None, ShardIdentity], ...]: ...

    def shard_identity(self, parameter: Any) -> ShardIdentity: ...


@runtime_checkable
class CanonicalLocalState(Protocol):
    """FQN-keyed local state documents (feature ``canonical_local_state``, transport
    ``CANONICAL_LOCAL``).

    ``export_local_state()`` returns a document of primitive containers and detached,
    tight, finite CPU tensors (loadable with ``torch.load(weights_only=True)``) holding
    the envelope (``format``, ``format_version``, ``coverage``, ``implementation``), the
    policy record the optimizer chooses, optimizer-common state, the finalized manifest and
    per-FQN parameter entries with authoritative state only. No collectives.
    ``prepare_local_import(document)`` validates it against this optimizer (implementation,
    policy, manifest, per-parameter variants) and stages it on a shadow, routing by exact FQN
    across regrouped or reordered targets; it never mutates the optimizer or the document.
    ``commit_local_import(staged)`` is single-use and refuses a stale preparation (the
    freshness token is a version counter, not a content hash). Hooks are bypassed.
    """

    def export_local_state(self) -> dict[str, Any]: ...

    def prepare_local_import(self, document: Mapping[str, Any]) -> StagedTransaction: ...

    def commit_local_import(self, staged: StagedTransaction) -> None: ...


@runtime_checkable
class PortableAdapter(Protocol):
    """Topology-neutral state for portable export/import (feature ``portable_state``,
    transport ``CANONICAL_GLOBAL``). Called by an optimizer-agnostic driver such as
    ``gefen_portable``, which does the collectives, assembly, projection and digests.

    ``portable_layout()`` describes the local target layout (implementation, manifest,
    slots) without state. ``portable_export()`` returns this member's
    :class:`~gefen_contracts.exchange.PortableExport`: a primitive ``policy`` and ``common``
    record identical on every member, and one
    :class:`~gefen_contracts.exchange.PortableSlotState` per local slot: element fields
    (any wire dtype, shaped like the piece), block fields (one value per run of
    ``block_period`` elements) and replica fields, so a quantised state can travel in its
    compact form. It performs no
    collective and raises ``NotSupportedError`` if the optimizer is not ready.
    ``portable_prepare_import(*, implementation, policy, common, slots)`` receives the
    document's records already projected onto this member's slots (same order as
    ``portable_layout().slots``; block fields expanded per element, or as exported when a
    slot's piece is exactly one exported fragment), re-encodes them into native state for the local layout
    (re-blocking or re-quantising as needed), validates everything and stages it on a
    shadow without mutation. ``portable_commit_import(staged)`` publishes it (module rules).
    """

    def portable_layout(self) -> PortableLayout: ...

    def portable_export(self) -> PortableExport: ...

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction: ...

    def portable_commit_import(self, staged: StagedTransaction) -> None: ...


@runtime_checkable
class ParameterShapedState(Protocol):
    """State shaped like the parameters (feature ``parameter_shaped_state``, transport
    ``PARAMETER_SHAPED``): what plain ``dcp.save(optimizer.state_dict())``, torch's
    ``get/set_optimizer_state_dict`` and ``gefen_dcp.GefenDCPState`` need to reshard an
    optimizer's state N ranks to M with nothing but DCP.

    ``state_dict()`` is torch's: ``state`` keyed by torch's parameter numbering and
    ``param_groups``. The promise is about its tensors: each one under ``state[i]`` has a
    shape that depends only on parameter ``i``'s global shape and the options (never on
    data or topology) and is, for a DTensor parameter, a DTensor on the parameter's mesh
    placed like the parameter or replicated; every other tensor is a plain tensor equal on
    every rank. The load side is :class:`StagedNativeLoad`, so a verified load can stage
    before it commits.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction: ...

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None: ...


@runtime_checkable
class CollectiveScoped(Protocol):
    """State learned collectively over an explicit process-group scope (feature
    ``collective_scope``; Gefen's learned codebook is one).

    ``collective_scope()`` returns the installed binding or ``None``.
    ``initialize_collective_state()`` learns the shared state if absent (returns whether it
    exists afterwards); ``refresh_collective_state()`` relearns it (returns whether it
    changed). Both are collective over the scope: every rank-dependent branch is preceded
    by a vote, so a failure on one member makes every member raise
    :class:`~gefen_contracts.errors.CollectiveFailureError` with nothing mutated.
    ``collective_budget()`` is the most host-synchronising collectives one steady-state
    ``step()`` performs for the scope protocol; a test may count them.
    """

    def collective_scope(self) -> object | None: ...

    def initialize_collective_state(self) -> bool: ...

    def refresh_collective_state(self) -> bool: ...

    def collective_budget(self) -> int: ...


@runtime_checkable
class Composite(Protocol):
    """An optimizer made of child optimizers with roles (feature ``composite``).

    ``child_optimizers()`` maps each present role to its child, in a fixed order.
    ``parameter_routing()`` returns sorted ``(fqn, role)`` pairs for every parameter. The
    composite's checkpoint claims are the intersection of its children's, its training
    claims are per role, and its contract lists the children with their contracts.
    """

    def child_optimizers(self) -> Mapping[str, Any]: ...

    def parameter_routing(self) -> tuple[tuple[str, str], ...]: ...


#: Feature name -> the Protocol a supported claim obliges.
FEATURE_PROTOCOLS: dict[str, type] = {
    FEATURE_STAGED_NATIVE_LOAD: StagedNativeLoad,
    FEATURE_POST_SHARDING: IdentityBindable,
    FEATURE_CANONICAL_IDENTITY: IdentityBindable,
    FEATURE_CANONICAL_LOCAL_STATE: CanonicalLocalState,
    FEATURE_PORTABLE_STATE: PortableAdapter,
    FEATURE_PARAMETER_SHAPED_STATE: ParameterShapedState,
    FEATURE_COLLECTIVE_SCOPE: CollectiveScoped,
    FEATURE_COMPOSITE: Composite,
}

#: Protocol -> the feature whose status an implementation must state.
PROTOCOL_FEATURES: dict[type, str] = {
    StagedNativeLoad: FEATURE_STAGED_NATIVE_LOAD,
    IdentityBindable: FEATURE_POST_SHARDING,
    CanonicalLocalState: FEATURE_CANONICAL_LOCAL_STATE,
    PortableAdapter: FEATURE_PORTABLE_STATE,
    ParameterShapedState: FEATURE_PARAMETER_SHAPED_STATE,
    CollectiveScoped: FEATURE_COLLECTIVE_SCOPE,
    Composite: FEATURE_COMPOSITE,
}

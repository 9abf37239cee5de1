"""The composite's ``IdentityBindable`` and ``CanonicalLocalState`` work, as functions of the composite.

:class:`~gefen_hybrid.composite.CompositeOptimizer`'s Protocol methods call these (one
concept: binding the children's shard identity and moving their canonical state together);
no base class. They work on the composite's children only through the gefen-contracts
Protocols, and on the composite through its ``_children``, ``_identity``, ``_changes``,
``_owners``, ``_owner_map`` and ``optimizer_contract``.

* ``post_sharding``: one request validated against both children and partitioned by the
  routing (:mod:`gefen_hybrid.composite_identity`); every child is prepared before any is
  committed, and prepared again immediately before the commits, so a child can neither refuse
  after another committed nor commit a stale preparation. The composite's own record
  (:class:`~gefen_hybrid.composite_identity.CompositeIdentity`) is published last.
* Canonical local state: the ``gefen.composite_bound_state`` document
  (:mod:`gefen_hybrid.composite_bound_state`); every child's import is prepared before any is
  committed. The freshness token covers the composite's change counter (children's step
  attempts, loads, new groups), each child's state object, and the version counters of every
  parameter, option and state value of both children.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_POST_SHARDING,
    LayoutTamperedError,
    StaleTransactionError,
)
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import state_version_token
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .composite_bound_state import build_composite_document, children_of_document
from .composite_identity import CompositeBindingRequest, CompositeIdentity, plan_composite_binding

if TYPE_CHECKING:
    from .composite import CompositeOptimizer

__all__ = [
    "ChangeCounter",
    "commit_local_import",
    "commit_post_sharding",
    "export_local_state",
    "identity_blockers",
    "prepare_local_import",
    "prepare_post_sharding",
    "shard_bindings",
    "shard_identity",
    "sharding_manifest",
    "verify_identity",
]

_BIND_KIND = "gefen.CompositeOptimizer.post_sharding"
_IMPORT_KIND = "gefen.CompositeOptimizer.local_import"
_IDENTITY_FEATURES = (FEATURE_POST_SHARDING, FEATURE_CANONICAL_IDENTITY, FEATURE_CANONICAL_LOCAL_STATE)


class ChangeCounter:
    """Counts changes to the composite or its children (part of every freshness token)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def bump(self, *_: object) -> None:
        self.value += 1


def _manifest_of(child: torch.optim.Optimizer) -> ShardingManifest | None:
    query = getattr(child, "sharding_manifest", None)
    return query() if callable(query) else None


def _child_groups(composite: CompositeOptimizer) -> list[dict[str, Any]]:
    return [group for _, child in composite._children for group in child.param_groups]


def identity_blockers(composite: CompositeOptimizer) -> dict[str, tuple[str, ...]]:
    """Why the composite itself cannot make identity claims its children make (cheap)."""
    reasons: tuple[str, ...] = ()
    if composite._identity is None:
        bound = [role for role, child in composite._children if _manifest_of(child) is not None]
        if bound:
            reasons = (
                f"child {bound[0]!r} was finalized by its own post_sharding, outside the composite; finalize "
                "through the composite so that it records the routing by canonical FQN",
            )
    else:
        try:
            verify_identity(composite, "optimizer_contract")
        except LayoutTamperedError as exc:
            reasons = (str(exc),)
    return {feature: reasons for feature in _IDENTITY_FEATURES} if reasons else {}


# -- IdentityBindable -------------------------------------------------------------------------


def verify_identity(composite: CompositeOptimizer, where: str) -> None:
    """Each child's sealed layout (its queries verify it) and the sub-manifest it was given."""
    identity = composite._identity
    if identity is None:
        return
    for role, child in composite._children:
        if _manifest_of(child) != identity.child_manifests[role]:
            raise LayoutTamperedError(
                f"{where}: child {role!r} is no longer bound to the manifest the composite's post_sharding gave it"
            )


def _freshness(composite: CompositeOptimizer) -> tuple[object, ...]:
    """Change counter (children's steps, loads, new groups), every child's state object, and
    the version counters of every parameter, option and state value of both children."""
    children = tuple(
        (id(child.state), state_version_token(child.param_groups, child.state)) for _, child in composite._children
    )
    return (composite._changes.value, children)


def _plan_binding(
    composite: CompositeOptimizer,
    rebindings: Sequence[ParameterRebinding],
    manifest: ShardingManifest,
    scope: object | None,
) -> CompositeBindingRequest:
    owners = composite._owner_map()  # not the cache: preparing must not change the composite
    return plan_composite_binding(
        composite._children,
        _child_groups(composite),
        lambda p: owners[id(p)][1],
        rebindings,
        manifest=manifest,
        scope=scope,
    )


def _prepare_children(composite: CompositeOptimizer, request: CompositeBindingRequest) -> dict[str, StagedTransaction]:
    return {
        role: child.prepare_post_sharding(  # type: ignore[attr-defined]
            request.by_role[role],
            manifest=request.identity.child_manifests[role],
            scope=request.child_scopes[role],
        )
        for role, child in composite._children
    }


def prepare_post_sharding(
    composite: CompositeOptimizer,
    rebindings: Sequence[ParameterRebinding],
    *,
    manifest: ShardingManifest,
    scope: object | None = None,
) -> StagedTransaction:
    """Validate the request once for the composite, partition it by the routing and prepare
    every child with its part and sub-manifest; nothing is mutated.

    ``RuntimeError`` if already finalized; ``NotSupportedError`` when a child cannot be
    bound (its reason is repeated); a child's own refusal propagates unchanged.
    """
    if composite._identity is not None:
        raise RuntimeError("post_sharding: this composite is already finalized (its layout is sealed)")
    composite.optimizer_contract().require(FEATURE_POST_SHARDING)
    request = _plan_binding(composite, rebindings, manifest, scope)
    _prepare_children(composite, request)  # every child validates its part; none is committed
    return StagedTransaction(composite, kind=_BIND_KIND, token=_freshness(composite), payload=request)


def commit_post_sharding(composite: CompositeOptimizer, staged: StagedTransaction) -> None:
    """Publish a prepared binding on both children, then the composite's own record.

    The children are prepared again right before the commits, with nothing in between, so
    no child can refuse after another one committed: a child that changed since
    ``prepare_post_sharding`` makes this raise ``StaleTransactionError`` with nothing changed.
    """
    request = require_transaction(staged).claim(composite, kind=_BIND_KIND, current_token=_freshness(composite))
    assert isinstance(request, CompositeBindingRequest)
    try:
        fresh = _prepare_children(composite, request)
    except Exception as exc:
        raise StaleTransactionError(
            f"a child no longer accepts its part of the prepared post_sharding ({type(exc).__name__}: {exc}); "
            "prepare it again"
        ) from exc
    for role, child in composite._children:
        child.commit_post_sharding(fresh[role])  # type: ignore[attr-defined]
    pairs = [pair for _, child in composite._children for pair in child.shard_bindings()]  # type: ignore[attr-defined]
    bindings = tuple(sorted(pairs, key=lambda pair: pair[1].sort_key))
    composite._identity = replace(request.identity, bindings=bindings)
    composite._owners = {}
    composite._changes.bump()


def sharding_manifest(composite: CompositeOptimizer) -> ShardingManifest | None:
    """The full finalized manifest (``None`` before ``post_sharding``); verifies the children first."""
    verify_identity(composite, "sharding_manifest")
    return None if composite._identity is None else composite._identity.manifest


def shard_bindings(composite: CompositeOptimizer) -> tuple[tuple[Any | None, ShardIdentity], ...]:
    """Both children's bindings, sorted by ``sort_key`` (``()`` before ``post_sharding``)."""
    verify_identity(composite, "shard_bindings")
    return () if composite._identity is None else composite._identity.bindings


def shard_identity(composite: CompositeOptimizer, parameter: Any) -> ShardIdentity:
    """The shard the owning child bound to ``parameter`` (``KeyError`` otherwise)."""
    verify_identity(composite, "shard_identity")
    owner = composite._owner_of(parameter) if isinstance(parameter, torch.Tensor) else None
    if composite._identity is None or owner is None:
        raise KeyError("no shard identity is bound to this tensor in this composite")
    return owner.shard_identity(parameter)  # type: ignore[attr-defined,no-any-return]


# -- CanonicalLocalState ------------------------------------------------------------------------


def _finalized_identity(composite: CompositeOptimizer, where: str) -> CompositeIdentity:
    verify_identity(composite, where)
    composite.optimizer_contract().require(FEATURE_CANONICAL_LOCAL_STATE)
    assert composite._identity is not None
    return composite._identity


def export_local_state(composite: CompositeOptimizer) -> dict[str, Any]:
    """The ``gefen.composite_bound_state`` document: each child's own document by role, the
    routing and the manifest (no collectives)."""
    identity = _finalized_identity(composite, "export_local_state")
    return build_composite_document(
        implementation=composite._implementation,
        child_implementations=composite._child_implementations,
        manifest=identity.manifest,
        routing=identity.routing,
        children={role: child.export_local_state() for role, child in composite._children},  # type: ignore[attr-defined]
    )


def prepare_local_import(composite: CompositeOptimizer, document: Mapping[str, Any]) -> StagedTransaction:
    """Validate the envelope (implementations, manifest, routing) and prepare every child's
    import from its part; nothing is mutated (a child's refusal leaves both untouched)."""
    identity = _finalized_identity(composite, "prepare_local_import")
    parts = children_of_document(
        document,
        implementation=composite._implementation,
        child_implementations=composite._child_implementations,
        manifest=identity.manifest,
        routing=identity.routing,
    )
    staged = {role: child.prepare_local_import(parts[role]) for role, child in composite._children}  # type: ignore[attr-defined]
    return StagedTransaction(composite, kind=_IMPORT_KIND, token=_freshness(composite), payload=staged)


def commit_local_import(composite: CompositeOptimizer, staged: StagedTransaction) -> None:
    """Publish every child's prepared import (single use; ``StaleTransactionError`` and no
    change when the composite or a child changed since preparation)."""
    verify_identity(composite, "commit_local_import")
    payload = require_transaction(staged).claim(composite, kind=_IMPORT_KIND, current_token=_freshness(composite))
    assert isinstance(payload, dict)
    for role, child in composite._children:
        child.commit_local_import(payload[role])  # type: ignore[attr-defined]
    composite._changes.bump()

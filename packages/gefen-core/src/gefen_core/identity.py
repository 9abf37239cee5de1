"""Post-sharding identity binding and the codebook scope entry points of ``Gefen`` and ``GefenMuon``.

:func:`prepare_post_sharding` and its siblings are functions of the optimizer; both
optimizers' ``IdentityBindable`` and ``CollectiveScoped`` methods delegate to them (one
concept: binding every slot to its live local tensor and stable shard identity, sealing the
layout, and exposing the codebook scope). The request itself is validated by the generic
``gefen_contracts.torch_support.plan_rebinding``; the optimizer adds what is its own:

* the layouts it binds (its ``_binding.check_layout``): ``Gefen`` replicated and flattened element
  shards, ``GefenMuon`` replicated and whole-parameter owner (2-D parameters);
* pristine (``_binding.pristine_blockers``): no parameter state, global step 0, no codebook, no
  device counters, i.e. ``post_sharding`` runs before the first step;
* a multi-member ``scope``: every manifest shard names the scope's process group, and
  ``capturable=False`` (the scope protocol synchronises with the host).

``prepare_post_sharding`` stages new group dicts and an immutable :class:`IdentityRecord`
(the sealed layout of ``gefen_contracts.torch_support.SealedLayout``, the scope and the
scope fingerprint every member compares in its step headers) without touching anything;
``commit_post_sharding`` publishes them by swaps that cannot raise. Afterwards
``add_param_group`` and a second ``post_sharding`` raise, and every entry point (``step``
before and after its closure, ``preflight_step``, checkpoints, canonical state, the scope
operations, the identity queries) verifies the sealed layout against the public
containers in O(local parameters), raising ``LayoutTamperedError`` before any mutation.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from gefen_contracts import (
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_POST_SHARDING,
    ContractError,
    FeatureStatus,
    LayoutTamperedError,
    NotSupportedError,
)
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import (
    IDENTITY_KEY,
    ProcessGroupBinding,
    RebindingPlan,
    SealedLayout,
    compatibility_names,
    identity_guard,
    plan_rebinding,
    publish_binding,
    rebuilt_plan,
    staged_groups,
    state_version_token,
    tensor_digest,
)
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .codebook_scope import digest_words

__all__ = [
    "collective_scope",
    "commit_post_sharding",
    "initialize_collective_state",
    "pickled_identity",
    "prepare_post_sharding",
    "refresh_collective_state",
    "restored_identity",
    "shard_bindings",
    "shard_identity",
    "sharding_manifest",
    "IdentityReadiness",
    "IdentityRecord",
    "bound_layout",
    "identity_readiness",
    "refuse_when_sealed",
    "scope_fingerprint",
    "verify_layout",
    "with_identity_guard",
]

_BIND_KIND = "gefen.post_sharding"


@dataclass(frozen=True, slots=True, eq=False)
class IdentityRecord:
    """A finalized layout: the sealed slots and bindings, the codebook scope (``None`` when
    unscoped), the scope fingerprint (four int64 of the scope, manifest and policy digest),
    the manifest's FQNs and the tensors of shared (replicated and flattened) parameters in
    binding order, whose gradient presence every member compares."""

    sealed: SealedLayout
    scope: ProcessGroupBinding | None
    fingerprint: tuple[int, ...]
    fqns: tuple[str, ...]
    shared: tuple[torch.Tensor, ...]

    @property
    def manifest(self) -> ShardingManifest:
        return self.sealed.manifest

    @property
    def communicates(self) -> bool:
        return self.scope is not None and self.scope.communicates

    @property
    def layouts(self) -> frozenset[ParameterLayout]:
        return frozenset(shard.layout for _, shard in self.sealed.bindings)


@dataclass(frozen=True, slots=True)
class IdentityReadiness:
    """The identity and scope facts a contract is built from (cheap, hashable)."""

    post_sharding: FeatureStatus
    identity: FeatureStatus
    collective_scope: FeatureStatus
    layouts: frozenset[ParameterLayout] = frozenset()
    scoped: bool = False
    pruned: bool = False

    @property
    def finalized(self) -> bool:
        return bool(self.layouts) or self.pruned


def scope_fingerprint(
    implementation: str, scope: ProcessGroupBinding | None, manifest: ShardingManifest, policy: Mapping[str, object]
) -> tuple[int, ...]:
    """Four int64 of the canonical digest of what every member of a scope must share."""
    from gefen_contracts.codec import to_primitive

    record = {
        "implementation": implementation,
        "scope": None if scope is None else scope.scope_record(),
        "manifest": to_primitive(manifest),
        "policy": dict(policy),
    }
    return tuple(digest_words(bytes.fromhex(tensor_digest(record))))


def _record(plan: RebindingPlan, group_count: int, implementation: str, policy: Mapping[str, object]) -> IdentityRecord:
    sealed = SealedLayout(plan, group_count)
    shared = tuple(
        tensor
        for tensor, shard in sealed.bindings
        if tensor is not None and shard.layout is not ParameterLayout.WHOLE_PARAMETER_OWNER
    )
    return IdentityRecord(
        sealed,
        plan.scope,
        scope_fingerprint(implementation, plan.scope, plan.manifest, policy),
        plan.manifest.fqns,
        shared,
    )


def _rebuild(
    param_groups: Sequence[Mapping[str, Any]],
    manifest: ShardingManifest,
    slots: Sequence[Any],
    scope: ProcessGroupBinding | None,
    implementation: str,
    policy: Mapping[str, object],
) -> IdentityRecord:
    """The record of a copied optimizer (``gefen_contracts.torch_support.rebuilt_plan``)."""
    return _record(rebuilt_plan(param_groups, manifest, slots, scope), len(param_groups), implementation, policy)


@dataclass(frozen=True, slots=True, eq=False)
class _StagedBinding:
    groups: tuple[dict[str, Any], ...]
    record: IdentityRecord


# -- the sealed layout and readiness, read by every role of the optimizer -----------------------


def verify_layout(optimizer: Any, where: str) -> None:
    """Raise ``LayoutTamperedError`` if the sealed layout was changed (no-op before post_sharding)."""
    identity = optimizer._identity
    if identity is not None:
        identity.sealed.verify(optimizer.param_groups, optimizer.state, where=where)


def refuse_when_sealed(optimizer: Any) -> None:
    """``RuntimeError`` once ``post_sharding`` sealed the layout (``add_param_group`` calls it first)."""
    if getattr(optimizer, "_identity", None) is not None:
        raise RuntimeError(
            "add_param_group: the parameter layout was sealed by post_sharding; build the optimizer with every "
            "parameter group before calling post_sharding"
        )


def bound_layout(optimizer: Any) -> SealedLayout | None:
    """The sealed layout the transports (portable state) read; ``None`` before
    ``post_sharding`` (the implicit layout: one replicated shard per named parameter)."""
    identity = optimizer._identity
    return None if identity is None else identity.sealed


def with_identity_guard(optimizer: Any, native: dict[str, Any]) -> dict[str, Any]:
    """A native state dict the transports built for the live layout, with the live
    shard-identity guard when bound (the transport matched every slot by shard identity)."""
    identity = optimizer._identity
    return native if identity is None else {**native, IDENTITY_KEY: identity_guard(identity.sealed)}


def _identity_freshness(optimizer: Any) -> Hashable:
    # what a staged binding is checked against: the mutation counter and every version counter
    return (optimizer._version, id(optimizer.state), state_version_token(optimizer.param_groups, optimizer.state))


def identity_readiness(optimizer: Any) -> IdentityReadiness:
    """Post-sharding, identity and scope status for the contract (O(local parameters))."""
    identity = optimizer._identity
    scope = (
        FeatureStatus.no(
            "capturable=True: the scope protocol and codebook learning on demand synchronise with the host"
        )
        if optimizer._capturable
        else FeatureStatus.yes()
    )
    if identity is None:
        blockers = optimizer._binding.pristine_blockers(optimizer)
        unbound = FeatureStatus.no("the optimizer is not finalized: call post_sharding with a ShardingManifest")
        post_sharding = FeatureStatus.no(*blockers) if blockers else FeatureStatus.yes()
        return IdentityReadiness(post_sharding, unbound, scope)
    pruned = any(tensor is None for tensor, _ in identity.sealed.bindings)
    try:
        verify_layout(optimizer, "optimizer_contract")
    except LayoutTamperedError as exc:
        broken = FeatureStatus.no(str(exc))
        return IdentityReadiness(FeatureStatus.yes(), broken, broken, identity.layouts, identity.scope is not None)
    return IdentityReadiness(
        FeatureStatus.yes(), FeatureStatus.yes(), scope, identity.layouts, identity.scope is not None, pruned
    )


def _check_scope(optimizer: Any, plan: RebindingPlan) -> None:
    scope = plan.scope
    if scope is None or not scope.communicates:
        return
    if optimizer._capturable:
        raise ContractError(
            "post_sharding: a multi-member codebook scope needs capturable=False (its protocol synchronises with "
            "the host every step)"
        )
    for shard in plan.manifest.shards:
        if shard.process_group != scope.identity:
            raise ContractError(
                f"post_sharding: with a {scope.member_count}-member codebook scope every manifest shard must name "
                f"its process group {scope.identity.semantic_name!r}; {shard.fqn!r} does not"
            )


def _require_scope_feature(optimizer: Any, where: str) -> None:
    identity = optimizer._identity
    if identity is not None and identity.communicates:
        # bound with a multi-member scope, so the feature is there; the protocol's preamble checks
        # the layout inside its vote: a tampered member fails every member, where raising here
        # left the others waiting in the header's all_gather
        return
    verify_layout(optimizer, where)  # a tampered layout raises LayoutTamperedError, not a contract refusal
    status = identity_readiness(optimizer).collective_scope
    if not status.supported:
        raise NotSupportedError(FEATURE_COLLECTIVE_SCOPE, status.reasons)


# -- IdentityBindable and CollectiveScoped: the optimizer's methods delegate here -----------------


def prepare_post_sharding(
    optimizer: Any,
    rebindings: Sequence[ParameterRebinding],
    *,
    manifest: ShardingManifest,
    scope: object | None = None,
) -> StagedTransaction:
    """Validate a post-sharding request and stage the new layout; nothing is mutated.

    Raises ``RuntimeError`` if already finalized, ``NotSupportedError`` (with reasons)
    when the optimizer is not pristine, and ``ContractError`` / ``ContractTypeError`` /
    ``RuntimeError`` for an invalid request: see the module docstring and
    ``gefen_contracts.torch_support.plan_rebinding``. ``scope`` is a
    ``CodebookProcessGroupBinding`` (its runtime is validated here, with local queries).
    """
    if optimizer._identity is not None:
        raise RuntimeError("post_sharding: this optimizer is already finalized (its layout is sealed)")
    blockers = optimizer._binding.pristine_blockers(optimizer)
    if blockers:
        raise NotSupportedError(FEATURE_POST_SHARDING, blockers)
    plan = plan_rebinding(
        optimizer.param_groups,
        rebindings,
        manifest=manifest,
        scope=scope,
        name_of=compatibility_names(optimizer.param_groups),
        check_layout=optimizer._binding.check_layout,
    )
    _check_scope(optimizer, plan)
    record = _record(
        plan,
        len(optimizer.param_groups),
        optimizer._identity_implementation,
        optimizer._binding.scope_policy(optimizer),
    )
    payload = _StagedBinding(staged_groups(optimizer.param_groups, plan), record)
    return StagedTransaction(optimizer, kind=_BIND_KIND, token=_identity_freshness(optimizer), payload=payload)


def commit_post_sharding(optimizer: Any, staged: StagedTransaction) -> None:
    """Publish a staged binding by swaps that cannot raise, and seal the layout.

    ``StaleTransactionError`` (nothing changed) for a foreign, consumed or stale
    transaction (the optimizer, its parameters, options or state changed since prepare).
    """
    payload = require_transaction(staged).claim(
        optimizer, kind=_BIND_KIND, current_token=_identity_freshness(optimizer)
    )
    assert isinstance(payload, _StagedBinding)
    publish_binding(optimizer, payload.groups)
    optimizer._identity = payload.record
    optimizer._version += 1


def sharding_manifest(optimizer: Any) -> ShardingManifest | None:
    """The finalized manifest (``None`` before ``post_sharding``); verifies the layout first."""
    verify_layout(optimizer, "sharding_manifest")
    return None if optimizer._identity is None else optimizer._identity.manifest


def shard_bindings(optimizer: Any) -> tuple[tuple[Any | None, ShardIdentity], ...]:
    """``(tensor or None, shard)`` per local slot sorted by ``sort_key`` (pruned non-owners
    carry ``None``; ``()`` before ``post_sharding``)."""
    verify_layout(optimizer, "shard_bindings")
    return () if optimizer._identity is None else optimizer._identity.sealed.bindings


def shard_identity(optimizer: Any, parameter: Any) -> ShardIdentity:
    """The shard bound to ``parameter`` (``KeyError`` for an unbound tensor or before post_sharding)."""
    verify_layout(optimizer, "shard_identity")
    record: IdentityRecord | None = optimizer._identity
    if record is None:
        raise KeyError("no shard identity is bound: call post_sharding first")
    return record.sealed.shard_identity(parameter)


# -- CollectiveScoped --------------------------------------------------------------------


def collective_scope(optimizer: Any) -> ProcessGroupBinding | None:
    """The installed codebook scope binding (``None`` when unscoped)."""
    identity = optimizer._identity
    return None if identity is None else identity.scope


def initialize_collective_state(optimizer: Any) -> bool:
    """Learn the codebook from the attached gradients if none exists; returns whether a
    codebook exists afterwards (periods are still chosen by each parameter's first step).

    With a codebook scope it is collective: every member must call it, and a local failure
    raises ``CollectiveFailureError`` on every member with nothing changed. Without one it
    learns from this process's gradients.
    """
    _require_scope_feature(optimizer, "initialize_collective_state")
    return bool(optimizer._binding.initialize(optimizer))


def refresh_collective_state(optimizer: Any) -> bool:
    """Relearn the codebook from the attached gradients (stored periods) and re-express every
    momentum index in it (collectively over the scope, if any); returns whether the codebook
    changed (``False`` without a codebook or when no member has a gradient)."""
    _require_scope_feature(optimizer, "refresh_collective_state")
    return bool(optimizer._binding.refresh(optimizer))


def pickled_identity(optimizer: Any) -> object:
    """The tensor-free record a pickled or deep-copied optimizer carries of its sealed layout
    (the layout holds tensors by identity; it is rebuilt around the copied tensors)."""
    identity = optimizer.__dict__.get("_identity")
    return None if identity is None else (identity.manifest, identity.sealed.slots, identity.scope)


def restored_identity(optimizer: Any, record: object) -> IdentityRecord | None:
    """The sealed layout of a copied optimizer from :func:`pickled_identity`'s record."""
    if record is None:
        return None
    manifest, slots, scope = cast(tuple[ShardingManifest, Sequence[Any], "ProcessGroupBinding | None"], record)
    return _rebuild(
        optimizer.param_groups,
        manifest,
        slots,
        scope,
        optimizer._identity_implementation,
        optimizer._binding.scope_policy(optimizer),
    )

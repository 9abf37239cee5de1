"""Post-sharding identity binding and the codebook scope entry points of ``Gefen`` and ``GefenMuon``.

:func:`prepare_post_sharding` and its siblings are functions of the optimizer; both
optimizers' ``IdentityBindable`` and ``CollectiveScoped`` methods delegate to them (one
concept: binding every slot to its live local tensor and stable shard identity, sealing the
layout, and exposing the codebook scope). The binding itself is every optimizer's role,
``gefen_contracts.torch_support.IdentityBinding`` (:func:`identity_binding` builds Gefen's and
GefenMuon's); the optimizer adds what is its own:

* the layouts it binds (its ``_binding.check_layout``): ``Gefen`` replicated and flattened element
  shards, ``GefenMuon`` replicated and whole-parameter owner (2-D parameters);
* pristine (``_binding.pristine_blockers``): no parameter state, global step 0, no codebook, no
  device counters, i.e. ``post_sharding`` runs before the first step;
* a multi-member ``scope``: every manifest shard names the scope's process group, and
  ``capturable=False`` (the scope protocol synchronises with the host).

``prepare_post_sharding`` stages new group dicts, the sealed layout and the immutable
:class:`IdentityRecord` derived from it (the seal, the scope and the scope fingerprint every
member compares in its step headers) without touching anything; ``commit_post_sharding``
publishes them by swaps that cannot raise. Afterwards
``add_param_group`` and a second ``post_sharding`` raise, and every entry point (``step``
before and after its closure, ``preflight_step``, checkpoints, canonical state, the scope
operations, the identity queries) verifies the sealed layout against the public
containers in O(local parameters), raising ``LayoutTamperedError`` before any mutation.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_COLLECTIVE_SCOPE,
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
    IdentityBinding,
    ProcessGroupBinding,
    RebindingPlan,
    SealedLayout,
    state_version_token,
    tensor_digest,
)
from gefen_contracts.transactions import StagedTransaction

from .codebook_scope import digest_words

__all__ = [
    "collective_scope",
    "commit_post_sharding",
    "initialize_collective_state",
    "pickled_identity",
    "prepare_post_sharding",
    "refresh_collective_state",
    "restore_identity",
    "shard_bindings",
    "shard_identity",
    "sharding_manifest",
    "IdentityReadiness",
    "IdentityRecord",
    "bound_layout",
    "identity_readiness",
    "identity_binding",
    "scope_fingerprint",
    "verify_layout",
]


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


def _record(optimizer: Any, sealed: SealedLayout) -> IdentityRecord:
    """The scope facts of a seal (staged with it, so a commit cannot fail computing them)."""
    shared = tuple(
        tensor
        for tensor, shard in sealed.bindings
        if tensor is not None and shard.layout is not ParameterLayout.WHOLE_PARAMETER_OWNER
    )
    policy = optimizer._binding.scope_policy(optimizer)
    fingerprint = scope_fingerprint(optimizer._identity_implementation, sealed.scope, sealed.manifest, policy)
    return IdentityRecord(sealed, sealed.scope, fingerprint, sealed.manifest.fqns, shared)


def identity_binding(optimizer: Any) -> IdentityBinding:
    """The post-sharding role of a Gefen or GefenMuon (its layouts and its scope checks)."""
    return IdentityBinding(type(optimizer).__name__, optimizer._binding.check_layout, _check_scope, _record)


# -- the sealed layout and readiness, read by every role of the optimizer -----------------------


def verify_layout(optimizer: Any, where: str) -> None:
    """Raise ``LayoutTamperedError`` if the sealed layout was changed (no-op before post_sharding)."""
    optimizer._identity_binding.verify(optimizer, where)


def bound_layout(optimizer: Any) -> SealedLayout | None:
    """The sealed layout the transports (portable state) read; ``None`` before
    ``post_sharding`` (the implicit layout: one replicated shard per named parameter)."""
    return optimizer._identity_binding.sealed  # type: ignore[no-any-return]


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
    return optimizer._identity_binding.prepare(  # type: ignore[no-any-return]
        optimizer,
        rebindings,
        manifest=manifest,
        scope=scope,
        blockers=optimizer._binding.pristine_blockers(optimizer),
        token=_identity_freshness(optimizer),
    )


def commit_post_sharding(optimizer: Any, staged: StagedTransaction) -> None:
    """Publish a staged binding by swaps that cannot raise, and seal the layout.

    ``StaleTransactionError`` (nothing changed) for a foreign, consumed or stale
    transaction (the optimizer, its parameters, options or state changed since prepare).
    """
    binding = optimizer._identity_binding
    binding.commit(optimizer, staged, token=_identity_freshness(optimizer))
    optimizer._identity = binding.derived  # the record staged with the seal (see _record)
    optimizer._version += 1


def sharding_manifest(optimizer: Any) -> ShardingManifest | None:
    """The finalized manifest (``None`` before ``post_sharding``); verifies the layout first."""
    return optimizer._identity_binding.manifest(optimizer)  # type: ignore[no-any-return]


def shard_bindings(optimizer: Any) -> tuple[tuple[Any | None, ShardIdentity], ...]:
    """``(tensor or None, shard)`` per local slot sorted by ``sort_key`` (pruned non-owners
    carry ``None``; ``()`` before ``post_sharding``)."""
    return optimizer._identity_binding.bindings(optimizer)  # type: ignore[no-any-return]


def shard_identity(optimizer: Any, parameter: Any) -> ShardIdentity:
    """The shard bound to ``parameter`` (``KeyError`` for an unbound tensor or before post_sharding)."""
    return optimizer._identity_binding.shard_identity(optimizer, parameter)  # type: ignore[no-any-return]


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
    binding = optimizer.__dict__.get("_identity_binding")
    return None if binding is None else binding.record()


def restore_identity(optimizer: Any, record: object) -> None:
    """Give a copied optimizer its role and seal from :func:`pickled_identity`'s record."""
    binding = optimizer._identity_binding = identity_binding(optimizer)
    binding.restore(optimizer, record)
    optimizer._identity = binding.derived

"""How a composite binds shard identity: one request, partitioned by the routing.

``plan_composite_binding`` validates the whole request once against the composite's groups
(``gefen_contracts.torch_support.plan_rebinding``: every slot of both children, unique
sources and targets, storage disjointness across children, the manifest's FQN set, the
scope binding), then gives each child the rebindings of the slots it owns, the manifest
restricted to its FQNs and, if it claims ``collective_scope``, the scope binding. The
children validate their own parts (pristine state, layouts) when they are prepared.

:class:`CompositeIdentity` is the composite's own sealed record, published after both
children committed: the full manifest, the routing by canonical FQN and each child's
sub-manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import FEATURE_COLLECTIVE_SCOPE, ContractError, NotSupportedError
from gefen_contracts.frozen import FrozenMap
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import plan_rebinding

__all__ = ["CompositeBindingRequest", "CompositeIdentity", "plan_composite_binding"]


@dataclass(frozen=True, slots=True, eq=False)
class CompositeIdentity:
    """The finalized identity of a composite (immutable; published in one swap).

    ``bindings`` are both children's local bindings sorted by ``sort_key`` (filled in once the
    children committed: they hold the children's tensors).
    """

    manifest: ShardingManifest
    routing: tuple[tuple[str, str], ...]
    child_manifests: Mapping[str, ShardingManifest]
    scope: object | None
    bindings: tuple[tuple[Any | None, ShardIdentity], ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class CompositeBindingRequest:
    """A validated composite request: each role's rebindings and scope, and the record to publish."""

    by_role: Mapping[str, tuple[ParameterRebinding, ...]]
    child_scopes: Mapping[str, object | None]
    identity: CompositeIdentity


def _accept(shard: ShardIdentity, target: torch.Tensor | None) -> None:
    return None  # each child checks the layouts it supports when it is prepared


def plan_composite_binding(
    children: Sequence[tuple[str, Any]],
    param_groups: Sequence[Mapping[str, Any]],
    owner_of: Callable[[torch.Tensor], Any],
    rebindings: Sequence[ParameterRebinding],
    *,
    manifest: ShardingManifest,
    scope: object | None,
) -> CompositeBindingRequest:
    """Validate and partition a composite ``post_sharding`` request (nothing is mutated).

    Raises what ``plan_rebinding`` raises for an invalid request, ``ContractError`` for a
    child that would receive no rebinding, and ``NotSupportedError`` for a ``scope`` no child
    can install.
    """
    plan = plan_rebinding(
        param_groups,
        rebindings,
        manifest=manifest,
        scope=scope,
        name_of=lambda group, slot, source: "",
        check_layout=_accept,
    )
    by_source = {id(r.old_parameter): r for r in rebindings}
    roles = {id(child): role for role, child in children}
    parts: dict[str, list[ParameterRebinding]] = {role: [] for role, _ in children}
    for entry in plan.entries:
        parts[roles[id(owner_of(entry.source))]].append(by_source[id(entry.source)])
    empty = [role for role, part in parts.items() if not part]
    if empty:
        raise ContractError(f"post_sharding: child {empty[0]!r} optimizes no parameter, so it cannot be bound")
    scoped = {role for role, child in children if _claims_scope(child)}
    if scope is not None and not scoped:
        raise NotSupportedError(
            FEATURE_COLLECTIVE_SCOPE, ("no child of this composite learns anything over a collective scope",)
        )
    routing = tuple(sorted((r.shard.fqn, role) for role, part in parts.items() for r in part))
    child_manifests = {role: manifest.restricted_to({r.shard.fqn for r in part}) for role, part in parts.items()}
    identity = CompositeIdentity(manifest, routing, FrozenMap(child_manifests), scope)
    return CompositeBindingRequest(
        FrozenMap({role: tuple(part) for role, part in parts.items()}),
        FrozenMap({role: scope if role in scoped else None for role, _ in children}),
        identity,
    )


def _claims_scope(child: Any) -> bool:
    contract = child.optimizer_contract()
    return bool(contract.capabilities.supports(FEATURE_COLLECTIVE_SCOPE))

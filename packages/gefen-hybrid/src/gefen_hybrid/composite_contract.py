"""How a composite's contract is derived from its children's contracts.

* ``children`` and ``state_layout.composite_namespaces``: exactly the roles present, in
  order (a one-child composite lists one namespace; the reference always listed both).
* State layout: the composite's own top-level checkpoint keys, plus every per-parameter
  field its children declare (one declaration per key) and every child variant, renamed
  ``"<role>.<variant>"`` and tagged ``"gefen.role=<role>"``, so ``composite.state[p]`` can be
  matched against the composite's layout with the mode tags of ``state_mode_tags(p)``.
* Training claims: the union of the children's claims, each tagged with its role so a
  consumer can tell which role a claim belongs to (the reference lost that); flattened and
  whole-owner claims only when every child implements ``IdentityBindable`` (only
  ``post_sharding`` can bind such tensors).
* Checkpoint claims: ``COMPOSITE_NATIVE`` for the nested state dict, over the layouts every
  child's ``NATIVE_OPTIMIZER`` entries share; its load is ``LOCAL_FAIL_BEFORE_MUTATION``
  only if every child implements ``StagedNativeLoad`` and claims it, else ``NONE`` (the
  reason is the ``staged_native_load`` feature's). torch's ``get/set_optimizer_state_dict``
  recipe (``PYTORCH_RANK_LOCAL``) is claimed where every child claims it (the intersection of
  their entries): the composite's native state dict is torch-shaped and keyed by parameter, and
  a child that is bound (whose identity guard torch's helpers would drop) claims nothing. Other
  transports are claimed only for features the composite itself implements, as the
  intersection of the children's entries.
* Features: ``composite`` is supported; any other feature only if every child supports it
  and the composite implements its Protocol, or (``portable_state``) is served through its
  children: the caller lists those in ``implemented_features``. For the features served by
  the children's methods, ``staged_native_load``, ``portable_state`` and
  ``parameter_shaped_state``, every child must implement the Protocol too. Every negative says
  why, naming the child.
* Precisions: those every child accepts. Parameter ranks: any rank some child accepts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import reduce
from typing import Any

from gefen_contracts import (
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    STANDARD_FEATURES,
    CheckpointSupport,
    ContractError,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateVariant,
    TrainingSupport,
)
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.contract import OptimizerChildContract
from gefen_contracts.enums import CheckpointTransport, LoadAtomicity, ParameterLayout, ProcessGroupScope
from gefen_contracts.protocols import FEATURE_PROTOCOLS, IdentityBindable

from .composite_format import TOP_LEVEL_KEYS
from .roles import role_tag

__all__ = ["derive_composite_contract", "intersect_checkpoint_support"]

_ATOMICITY_ORDER = (LoadAtomicity.NONE, LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION, LoadAtomicity.GROUP_VOTED)
#: Transports a composite may claim when it implements the feature's Protocol itself.
_FEATURE_TRANSPORTS = {
    FEATURE_CANONICAL_LOCAL_STATE: CheckpointTransport.CANONICAL_LOCAL,
    FEATURE_PORTABLE_STATE: CheckpointTransport.CANONICAL_GLOBAL,
    FEATURE_PARAMETER_SHAPED_STATE: CheckpointTransport.PARAMETER_SHAPED,
}

#: Features the composite serves by calling its children's Protocol methods.
_DELEGATED_FEATURES = frozenset({FEATURE_STAGED_NATIVE_LOAD, FEATURE_PORTABLE_STATE, FEATURE_PARAMETER_SHAPED_STATE})

ChildEntry = tuple[str, Any, OptimizerContract]


def derive_composite_contract(
    implementation: str,
    children: Sequence[tuple[str, Any]],
    implemented_features: frozenset[str],
    *,
    own_blockers: Mapping[str, Sequence[str]] | None = None,
) -> OptimizerContract:
    """The contract of a composite named ``implementation`` over ``(role, child)`` pairs.

    ``implemented_features`` are the features whose Protocol the composite itself implements
    or serves through its children (``portable_state`` through a composite wrapper);
    ``own_blockers`` maps a feature to the composite's own reasons against it (for example
    "not finalized through the composite"), which make it negative whatever the children
    say. Raises :class:`~gefen_contracts.ContractError` when the children cannot be described
    together (a state key declared differently by two children, no common precision).
    """
    entries: list[ChildEntry] = [(role, child, child.optimizer_contract()) for role, child in children]
    features = _features(entries, implemented_features)
    for feature, reasons in (own_blockers or {}).items():
        if reasons:
            features[feature] = FeatureStatus.no(*reasons)
    shared = intersect_checkpoint_support(
        CheckpointTransport.COMPOSITE_NATIVE, [_of(c, CheckpointTransport.NATIVE_OPTIMIZER) for _, _, c in entries]
    )
    if not shared and features[FEATURE_STAGED_NATIVE_LOAD].supported:
        features[FEATURE_STAGED_NATIVE_LOAD] = FeatureStatus.no(
            "the children's native checkpoint claims share no parameter layout"
        )
    checkpoints = _capped(shared, features[FEATURE_STAGED_NATIVE_LOAD].supported)
    for feature, transport in _FEATURE_TRANSPORTS.items():
        if features[feature].supported:
            common = intersect_checkpoint_support(transport, [_of(c, transport) for _, _, c in entries])
            if not common:
                features[feature] = FeatureStatus.no(f"the children's {transport.value} claims share no layout")
            checkpoints += common
    recipe = CheckpointTransport.PYTORCH_RANK_LOCAL
    checkpoints += intersect_checkpoint_support(recipe, [_of(c, recipe) for _, _, c in entries])
    capabilities = OptimizerCapabilities(
        training=_training(entries, FEATURE_POST_SHARDING in implemented_features and _all_bindable(entries)),
        checkpoints=checkpoints,
        precisions=_precisions(entries),
        supported_parameter_ranks=_ranks(entries),
        features=features,
    )
    return OptimizerContract(
        implementation=implementation,
        state_layout=_state_layout(entries),
        capabilities=capabilities,
        children=tuple(OptimizerChildContract(role, c.implementation, c) for role, _, c in entries),
    )


# -- features ---------------------------------------------------------------------------------


def _features(entries: list[ChildEntry], implemented: frozenset[str]) -> dict[str, FeatureStatus]:
    features = {FEATURE_COMPOSITE: FeatureStatus.yes()}
    for feature in STANDARD_FEATURES:
        if feature == FEATURE_COMPOSITE:
            continue
        reasons: list[str] = []
        for role, child, contract in entries:
            status = contract.capabilities.feature(feature)
            who = f"child {role!r} ({contract.implementation})"
            if not status.supported:
                reasons.extend(f"{who}: {reason}" for reason in status.reasons)
            elif feature in _DELEGATED_FEATURES and not isinstance(child, FEATURE_PROTOCOLS[feature]):
                protocol = FEATURE_PROTOCOLS[feature].__name__
                reasons.append(f"{who} claims {feature} but does not implement {protocol}")
        if not reasons and feature not in implemented:
            protocol = FEATURE_PROTOCOLS[feature].__name__
            reasons.append(f"every child supports {feature}, but the composite does not implement {protocol} yet")
        features[feature] = FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()
    return features


# -- training, precisions, ranks ------------------------------------------------------------------


def _all_bindable(entries: list[ChildEntry]) -> bool:
    return all(isinstance(child, IdentityBindable) for _, child, _ in entries)


#: Layouts whose local tensors only ``post_sharding`` can bind.
_BOUND_LAYOUTS = frozenset({ParameterLayout.FLATTENED_ELEMENT_SHARD, ParameterLayout.WHOLE_PARAMETER_OWNER})


def _training(entries: list[ChildEntry], bindable: bool) -> tuple[TrainingSupport, ...]:
    claims: dict[TrainingSupport, None] = {}
    for role, _, contract in entries:
        for claim in contract.capabilities.training:
            if claim.layout in _BOUND_LAYOUTS and not bindable:
                continue  # unreachable: the composite cannot bind shard identity
            tagged = TrainingSupport(
                claim.layout,
                claim.process_group_scope,
                claim.mesh_dimensions,
                claim.mode_tags | {role_tag(role)},
                claim.requires_complete_parameter_storage,
                claim.requires_complete_logical_matrix,
                claim.requires_post_step_parameter_sync,
            )
            claims.setdefault(tagged, None)
    return tuple(claims)


def _precisions(entries: list[ChildEntry]) -> frozenset[Any]:
    common = reduce(lambda a, b: a & b, (c.capabilities.precisions for _, _, c in entries))
    if not common:
        names = ", ".join(f"{role!r}: {sorted(p.value for p in c.capabilities.precisions)}" for role, _, c in entries)
        raise ContractError(f"the children accept no common parameter precision ({names})")
    return common


def _ranks(entries: list[ChildEntry]) -> tuple[int, ...] | None:
    ranks: set[int] = set()
    for _, _, contract in entries:
        if contract.capabilities.supported_parameter_ranks is None:
            return None
        ranks.update(contract.capabilities.supported_parameter_ranks)
    return tuple(sorted(ranks))


# -- checkpoints ----------------------------------------------------------------------------------


def _of(contract: OptimizerContract, transport: CheckpointTransport) -> list[CheckpointSupport]:
    return [e for e in contract.capabilities.checkpoints if e.transport is transport]


def _capped(natives: tuple[CheckpointSupport, ...], staged: bool) -> tuple[CheckpointSupport, ...]:
    # The composite stages its children locally: at best LOCAL_FAIL_BEFORE_MUTATION, never voted.
    cap = LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION if staged else LoadAtomicity.NONE
    return tuple(replace(e, atomicity=min(e.atomicity, cap, key=_ATOMICITY_ORDER.index)) for e in natives)


def intersect_checkpoint_support(
    transport: CheckpointTransport, per_child: Sequence[Sequence[CheckpointSupport]]
) -> tuple[CheckpointSupport, ...]:
    """What every child's entries support together, relabelled ``transport``.

    Entries are intersected pairwise child by child: same-topology layouts and transitions
    (sources, targets and kinds) are intersected, mode tags united, mesh dimensions
    intersected, scopes merged (``NONE`` yields to the other; two different scopes become
    ``ADAPTER_DEFINED``), collectives required if any child requires them, and the weaker
    atomicity kept. Empty results are dropped; a layout is listed at most once.
    """
    if not per_child:
        return ()
    current = [replace(e, transport=transport) for e in per_child[0]]
    for entries in per_child[1:]:
        current = [m for a in current for b in entries if (m := _meet(transport, a, b)) is not None]
    claimed: set[Any] = set()
    result = []
    for entry in current:
        layouts = entry.same_topology - claimed
        if not layouts and not entry.transitions:
            continue
        claimed |= layouts
        result.append(replace(entry, same_topology=layouts))
    return tuple(result)


def _meet(transport: CheckpointTransport, a: CheckpointSupport, b: CheckpointSupport) -> CheckpointSupport | None:
    layouts = a.same_topology & b.same_topology
    transitions = tuple(t for x in a.transitions for y in b.transitions if (t := _meet_transition(x, y)) is not None)
    if not layouts and not transitions:
        return None
    mesh = _meet_mesh(a.mesh_dimensions, b.mesh_dimensions)
    if mesh == ():
        return None
    return CheckpointSupport(
        transport,
        layouts,
        _merge_scope(a.process_group_scope, b.process_group_scope),
        min(a.atomicity, b.atomicity, key=_ATOMICITY_ORDER.index),
        transitions,
        mesh,
        a.mode_tags | b.mode_tags,
        a.requires_collective or b.requires_collective,
    )


def _meet_transition(a: TopologyTransition, b: TopologyTransition) -> TopologyTransition | None:
    sources, targets, kinds = (
        a.source_layouts & b.source_layouts,
        a.target_layouts & b.target_layouts,
        a.kinds & b.kinds,
    )
    if not (sources and targets and kinds):
        return None
    return TopologyTransition(sources, targets, kinds)


def _meet_mesh(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if a is None:
        return b
    if b is None:
        return a
    return tuple(sorted(set(a) & set(b)))


def _merge_scope(a: ProcessGroupScope, b: ProcessGroupScope) -> ProcessGroupScope:
    if a is b or b is ProcessGroupScope.NONE:
        return a
    if a is ProcessGroupScope.NONE:
        return b
    return ProcessGroupScope.ADAPTER_DEFINED


# -- state layout ---------------------------------------------------------------------------------


def _own_fields() -> tuple[StateField, ...]:
    descriptions = {
        "format": "the composite state-dict format name",
        "format_version": "the composite state-dict format version",
        "child_implementations": "role -> implementation name of each present child",
        "routing": "sorted [fqn, role] pairs; a load must match the live routing",
    }
    return tuple(
        StateField(
            key,
            StateScope.CHECKPOINT_CARRIER,
            StateRole.TRANSPORT,
            StateGeometry.SCALAR if key in ("format", "format_version") else StateGeometry.OPAQUE,
            description=descriptions[key],
        )
        for key in TOP_LEVEL_KEYS
    )


def _merge_field(existing: StateField, new: StateField, owners: str, role: str) -> StateField:
    shape = ("scope", "role", "geometry", "key_match")
    if any(getattr(existing, attr) != getattr(new, attr) for attr in shape):
        raise ContractError(
            f"state field {new.name!r} is declared differently by {owners} and child {role!r} "
            f"({', '.join(f'{a}={getattr(existing, a).value}/{getattr(new, a).value}' for a in shape)}); "
            "a composite needs one declaration per state key"
        )
    description = existing.description if existing.description == new.description else ""
    return StateField(
        existing.name,
        existing.scope,
        existing.role,
        existing.geometry,
        existing.key_match,
        existing.optional or new.optional,
        existing.mode_tags & new.mode_tags,
        description or f"{owners}: {existing.description}; {role}: {new.description}",
    )


def _state_layout(entries: list[ChildEntry]) -> OptimizerStateLayout:
    fields: dict[str, StateField] = {f.name: f for f in _own_fields()}
    owners: dict[str, str] = {name: "the composite" for name in fields}
    variants: list[StateVariant] = []
    for role, _, contract in entries:
        for declared in contract.state_layout.fields:
            if declared.scope is StateScope.OPTIMIZER_COMMON:
                continue  # lives inside the child's namespace, described by the child's own contract
            if declared.name in fields:
                if owners[declared.name] == "the composite":
                    raise ContractError(f"child {role!r} declares {declared.name!r}, a composite top-level key")
                fields[declared.name] = _merge_field(fields[declared.name], declared, owners[declared.name], role)
                owners[declared.name] += f"/{role!r}"
            else:
                fields[declared.name] = declared
                owners[declared.name] = f"child {role!r}"
        variants.extend(_tagged_variant(role, v) for v in contract.state_layout.parameter_variants)
    return OptimizerStateLayout(
        fields=tuple(fields.values()),
        parameter_variants=tuple(variants),
        composite_namespaces=tuple(role for role, _, _ in entries),
    )


def _tagged_variant(role: str, variant: StateVariant) -> StateVariant:
    return StateVariant(
        f"{role}.{variant.name}",
        variant.fields,
        variant.layouts,
        variant.extent,
        variant.role,
        variant.initialized,
        variant.parameter_ranks,
        variant.excluded_parameter_ranks,
        variant.mode_tags | {role_tag(role)},
        variant.inactive_fields,
        variant.migration_only,
        variant.description,
    )

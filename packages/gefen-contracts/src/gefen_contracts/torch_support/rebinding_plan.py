"""Validate a post-sharding request against a torch optimizer's live slots.

Every optimizer that implements ``IdentityBindable`` needs the same request checks before it
stages anything; they live here once. :func:`plan_rebinding` reads the live param groups,
validates the rebindings, the manifest and the targets, and returns a tensor-carrying,
immutable :class:`RebindingPlan`. It never mutates anything. The optimizer then checks what
is algorithm-specific (pristine state, layouts it supports for which parameter ranks) and
stages its shadow from the plan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..enums import ParameterLayout
from ..errors import ContractError, ContractTypeError
from ..identity import LogicalSlice, ShardIdentity
from ..manifest import ShardingManifest
from ..rebinding import LogicalSlotBinding, ParameterRebinding
from .bindings import ProcessGroupBinding
from .tensors import is_dtensor, storage_overlap

__all__ = [
    "RebindingPlan",
    "SlotRebinding",
    "compatibility_names",
    "has_internal_overlap",
    "plan_rebinding",
    "publish_binding",
    "rebuilt_plan",
    "staged_groups",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: ``(group_index, slot_index, source) -> compatibility name`` (a str, ``""`` when the slot has none).
NameOf = Callable[[int, int, torch.Tensor], str]
#: ``(shard, target) -> None``; raises ContractError for a layout the optimizer does not support.
LayoutCheck = Callable[[ShardIdentity, "torch.Tensor | None"], None]


@dataclass(frozen=True, slots=True, eq=False)
class SlotRebinding:
    """One original slot: its position, source tensor, target (``None`` when pruned) and shard."""

    slot: LogicalSlotBinding
    source: torch.Tensor
    target: torch.Tensor | None


@dataclass(frozen=True, slots=True, eq=False)
class RebindingPlan:
    """A validated post-sharding request, in original ``(group, slot)`` order."""

    manifest: ShardingManifest
    entries: tuple[SlotRebinding, ...]
    scope: ProcessGroupBinding | None

    @property
    def slots(self) -> tuple[LogicalSlotBinding, ...]:
        return tuple(e.slot for e in self.entries)

    def group_params(self, group_count: int) -> list[list[torch.Tensor]]:
        """The new ``params`` list of every group (pruned slots omitted)."""
        groups: list[list[torch.Tensor]] = [[] for _ in range(group_count)]
        for entry in self.entries:
            if entry.target is not None:
                groups[entry.slot.group_index].append(entry.target)
        return groups

    def local_bindings(self) -> tuple[tuple[torch.Tensor | None, ShardIdentity], ...]:
        """``(tensor or None, shard)`` per slot, sorted by ``ShardIdentity.sort_key``."""
        pairs = [(e.target, e.slot.shard) for e in self.entries]
        return tuple(sorted(pairs, key=lambda pair: pair[1].sort_key))


def has_internal_overlap(tensor: torch.Tensor) -> bool:
    """True unless the strides provably address every element at a distinct offset.

    Sort the non-trivial dimensions by stride; each stride must be at least the span covered
    by the smaller dimensions (an ``expand``-ed tensor, stride 0, fails).
    """
    dims = sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            return True
        # elements reached through this dim and the smaller-stride ones: the next dim must step past them
        span = stride * (size - 1) + span
    return False


def _check_target(shard: ShardIdentity, target: object, index: int) -> None:
    where = f"rebindings[{index}] ({shard.fqn!r})"
    layout = shard.layout
    if target is None:
        if layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not shard.is_owner:
            return
        raise ContractError(f"{where}: new_parameter may be None only for a whole-parameter non-owner")
    if layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not shard.is_owner:
        raise ContractError(f"{where}: a whole-parameter non-owner must pass new_parameter=None (its slot is pruned)")
    if not isinstance(target, torch.Tensor):
        raise ContractTypeError(f"{where}: new_parameter must be a torch.Tensor, got {type(target).__name__}")
    if is_dtensor(target):
        raise ContractTypeError(f"{where}: new_parameter must be a plain local tensor, not a DTensor")
    if target.is_meta or target.layout is not torch.strided:
        raise ContractError(f"{where}: new_parameter must be a materialized strided tensor")
    if target.dtype not in _FLOAT_DTYPES:
        raise ContractError(f"{where}: new_parameter dtype {target.dtype} is not fp16, bf16, fp32 or fp64")
    # backward fills .grad only on leaves (or retains_grad tensors): a non-leaf target would never step
    if not target.is_leaf and not target.retains_grad:
        raise ContractError(f"{where}: new_parameter must be a leaf tensor")
    if target.grad is not None:
        raise RuntimeError(f"{where}: new_parameter must not carry a .grad while rebinding")
    if has_internal_overlap(target):
        raise ContractError(f"{where}: new_parameter overlaps itself (e.g. an expanded tensor)")
    extent = shard.extent
    assert type(extent) is LogicalSlice, "plan_rebinding accepts slice layouts only"
    if layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        if target.dim() != 1 or not target.is_contiguous():
            raise ContractError(f"{where}: a flattened_element_shard target must be a contiguous 1-D tensor")
        if target.numel() != extent.length:
            raise ContractError(f"{where}: target has {target.numel()} elements but the slice has {extent.length}")
    elif tuple(target.shape) != shard.parameter.global_shape:
        raise ContractError(
            f"{where}: a {layout.value} target must have the global shape {shard.parameter.global_shape}, "
            f"got {tuple(target.shape)}"
        )


def plan_rebinding(
    param_groups: Sequence[Mapping[str, Any]],
    rebindings: Sequence[ParameterRebinding],
    *,
    manifest: ShardingManifest,
    scope: object | None,
    name_of: NameOf,
    check_layout: LayoutCheck,
) -> RebindingPlan:
    """Validate a post-sharding request against the live ``param_groups`` (nothing mutated).

    Rules: ``manifest`` is a ``ShardingManifest`` and ``rebindings`` a non-empty sequence of
    ``ParameterRebinding``; exactly one rebinding per current slot, with unique source tensors
    (by identity) that each occupy exactly one slot; local FQNs unique and equal to the
    manifest's FQN set; every local shard an element of the manifest; one local member per
    process group; targets valid for their layout (see the module docstring of the
    Protocol), unique and storage-disjoint; no ``.grad`` on sources; ``check_layout``
    accepts every (shard, target); a ``scope`` binding matches every grouped shard's process
    group and local member and passes its runtime validation.
    """
    if type(manifest) is not ShardingManifest:
        raise ContractTypeError("post_sharding: manifest must be a ShardingManifest")
    if isinstance(rebindings, (str, bytes)) or not isinstance(rebindings, Sequence) or not rebindings:
        raise ContractTypeError("post_sharding: rebindings must be a non-empty sequence of ParameterRebinding")
    for index, rebinding in enumerate(rebindings):
        if type(rebinding) is not ParameterRebinding:
            raise ContractTypeError(f"post_sharding: rebindings[{index}] must be a ParameterRebinding")
    if scope is not None and not isinstance(scope, ProcessGroupBinding):
        raise ContractTypeError("post_sharding: scope must be a ProcessGroupBinding (or None)")
    slot_of: dict[int, tuple[int, int, torch.Tensor]] = {}
    for group_index, group in enumerate(param_groups):
        for slot_index, param in enumerate(group["params"]):
            # keyed by identity: tensors compare elementwise, and two slots may hold equal values
            slot_of[id(param)] = (group_index, slot_index, param)
    seen_sources: set[int] = set()
    by_slot: dict[tuple[int, int], tuple[int, ParameterRebinding]] = {}
    for index, rebinding in enumerate(rebindings):
        source = rebinding.old_parameter
        if id(source) in seen_sources:
            raise ContractError(f"post_sharding: rebindings[{index}] repeats a source tensor")
        seen_sources.add(id(source))
        found = slot_of.get(id(source))
        if found is None or found[2] is not source:
            raise ContractError(
                f"post_sharding: rebindings[{index}].old_parameter is not a parameter of this optimizer"
            )
        if isinstance(source, torch.Tensor) and source.grad is not None:
            raise RuntimeError(
                f"post_sharding: rebindings[{index}].old_parameter carries a .grad; clear gradients first"
            )
        by_slot[(found[0], found[1])] = (index, rebinding)
    missing = sorted(set((g, s) for g, s, _ in slot_of.values()) - set(by_slot))
    if missing:
        raise ContractError(f"post_sharding: every optimizer slot needs a rebinding; missing (group, slot) {missing}")
    fqns = [r.shard.fqn for r in rebindings]
    if len(set(fqns)) != len(fqns):
        raise ContractError("post_sharding: local FQNs must be unique")
    if set(fqns) != set(manifest.fqns):
        extra, absent = sorted(set(fqns) - set(manifest.fqns)), sorted(set(manifest.fqns) - set(fqns))
        raise ContractError(
            f"post_sharding: local FQNs must equal the manifest's (local only {extra}, manifest only {absent})"
        )
    manifest_shards = set(manifest.shards)
    members: dict[object, str | None] = {}
    for index, rebinding in enumerate(rebindings):
        shard = rebinding.shard
        if shard not in manifest_shards:
            raise ContractError(
                f"post_sharding: rebindings[{index}].shard ({shard.fqn!r}) is not an element of the manifest"
            )
        if type(shard.extent) is not LogicalSlice:
            raise ContractError(f"post_sharding: rebindings[{index}] layout {shard.layout.value} cannot be rebound")
        # the slot holds the whole logical parameter (or a flat view of it; a DTensor's numel is
        # its global one): a shard of another size means the rebindings were paired with the wrong slots
        source = rebinding.old_parameter
        if isinstance(source, torch.Tensor) and source.numel() != shard.parameter.numel:
            raise ContractError(
                f"post_sharding: rebindings[{index}] binds a slot of {source.numel()} elements {tuple(source.shape)} "
                f"to a shard of {shard.fqn!r}, whose parameter has {shard.parameter.numel} {shard.parameter.global_shape}"
            )
        pg_identity = shard.process_group
        if pg_identity is not None:
            previous = members.setdefault(pg_identity, shard.local_member)
            if previous != shard.local_member:
                raise ContractError(
                    f"post_sharding: local shards name two members ({previous!r}, {shard.local_member!r}) of "
                    f"process group {pg_identity.semantic_name!r}"
                )
        _check_target(shard, rebinding.new_parameter, index)
        check_layout(shard, rebinding.new_parameter)  # type: ignore[arg-type]
    targets = [(i, r.new_parameter) for i, r in enumerate(rebindings) if r.new_parameter is not None]
    seen_targets: dict[int, int] = {}
    for index, target in targets:
        if id(target) in seen_targets:
            raise ContractError(f"post_sharding: rebindings[{seen_targets[id(target)]}] and [{index}] share a target")
        seen_targets[id(target)] = index
        occupied = slot_of.get(id(target))
        source_slot = slot_of[id(rebindings[index].old_parameter)]
        # rebinding a slot to itself is allowed (replicated: the live tensor stays); stealing is not
        if occupied is not None and occupied[2] is target and occupied[:2] != source_slot[:2]:
            raise ContractError(f"post_sharding: rebindings[{index}] targets a tensor that occupies another slot")
    overlap = storage_overlap([(f"rebindings[{i}]", t) for i, t in targets])  # type: ignore[misc]
    if overlap:
        raise ContractError(f"post_sharding: targets {overlap}")
    if scope is not None:
        for shard in manifest.shards:
            if shard.process_group is not None and shard.process_group != scope.identity:
                raise ContractError(
                    f"post_sharding: shard of {shard.fqn!r} uses process group {shard.process_group.semantic_name!r} "
                    f"but the scope binding is {scope.identity.semantic_name!r}"
                )
        for rebinding in rebindings:
            member = rebinding.shard.local_member
            if member is not None and member != scope.local_member:
                raise ContractError(
                    f"post_sharding: local shard of {rebinding.shard.fqn!r} names member {member!r} but the scope "
                    f"binding is for {scope.local_member!r}"
                )
        # last: the only check that queries the process group (local queries, no collective)
        scope.validate_runtime()
    entries = []
    for (group_index, slot_index), (_, rebinding) in sorted(by_slot.items()):
        source = rebinding.old_parameter
        assert isinstance(source, torch.Tensor)
        name = name_of(group_index, slot_index, source)
        slot = LogicalSlotBinding(group_index, slot_index, name, rebinding.shard)
        target = rebinding.new_parameter
        entries.append(SlotRebinding(slot, source, target))  # type: ignore[arg-type]
    return RebindingPlan(manifest, tuple(entries), scope)


def compatibility_names(param_groups: Sequence[Mapping[str, Any]]) -> NameOf:
    """``name_of`` for :func:`plan_rebinding`: the group's ``param_names`` entry (case kept),
    or ``""`` for an unnamed group, so native checkpoints keep their names across binding."""

    def name_of(group_index: int, slot_index: int, source: torch.Tensor) -> str:
        names = param_groups[group_index].get("param_names")
        if names is None or slot_index >= len(names) or type(names[slot_index]) is not str:
            return ""
        return str(names[slot_index])

    return name_of


def staged_groups(param_groups: Sequence[Mapping[str, Any]], plan: RebindingPlan) -> tuple[dict[str, Any], ...]:
    """The group dicts a commit publishes: the same options, the new ``params`` (pruned slots
    omitted) and, for a named group, the kept slots' compatibility names. Touches nothing live."""
    kept = plan.group_params(len(param_groups))
    names: list[list[str]] = [[] for _ in param_groups]
    for entry in plan.entries:
        if entry.target is not None:
            names[entry.slot.group_index].append(entry.slot.compatibility_name)
    groups = []
    for index, group in enumerate(param_groups):
        staged = dict(group)
        staged["params"] = kept[index]
        if "param_names" in group:
            staged["param_names"] = names[index]
        groups.append(staged)
    return tuple(groups)


def publish_binding(optimizer: Any, groups: Sequence[Mapping[str, Any]]) -> None:
    """Swap staged group contents in (the live group dicts keep their identity, so schedulers
    holding them see the new ``params``) and start from empty per-parameter state, which a
    pristine optimizer has anyway. Cannot raise."""
    for live, new in zip(optimizer.param_groups, groups):
        live.clear()
        live.update(new)
    optimizer.state = defaultdict(dict)


def rebuilt_plan(
    param_groups: Sequence[Mapping[str, Any]],
    manifest: ShardingManifest,
    slots: Sequence[LogicalSlotBinding],
    scope: ProcessGroupBinding | None,
) -> RebindingPlan:
    """The plan of a copied optimizer (``copy.deepcopy`` and pickle keep tensors, not the plan):
    the k-th kept slot of group g is bound to the k-th parameter of the copied group g; a
    pruned non-owner slot keeps no tensor."""
    entries = []
    position = [0] * len(param_groups)
    for slot in slots:
        pruned = slot.shard.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not slot.shard.is_owner
        group = slot.group_index
        tensor = None if pruned else param_groups[group]["params"][position[group]]
        if not pruned:
            position[group] += 1
        entries.append(SlotRebinding(slot, tensor if tensor is not None else torch.empty(0), tensor))
    return RebindingPlan(manifest, tuple(entries), scope)

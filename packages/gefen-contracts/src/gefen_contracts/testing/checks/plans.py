"""Post-sharding requests the kit builds for any optimizer: replicated copies and flattened
member slices, plus the helpers to put rebound tensors into a model.

A single process can stand in for every member of a flattened layout: each member's
optimizer binds that member's slices, and :func:`gather_flat` / :func:`scatter_flat_grads`
move values and gradients between the members' shards and a full "driver" model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ...enums import ParameterLayout, PlacementKind
from ...identity import LogicalSlice, ParameterIdentity, ProcessGroupIdentity, ShardIdentity, ShardPlacement
from ...manifest import ShardingManifest
from ...rebinding import ParameterRebinding

__all__ = [
    "FLAT_GROUP",
    "ShardingPlan",
    "flat_slices",
    "flattened_plan",
    "gather_flat",
    "install_parameters",
    "replicated_copy_plan",
    "scatter_flat_grads",
]

#: The process group of the kit's simulated flattened layout (two members in one process).
FLAT_GROUP = ProcessGroupIdentity("kit.flat", ("member:0", "member:1"))

NamedParameters = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class ShardingPlan:
    """A post-sharding request: the rebindings, the global manifest and each FQN's new tensor."""

    rebindings: tuple[ParameterRebinding, ...]
    manifest: ShardingManifest
    targets: dict[str, torch.Tensor]

    def named_targets(self) -> list[tuple[str, torch.Tensor]]:
        """``(fqn, new tensor)`` in rebinding order: what a twin built directly on them receives."""
        return [(r.shard.fqn, r.new_parameter) for r in self.rebindings]  # type: ignore[misc]


def _copy(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone(), requires_grad=tensor.requires_grad)


def replicated_copy_plan(named: NamedParameters) -> ShardingPlan:
    """Rebind every parameter to an identical copy (ungrouped ``REPLICATED``, full slices)."""
    rebindings, shards = [], []
    targets: dict[str, torch.Tensor] = {}
    for name, parameter in named:
        identity = ParameterIdentity(name, tuple(parameter.shape))
        shard = ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity))
        target = _copy(parameter)
        rebindings.append(ParameterRebinding(parameter, target, shard))
        shards.append(shard)
        targets[name] = target
    return ShardingPlan(tuple(rebindings), ShardingManifest(tuple(shards)), targets)


def flat_slices(numel: int, members: int, *, whole_to_first: bool = False) -> list[tuple[int, int]]:
    """``(offset, length)`` of each member: near-even contiguous pieces in member order, or
    everything on member 0 (the others get empty pieces at the end) with ``whole_to_first``."""
    if whole_to_first:
        return [(0, numel)] + [(numel, 0)] * (members - 1)
    size = math.ceil(numel / members) if numel else 0
    pieces = []
    for member in range(members):
        start = min(numel, member * size)
        pieces.append((start, min(numel, start + size) - start))
    return pieces


def _flat_shards(
    name: str, shape: tuple[int, ...], group: ProcessGroupIdentity, whole_to_first: bool
) -> list[ShardIdentity]:
    identity = ParameterIdentity(name, shape)
    members = len(group.ordered_members)
    return [
        ShardIdentity(
            identity,
            ParameterLayout.FLATTENED_ELEMENT_SHARD,
            LogicalSlice(offset, length),
            (ShardPlacement("kit", PlacementKind.FLAT_SHARD, coordinate, members),),
            group,
            group.ordered_members[coordinate],
        )
        for coordinate, (offset, length) in enumerate(
            flat_slices(identity.numel, members, whole_to_first=whole_to_first)
        )
    ]


def flattened_plan(
    named: NamedParameters,
    member: int,
    *,
    group: ProcessGroupIdentity = FLAT_GROUP,
    whole_to_first: Iterable[str] = (),
    values: Mapping[str, torch.Tensor] | None = None,
) -> ShardingPlan:
    """Rebind every parameter to ``member``'s contiguous slice of its flattened elements.

    Slices are near-even (:func:`flat_slices`); parameters named in ``whole_to_first`` live
    entirely on member 0, so the other members hold empty shards of them. Targets are fresh
    1-D leaf parameters holding a copy of the slice of ``values[name]`` (default: the
    parameter itself).
    """
    whole = frozenset(whole_to_first)
    rebindings, shards = [], []
    targets: dict[str, torch.Tensor] = {}
    for name, parameter in named:
        pieces = _flat_shards(name, tuple(parameter.shape), group, name in whole)
        shards.extend(pieces)
        local = pieces[member]
        assert type(local.extent) is LogicalSlice
        source = parameter if values is None else values[name]
        flat = source.detach().reshape(-1)
        start, length = local.extent.flat_offset, local.extent.length
        target = nn.Parameter(flat[start : start + length].clone(), requires_grad=parameter.requires_grad)
        rebindings.append(ParameterRebinding(parameter, target, local))
        targets[name] = target
    return ShardingPlan(tuple(rebindings), ShardingManifest(tuple(shards)), targets)


def install_parameters(model: nn.Module, replacements: Mapping[int, torch.Tensor]) -> None:
    """Replace parameters of ``model`` (by the identity of the old tensor) with new ones,
    wherever they are registered (tied parameters included)."""
    for module in model.modules():
        for key, value in list(module._parameters.items()):
            if value is not None and id(value) in replacements:
                new = replacements[id(value)]
                module._parameters[key] = new if isinstance(new, nn.Parameter) else nn.Parameter(new)


def gather_flat(model: nn.Module, members: Sequence[ShardingPlan]) -> None:
    """Write every member's shard values into the full parameters of ``model`` (by FQN)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            flat = parameter.view(-1)
            for plan in members:
                rebinding = next(r for r in plan.rebindings if r.shard.fqn == name)
                extent = rebinding.shard.extent
                assert type(extent) is LogicalSlice
                flat[extent.flat_offset : extent.flat_offset + extent.length].copy_(plan.targets[name].detach())


def scatter_flat_grads(model: nn.Module, plan: ShardingPlan, tensors: Mapping[str, torch.Tensor]) -> None:
    """Give each tensor in ``tensors`` (by FQN) its slice of the full gradient in ``model``."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    for rebinding in plan.rebindings:
        name = rebinding.shard.fqn
        extent = rebinding.shard.extent
        assert type(extent) is LogicalSlice
        grad = grads[name]
        tensor = tensors[name]
        if grad is None:
            tensor.grad = None
            continue
        flat = grad.detach().reshape(-1)
        tensor.grad = flat[extent.flat_offset : extent.flat_offset + extent.length].clone()

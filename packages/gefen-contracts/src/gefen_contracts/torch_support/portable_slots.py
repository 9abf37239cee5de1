"""Which name, position and shard each slot of an optimizer travels under in portable state
(every optimizer of the convention that keeps one tensor per parameter slot, so Gefen,
GefenMuon and ContractedAdamW describe their layouts alike).

* **Before ``post_sharding``** the layout is *implicit*: one ungrouped ``REPLICATED`` shard
  per parameter, keyed by torch's own ``param_names`` (what ``Optimizer(model.named_parameters())``
  records). They must then exist for every parameter, be unique and be valid FQNs.
* **After ``post_sharding``** the optimizer's sealed layout (:class:`SealedLayout`) supplies
  the manifest, every slot's original ``(group, slot)`` position and compatibility name, and
  the shard of each bound tensor; pruned non-owner slots of a whole-parameter-owner layout are
  listed without a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..enums import ParameterLayout
from ..errors import StateValidationError
from ..exchange import PortableLayout, PortableSlotLayout
from ..identity import LogicalSlice, ParameterIdentity, ShardIdentity
from ..manifest import ShardingManifest
from ..naming import param_group_naming_blockers
from .sealed_layout import SealedLayout

__all__ = ["NamedSlot", "named_slots", "portable_layout_of"]


@dataclass(frozen=True, slots=True, eq=False)
class NamedSlot:
    """One slot: its original position, its live tensor (``None`` when pruned), its live
    position in the group's ``params`` (``None`` when pruned), the name it travels under,
    its native (compatibility) name and its bound shard (``None`` in the implicit layout)."""

    group_index: int
    slot_index: int
    live_index: int | None
    tensor: torch.Tensor | None
    fqn: str
    compatibility_name: str
    shard: ShardIdentity | None

    @property
    def position(self) -> tuple[int, int]:
        return (self.group_index, self.slot_index)


def named_slots(
    param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None, *, optimizer: str = "the optimizer"
) -> tuple[NamedSlot, ...]:
    """Every slot in original ``(group, slot)`` order (see the module docstring).

    Raises :class:`~gefen_contracts.StateValidationError` with the reasons of
    :func:`gefen_contracts.naming.param_group_naming_blockers` (naming ``optimizer``) when an
    optimizer without a sealed layout lacks usable names,
    or when the live groups no longer match the sealed layout.
    """
    if sealed is None:
        reasons = param_group_naming_blockers(param_groups, optimizer=optimizer)
        if reasons:
            raise StateValidationError("; ".join(reasons))
        return tuple(
            NamedSlot(g, k, k, tensor, str(group["param_names"][k]), str(group["param_names"][k]), None)
            for g, group in enumerate(param_groups)
            for k, tensor in enumerate(group["params"])
        )
    cursor = [0] * len(param_groups)
    slots = []
    for binding in sealed.slots:
        g = binding.group_index
        shard = binding.shard
        if shard.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not shard.is_owner:
            slots.append(
                NamedSlot(g, binding.original_slot_index, None, None, shard.fqn, binding.compatibility_name, shard)
            )
            continue
        params = param_groups[g]["params"] if g < len(param_groups) else []
        k = cursor[g] if g < len(cursor) else len(params)
        if k >= len(params):
            raise StateValidationError(f"the live param_groups[{g}] lost the tensor bound to {shard.fqn!r}")
        tensor = params[k]
        try:
            bound = sealed.shard_identity(tensor)
        except KeyError:
            bound = None
        if bound != shard:
            raise StateValidationError(f"param_groups[{g}]['params'][{k}] is not the tensor bound to {shard.fqn!r}")
        cursor[g] = k + 1
        slots.append(NamedSlot(g, binding.original_slot_index, k, tensor, shard.fqn, binding.compatibility_name, shard))
    return tuple(slots)


def _implicit_shard(name: str, tensor: torch.Tensor) -> ShardIdentity:
    """The ungrouped ``REPLICATED`` shard of a parameter of the implicit layout."""
    identity = ParameterIdentity(name, tuple(int(d) for d in tensor.shape))
    return ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity))


def portable_layout_of(
    param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None, implementation: str, *, optimizer: str
) -> PortableLayout:
    """The local target layout: the sealed one, or the implicit one (one ungrouped replicated
    shard per named parameter); no state, no tensors."""
    shards = []
    slots = []
    for slot in named_slots(param_groups, sealed, optimizer=optimizer):
        if slot.shard is not None:
            shard = slot.shard
        else:
            assert slot.tensor is not None  # only pruned slots lack a tensor, and they are sealed
            shard = _implicit_shard(slot.fqn, slot.tensor)
        shards.append(shard)
        slots.append(PortableSlotLayout(shard, slot.position, slot.compatibility_name))
    manifest = sealed.manifest if sealed is not None else ShardingManifest(tuple(shards))
    return PortableLayout(implementation, manifest, tuple(slots))

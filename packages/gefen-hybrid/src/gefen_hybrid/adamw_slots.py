"""Which name each ``ContractedAdamW`` slot travels under in portable state.

After ``post_sharding`` a slot's name is the canonical FQN of its sealed shard identity.
Before it, the optimizer is keyed by torch's own ``param_names`` (the names
``ContractedAdamW(model.named_parameters())`` records), which must then exist for every
parameter, be unique and be valid FQNs: that is what makes single-process portable export
works without ``post_sharding``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.naming import param_group_naming_blockers
from gefen_contracts.torch_support import SealedLayout

__all__ = ["NamedSlot", "find_slot", "named_slots", "naming_blockers"]


@dataclass(frozen=True, slots=True, eq=False)
class NamedSlot:
    """One live slot: its position, tensor, transport name, native name and (finalized) shard."""

    group_index: int
    slot_index: int
    tensor: torch.Tensor
    fqn: str
    compatibility_name: str
    shard: ShardIdentity | None


def naming_blockers(param_groups: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Why the parameters of an optimizer that is not finalized cannot be keyed by their names."""
    return param_group_naming_blockers(param_groups, optimizer="ContractedAdamW")


def named_slots(param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None) -> tuple[NamedSlot, ...]:
    """Every live slot in (group, slot) order, named as the module docstring says.

    ``StateValidationError`` (with the reasons of :func:`naming_blockers`) when an optimizer
    that is not finalized lacks usable names.
    """
    if sealed is None:
        reasons = naming_blockers(param_groups)
        if reasons:
            raise StateValidationError("; ".join(reasons))
    slots = []
    for g, group in enumerate(param_groups):
        names = sealed.compatibility_names(g) if sealed is not None else tuple(group["param_names"])
        for k, tensor in enumerate(group["params"]):
            shard = sealed.shard_identity(tensor) if sealed is not None else None
            fqn = shard.fqn if shard is not None else names[k]
            slots.append(NamedSlot(g, k, tensor, fqn, names[k], shard))
    return tuple(slots)


def find_slot(param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None, fqn: str) -> NamedSlot:
    """The live slot named ``fqn`` (``KeyError`` when there is none); a scan of names, no validation."""
    for g, group in enumerate(param_groups):
        if sealed is not None:
            for k, tensor in enumerate(group["params"]):
                shard = sealed.shard_identity(tensor)
                if shard.fqn == fqn:
                    return NamedSlot(g, k, tensor, fqn, sealed.compatibility_names(g)[k], shard)
            continue
        names = group.get("param_names")
        if names is not None and fqn in names:
            k = list(names).index(fqn)
            return NamedSlot(g, k, group["params"][k], fqn, fqn, None)
    raise KeyError(f"ContractedAdamW has no parameter named {fqn!r}")

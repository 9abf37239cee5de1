"""Rebinding requests and the tensor-free record of an optimizer slot."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ContractTypeError
from .identity import ShardIdentity
from .validation import exact_int, exact_str

__all__ = ["LogicalSlotBinding", "ParameterRebinding"]


@dataclass(frozen=True, slots=True, eq=False)
class ParameterRebinding:
    """Bind the optimizer slot now holding ``old_parameter`` to ``new_parameter``.

    ``new_parameter`` is the live local tensor (``None`` only for a non-owner piece of a
    whole-parameter-owner layout, whose slot is pruned). ``old is new`` attaches identity
    without changing storage. Equality is identity because the record holds tensors.
    """

    old_parameter: object
    new_parameter: object | None
    shard: ShardIdentity

    def __post_init__(self) -> None:
        if type(self.shard) is not ShardIdentity:
            raise ContractTypeError("ParameterRebinding.shard must be a ShardIdentity")
        if self.old_parameter is None:
            raise ContractTypeError("ParameterRebinding.old_parameter must be the tensor in the optimizer slot")


@dataclass(frozen=True, slots=True)
class LogicalSlotBinding:
    """One original optimizer slot after post-sharding, kept without tensors.

    Records the slot's ``(group_index, original_slot_index)`` position, its compatibility
    name (the name native checkpoints use; ``""`` when the slot has none) and its shard
    identity; pruned non-owner slots keep their position this way. The name is kept
    exactly as the optimizer gives it: torch's own ``param_names`` preserve case, and an
    optimizer with stricter naming rules (Gefen's lowercase legacy names) enforces them
    itself.
    """

    group_index: int
    original_slot_index: int
    compatibility_name: str
    shard: ShardIdentity

    def __post_init__(self) -> None:
        exact_int(self.group_index, "LogicalSlotBinding.group_index", minimum=0)
        exact_int(self.original_slot_index, "LogicalSlotBinding.original_slot_index", minimum=0)
        exact_str(self.compatibility_name, "LogicalSlotBinding.compatibility_name")
        if type(self.shard) is not ShardIdentity:
            raise ContractTypeError("LogicalSlotBinding.shard must be a ShardIdentity")

    @property
    def position(self) -> tuple[int, int]:
        return (self.group_index, self.original_slot_index)

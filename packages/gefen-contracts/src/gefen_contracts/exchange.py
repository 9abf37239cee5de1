"""Plain records exchanged through the portable-adapter Protocol.

They hold tensors as untyped ``object`` so this module stays torch-free. Mappings are
copied into :class:`~gefen_contracts.frozen.FrozenMap` so a record cannot change after it
was handed over (the tensors themselves are the producer's to keep unaliased).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import ContractError, ContractTypeError
from .frozen import FrozenMap, freeze_primitive
from .identity import ShardIdentity
from .manifest import ShardingManifest
from .validation import exact_int, exact_str, identity_name

__all__ = [
    "PortableExport",
    "PortableLayout",
    "PortableSlotLayout",
    "PortableSlotState",
]


def _counters(value: object, where: str) -> FrozenMap[int]:
    if not isinstance(value, Mapping):
        raise ContractTypeError(f"{where} must be a mapping of counter name -> int")
    for key, item in value.items():
        identity_name(key, f"{where} key")
        exact_int(item, f"{where}[{key!r}]", minimum=0)
    return FrozenMap(dict(value))


def _tensors(value: object, where: str) -> FrozenMap[object]:
    if not isinstance(value, Mapping):
        raise ContractTypeError(f"{where} must be a mapping of field name -> tensor")
    for key in value:
        identity_name(key, f"{where} key")
    return FrozenMap(dict(value))


def _options(value: object, where: str) -> FrozenMap[object]:
    if not isinstance(value, Mapping):
        raise ContractTypeError(f"{where} must be a mapping")
    frozen = freeze_primitive(dict(value), where)
    assert isinstance(frozen, FrozenMap)
    return frozen


def _position(value: object, where: str) -> tuple[int, int]:
    if type(value) is not tuple or len(value) != 2:
        raise ContractTypeError(f"{where} must be a (group_index, slot_index) tuple")
    exact_int(value[0], f"{where}[0]", minimum=0)
    exact_int(value[1], f"{where}[1]", minimum=0)
    return value


@dataclass(frozen=True, slots=True)
class PortableSlotLayout:
    """Where one local optimizer slot sits: its shard, original position and native name."""

    shard: ShardIdentity
    position: tuple[int, int]
    compatibility_name: str

    def __post_init__(self) -> None:
        if type(self.shard) is not ShardIdentity:
            raise ContractTypeError("PortableSlotLayout.shard must be a ShardIdentity")
        _position(self.position, "PortableSlotLayout.position")
        exact_str(self.compatibility_name, "PortableSlotLayout.compatibility_name")

    @property
    def fqn(self) -> str:
        return self.shard.fqn


@dataclass(frozen=True, slots=True)
class PortableLayout:
    """An optimizer's local target layout for a portable import (no state, no tensors)."""

    implementation: str
    manifest: ShardingManifest
    slots: tuple[PortableSlotLayout, ...]

    def __post_init__(self) -> None:
        identity_name(self.implementation, "PortableLayout.implementation")
        if type(self.manifest) is not ShardingManifest:
            raise ContractTypeError("PortableLayout.manifest must be a ShardingManifest")
        slots = tuple(self.slots)
        shards = frozenset(self.manifest.shards)
        for index, slot in enumerate(slots):
            if type(slot) is not PortableSlotLayout:
                raise ContractTypeError(f"PortableLayout.slots[{index}] must be a PortableSlotLayout")
            if slot.shard not in shards:
                raise ContractError(f"PortableLayout slot {slot.fqn!r} is not an element of the manifest")
        if len({s.fqn for s in slots}) != len(slots):
            raise ContractError("PortableLayout.slots must hold one slot per FQN")
        object.__setattr__(self, "slots", slots)


@dataclass(frozen=True, slots=True, eq=False)
class PortableSlotState:
    """One local slot's state in topology-neutral form.

    ``element_fields`` are tensors of any dtype the portable wire carries, shaped like this
    member's piece of the parameter (the full shape for replicated and owner pieces,
    ``(length,)`` for a flattened slice, the region's lengths for a DTensor piece); they
    are assembled and re-projected by shard identity, element by element.
    ``block_fields`` are compact fields that are constant on runs of
    ``block_period`` consecutive elements of the piece's row-major order (the last run may
    be shorter): each is 1-D with one value per run, ``ceil(numel / block_period)`` values.
    A quantised optimizer exports its codes as an element field and its block scales as
    block fields, so a document costs about one byte per element. **On import a block field
    arrives expanded** (an element field shaped like the target piece holding, for each
    element, the value of the source run it came from; the target's runs need not be the
    source's), **unless the target piece is exactly one exported fragment** (the same
    elements in the same order, as on the layout that exported it): then the block fields
    arrive as exported, with the fragment's ``block_period``, so the adapter can keep the
    source's blocks without expanding and re-blocking them.
    :func:`gefen_contracts.torch_support.as_imported` expands them for an adapter that wants
    the element form. ``replica_fields`` are small tensors that are not shard-addressable
    (for example factored statistics) and must be bit-identical on every replica, or
    present only on a whole-parameter owner. ``counters`` are exact ints.
    """

    layout: PortableSlotLayout
    options: Mapping[str, object]
    variant: str
    counters: Mapping[str, int] = field(default_factory=FrozenMap)
    element_fields: Mapping[str, object] = field(default_factory=FrozenMap)
    replica_fields: Mapping[str, object] = field(default_factory=FrozenMap)
    block_fields: Mapping[str, object] = field(default_factory=FrozenMap)
    block_period: int = 0

    def __post_init__(self) -> None:
        if type(self.layout) is not PortableSlotLayout:
            raise ContractTypeError("PortableSlotState.layout must be a PortableSlotLayout")
        object.__setattr__(self, "options", _options(self.options, "PortableSlotState.options"))
        identity_name(self.variant, "PortableSlotState.variant")
        object.__setattr__(self, "counters", _counters(self.counters, "PortableSlotState.counters"))
        object.__setattr__(self, "element_fields", _tensors(self.element_fields, "PortableSlotState.element_fields"))
        object.__setattr__(self, "replica_fields", _tensors(self.replica_fields, "PortableSlotState.replica_fields"))
        object.__setattr__(self, "block_fields", _tensors(self.block_fields, "PortableSlotState.block_fields"))
        exact_int(self.block_period, "PortableSlotState.block_period", minimum=0)
        if self.block_fields and self.block_period < 1:
            raise ContractError("PortableSlotState.block_period must be >= 1 when there are block fields")
        if not self.block_fields and self.block_period:
            raise ContractError("PortableSlotState.block_period must be 0 without block fields")
        names = [*self.element_fields, *self.replica_fields, *self.block_fields]
        clash = sorted({name for name in names if names.count(name) > 1})
        if clash:
            raise ContractError(f"PortableSlotState fields {clash} appear in more than one field kind")

    @property
    def fqn(self) -> str:
        return self.layout.fqn


@dataclass(frozen=True, slots=True, eq=False)
class PortableExport:
    """Everything one member contributes to a portable export.

    ``policy`` (primitive) and ``common`` (primitive values and small tensors) must be
    identical on every member; ``slots`` are this member's local slots in original order.
    """

    implementation: str
    policy: Mapping[str, object]
    common: Mapping[str, object]
    manifest: ShardingManifest
    slots: tuple[PortableSlotState, ...]

    def __post_init__(self) -> None:
        identity_name(self.implementation, "PortableExport.implementation")
        object.__setattr__(self, "policy", _options(self.policy, "PortableExport.policy"))
        if not isinstance(self.common, Mapping):
            raise ContractTypeError("PortableExport.common must be a mapping")
        for key in self.common:
            identity_name(key, "PortableExport.common key")
        object.__setattr__(self, "common", FrozenMap(dict(self.common)))
        if type(self.manifest) is not ShardingManifest:
            raise ContractTypeError("PortableExport.manifest must be a ShardingManifest")
        slots = tuple(self.slots)
        for index, slot in enumerate(slots):
            if type(slot) is not PortableSlotState:
                raise ContractTypeError(f"PortableExport.slots[{index}] must be a PortableSlotState")
        object.__setattr__(self, "slots", slots)

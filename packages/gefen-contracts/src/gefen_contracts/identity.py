"""Identity descriptors: which logical parameter, which process group, which piece.

All descriptors are frozen, slotted dataclasses validated once at construction with exact
types. Runtime ranks never appear: process-group members are adapter-chosen stable strings
and ``ordered_members`` order is the group coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .enums import ParameterLayout, PlacementKind
from .errors import ContractError, ContractTypeError
from .validation import exact_enum, exact_int, identity_name, int_tuple, str_tuple

__all__ = [
    "IDENTITY_SCHEMA_VERSION",
    "LogicalExtent",
    "LogicalRegion",
    "LogicalSlice",
    "ParameterIdentity",
    "ProcessGroupIdentity",
    "ShardIdentity",
    "ShardPlacement",
]

IDENTITY_SCHEMA_VERSION = 1


def _schema(value: object, owner: str) -> None:
    exact_int(value, f"{owner}.schema_version")
    if value != IDENTITY_SCHEMA_VERSION:
        raise ContractError(
            f"{owner}.schema_version {value} is unsupported (this library reads {IDENTITY_SCHEMA_VERSION})"
        )


def _shape(value: object, field_name: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, bytearray)):
        raise ContractTypeError(f"{field_name} must be a sequence of ints, not {type(value).__name__}")
    return int_tuple(value, field_name, minimum=0)


@dataclass(frozen=True, slots=True)
class ParameterIdentity:
    """A logical parameter: its canonical fully-qualified name and global shape.

    ``fqn`` is case-sensitive, dot-separated with non-empty components, trimmed, NUL-free.
    ``global_shape`` is the shape of the complete logical parameter (``()`` for a scalar).
    """

    fqn: str
    global_shape: tuple[int, ...]
    schema_version: int = IDENTITY_SCHEMA_VERSION

    def __post_init__(self) -> None:
        fqn = identity_name(self.fqn, "ParameterIdentity.fqn")
        if any(not part for part in fqn.split(".")):
            raise ContractError(f"ParameterIdentity.fqn {fqn!r} must not have empty dot components")
        object.__setattr__(self, "global_shape", _shape(self.global_shape, "ParameterIdentity.global_shape"))
        _schema(self.schema_version, "ParameterIdentity")

    @property
    def numel(self) -> int:
        """Number of elements of the complete parameter."""
        return math.prod(self.global_shape)


@dataclass(frozen=True, slots=True)
class ProcessGroupIdentity:
    """A process group named by meaning, with its members in coordinate order."""

    semantic_name: str
    ordered_members: tuple[str, ...]
    schema_version: int = IDENTITY_SCHEMA_VERSION

    def __post_init__(self) -> None:
        identity_name(self.semantic_name, "ProcessGroupIdentity.semantic_name")
        members = str_tuple(self.ordered_members, "ProcessGroupIdentity.ordered_members", unique=True, names=True)
        if not members:
            raise ContractError("ProcessGroupIdentity.ordered_members must not be empty")
        object.__setattr__(self, "ordered_members", members)
        _schema(self.schema_version, "ProcessGroupIdentity")

    def coordinate(self, member: str) -> int:
        """The index of ``member`` (``ContractError`` if it is not a member)."""
        try:
            return self.ordered_members.index(member)
        except ValueError:
            raise ContractError(f"{member!r} is not a member of process group {self.semantic_name!r}") from None


@dataclass(frozen=True, slots=True)
class ShardPlacement:
    """Placement of a shard along one mesh axis."""

    mesh_axis: str
    kind: PlacementKind
    coordinate: int
    parts: int
    parameter_dimension: int | None = None

    def __post_init__(self) -> None:
        identity_name(self.mesh_axis, "ShardPlacement.mesh_axis")
        exact_enum(self.kind, PlacementKind, "ShardPlacement.kind")
        exact_int(self.parts, "ShardPlacement.parts", minimum=1)
        exact_int(self.coordinate, "ShardPlacement.coordinate", minimum=0, maximum=self.parts - 1)
        if self.kind is PlacementKind.DIMENSION_SHARD:
            if self.parameter_dimension is None:
                raise ContractError("ShardPlacement.parameter_dimension is required for a dimension_shard")
            exact_int(self.parameter_dimension, "ShardPlacement.parameter_dimension", minimum=0)
        elif self.parameter_dimension is not None:
            raise ContractError(f"ShardPlacement.parameter_dimension must be None for a {self.kind.value} placement")

    @property
    def topology_key(self) -> tuple[str, str, int, int]:
        """What every member of a group must agree on (everything but the coordinate)."""
        dim = -1 if self.parameter_dimension is None else self.parameter_dimension
        return (self.mesh_axis, self.kind.value, self.parts, dim)


@dataclass(frozen=True, slots=True)
class LogicalSlice:
    """A contiguous range ``[flat_offset, flat_offset + length)`` of the row-major flattened parameter."""

    flat_offset: int
    length: int

    def __post_init__(self) -> None:
        exact_int(self.flat_offset, "LogicalSlice.flat_offset", minimum=0)
        exact_int(self.length, "LogicalSlice.length", minimum=0)

    @classmethod
    def full(cls, parameter: ParameterIdentity) -> LogicalSlice:
        """The slice covering all of ``parameter``."""
        if type(parameter) is not ParameterIdentity:
            raise ContractTypeError("LogicalSlice.full needs a ParameterIdentity")
        return cls(0, parameter.numel)

    @property
    def end(self) -> int:
        return self.flat_offset + self.length

    @property
    def numel(self) -> int:
        return self.length


@dataclass(frozen=True, slots=True)
class LogicalRegion:
    """An axis-aligned box of the logical parameter (used by the DTensor layout)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = _shape(self.offsets, "LogicalRegion.offsets")
        lengths = _shape(self.lengths, "LogicalRegion.lengths")
        if len(offsets) != len(lengths):
            raise ContractError("LogicalRegion.offsets and LogicalRegion.lengths must have the same rank")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def full(cls, parameter: ParameterIdentity) -> LogicalRegion:
        """The region covering all of ``parameter``."""
        if type(parameter) is not ParameterIdentity:
            raise ContractTypeError("LogicalRegion.full needs a ParameterIdentity")
        return cls((0,) * len(parameter.global_shape), parameter.global_shape)

    @property
    def rank(self) -> int:
        return len(self.offsets)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def flat_origin(self, shape: tuple[int, ...]) -> int:
        """Row-major flat index of the region's origin inside ``shape``."""
        index = 0
        for offset, dim in zip(self.offsets, shape, strict=True):
            index = index * dim + offset
        return index

    def validate_bounds(self, parameter: ParameterIdentity) -> None:
        """Raise ``ContractError`` unless the region lies inside ``parameter``."""
        if self.rank != len(parameter.global_shape):
            raise ContractError(
                f"LogicalRegion rank {self.rank} does not match parameter {parameter.fqn!r} rank "
                f"{len(parameter.global_shape)}"
            )
        for axis, (offset, length, dim) in enumerate(zip(self.offsets, self.lengths, parameter.global_shape)):
            if offset + length > dim:
                raise ContractError(
                    f"LogicalRegion axis {axis} [{offset}, {offset + length}) exceeds dimension {dim} of "
                    f"{parameter.fqn!r}"
                )

    def intersection(self, other: LogicalRegion) -> LogicalRegion:
        """The overlap of two regions of equal rank (empty lengths when disjoint)."""
        if self.rank != other.rank:
            raise ContractError("LogicalRegion.intersection needs regions of equal rank")
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(
            min(a + la, b + lb) for a, la, b, lb in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )
        return LogicalRegion(starts, tuple(max(0, e - s) for s, e in zip(starts, ends)))

    def overlaps(self, other: LogicalRegion) -> bool:
        return self.intersection(other).numel > 0


LogicalExtent = LogicalSlice | LogicalRegion

_REGION_LAYOUTS = frozenset({ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})


@dataclass(frozen=True, slots=True)
class ShardIdentity:
    """The stable identity of one member's piece of one logical parameter.

    ``extent`` is a :class:`LogicalRegion` for the DTensor layout and a :class:`LogicalSlice`
    otherwise (the reference called this field ``logical_slice``; that name remains as a
    read-only alias). ``placements`` are stored sorted by mesh axis.
    """

    parameter: ParameterIdentity
    layout: ParameterLayout
    extent: LogicalExtent
    placements: tuple[ShardPlacement, ...] = ()
    process_group: ProcessGroupIdentity | None = None
    local_member: str | None = None
    owner: str | None = None
    schema_version: int = IDENTITY_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if type(self.parameter) is not ParameterIdentity:
            raise ContractTypeError("ShardIdentity.parameter must be a ParameterIdentity")
        exact_enum(self.layout, ParameterLayout, "ShardIdentity.layout")
        parameter = self.parameter
        if self.layout in _REGION_LAYOUTS:
            if type(self.extent) is not LogicalRegion:
                raise ContractTypeError(f"ShardIdentity.extent must be a logical-region for layout {self.layout.value}")
            self.extent.validate_bounds(parameter)
        else:
            if type(self.extent) is not LogicalSlice:
                raise ContractTypeError(f"ShardIdentity.extent must be a LogicalSlice for layout {self.layout.value}")
            if self.extent.end > parameter.numel:
                raise ContractError(
                    f"ShardIdentity slice [{self.extent.flat_offset}, {self.extent.end}) exceeds numel "
                    f"{parameter.numel} of {parameter.fqn!r}"
                )
        placements = tuple(_placements(self.placements))
        object.__setattr__(self, "placements", tuple(sorted(placements, key=lambda p: p.mesh_axis)))
        self._check_group()
        for placement in self.placements:
            dim = placement.parameter_dimension
            if dim is not None and dim >= len(parameter.global_shape):
                raise ContractError(
                    f"ShardPlacement.parameter_dimension {dim} out of range for {parameter.fqn!r} of rank "
                    f"{len(parameter.global_shape)}"
                )
        _LAYOUT_RULES[self.layout](self)
        _schema(self.schema_version, "ShardIdentity")

    def _check_group(self) -> None:
        group = self.process_group
        if group is None:
            if self.local_member is not None or self.owner is not None:
                raise ContractError("ShardIdentity without a process_group must not name local_member or owner")
            return
        if type(group) is not ProcessGroupIdentity:
            raise ContractTypeError("ShardIdentity.process_group must be a ProcessGroupIdentity or None")
        if self.local_member is None:
            raise ContractError("ShardIdentity.local_member is required with a process_group")
        identity_name(self.local_member, "ShardIdentity.local_member")
        coordinate = group.coordinate(self.local_member)
        if self.owner is not None:
            identity_name(self.owner, "ShardIdentity.owner")
            group.coordinate(self.owner)
        for placement in self.placements:
            if placement.parts != len(group.ordered_members):
                raise ContractError(
                    f"ShardPlacement {placement.mesh_axis!r} has {placement.parts} parts but the process group has "
                    f"{len(group.ordered_members)} members"
                )
            if placement.coordinate != coordinate:
                raise ContractError(
                    f"ShardPlacement {placement.mesh_axis!r} coordinate {placement.coordinate} does not match "
                    f"local_member {self.local_member!r} at coordinate {coordinate}"
                )

    @property
    def logical_slice(self) -> LogicalExtent:
        """Alias of :attr:`extent` kept for users of the reference's field name."""
        return self.extent

    @property
    def logical_region(self) -> LogicalRegion | None:
        return self.extent if type(self.extent) is LogicalRegion else None

    @property
    def fqn(self) -> str:
        return self.parameter.fqn

    @property
    def local_numel(self) -> int:
        """Number of logical elements this member holds."""
        return self.extent.numel

    @property
    def member_index(self) -> int:
        """Coordinate of ``local_member`` (-1 when ungrouped)."""
        if self.process_group is None or self.local_member is None:
            return -1
        return self.process_group.coordinate(self.local_member)

    @property
    def is_owner(self) -> bool:
        """True unless this is a non-owner piece of a whole-parameter-owner layout."""
        return self.owner is None or self.owner == self.local_member

    @property
    def sort_key(self) -> tuple[object, ...]:
        """Deterministic total order used by manifests (slices and regions share one form).

        ``(fqn, flat_start, numel, layout, group name or "", member index or -1,
        owner index or -1, placement keys, region offsets or (), region lengths or ())``.
        """
        group = self.process_group
        owner_index = -1 if (group is None or self.owner is None) else group.coordinate(self.owner)
        placement_key = tuple(
            (
                p.mesh_axis,
                p.kind.value,
                p.coordinate,
                p.parts,
                -1 if p.parameter_dimension is None else p.parameter_dimension,
            )
            for p in self.placements
        )
        extent = self.extent
        if type(extent) is LogicalRegion:
            start = extent.flat_origin(self.parameter.global_shape)
            offsets, lengths = extent.offsets, extent.lengths
        else:
            assert type(extent) is LogicalSlice
            start, offsets, lengths = extent.flat_offset, (), ()
        return (
            self.parameter.fqn,
            start,
            extent.numel,
            self.layout.value,
            "" if group is None else group.semantic_name,
            self.member_index,
            owner_index,
            placement_key,
            offsets,
            lengths,
        )


def _placements(value: object) -> tuple[ShardPlacement, ...]:
    if isinstance(value, (str, bytes, bytearray, dict)) or not isinstance(value, Iterable):
        raise ContractTypeError("ShardIdentity.placements must be a sequence of ShardPlacement")
    items = tuple(value)
    axes: set[str] = set()
    for index, item in enumerate(items):
        if type(item) is not ShardPlacement:
            raise ContractTypeError(f"ShardIdentity.placements[{index}] must be a ShardPlacement")
        if item.mesh_axis in axes:
            raise ContractError(f"ShardIdentity.placements repeat mesh axis {item.mesh_axis!r}")
        axes.add(item.mesh_axis)
    return items


def _kinds(shard: ShardIdentity) -> tuple[PlacementKind, ...]:
    return tuple(p.kind for p in shard.placements)


def _replicated(shard: ShardIdentity) -> None:
    if shard.owner is not None:
        raise ContractError("a replicated shard has no owner")
    expected = 0 if shard.process_group is None else 1
    if len(shard.placements) != expected or any(k is not PlacementKind.REPLICATE for k in _kinds(shard)):
        raise ContractError(
            "a replicated shard has no placement when ungrouped and exactly one replicate placement when grouped"
        )
    if shard.extent != LogicalSlice.full(shard.parameter):
        raise ContractError(f"a replicated shard of {shard.fqn!r} must cover the full parameter")


def _flattened(shard: ShardIdentity) -> None:
    if shard.process_group is None:
        raise ContractError("a flattened_element_shard needs a process_group")
    if shard.owner is not None:
        raise ContractError("a flattened_element_shard has no owner")
    if _kinds(shard) != (PlacementKind.FLAT_SHARD,):
        raise ContractError("a flattened_element_shard needs exactly one flat_shard placement")


def _whole_owner(shard: ShardIdentity) -> None:
    if shard.process_group is None or shard.owner is None:
        raise ContractError("a whole_parameter_owner shard needs a process_group and an owner")
    if _kinds(shard) != (PlacementKind.WHOLE_PARAMETER_OWNER,):
        raise ContractError("a whole_parameter_owner shard needs exactly one whole_parameter_owner placement")
    expected = LogicalSlice.full(shard.parameter) if shard.owner == shard.local_member else LogicalSlice(0, 0)
    if shard.extent != expected:
        raise ContractError(
            f"a whole_parameter_owner shard covers the full parameter on the owner and LogicalSlice(0, 0) "
            f"elsewhere; {shard.local_member!r} has {shard.extent}"
        )


def _dtensor(shard: ShardIdentity) -> None:
    if shard.process_group is None:
        raise ContractError("a dtensor_1d_default_world shard needs a process_group")
    if shard.owner is not None:
        raise ContractError("a dtensor_1d_default_world shard has no owner")
    if len(shard.placements) != 1:
        raise ContractError("a dtensor_1d_default_world shard needs exactly one placement")
    placement = shard.placements[0]
    region = shard.extent
    assert type(region) is LogicalRegion
    shape = shard.parameter.global_shape
    if placement.kind is PlacementKind.REPLICATE:
        if region != LogicalRegion.full(shard.parameter):
            raise ContractError(f"a replicate DTensor shard of {shard.fqn!r} must cover the full region")
    elif placement.kind is PlacementKind.DIMENSION_SHARD:
        dim = placement.parameter_dimension
        for axis, (offset, length, size) in enumerate(zip(region.offsets, region.lengths, shape)):
            if axis != dim and (offset != 0 or length != size):
                raise ContractError(
                    f"a DTensor shard of {shard.fqn!r} along dimension {dim} must span axis {axis} fully"
                )
    else:
        raise ContractError("a dtensor_1d_default_world placement must be replicate or dimension_shard")


_LAYOUT_RULES = {
    ParameterLayout.REPLICATED: _replicated,
    ParameterLayout.FLATTENED_ELEMENT_SHARD: _flattened,
    ParameterLayout.WHOLE_PARAMETER_OWNER: _whole_owner,
    ParameterLayout.DTENSOR_1D_DEFAULT_WORLD: _dtensor,
}

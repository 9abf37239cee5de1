"""``ShardingManifest``: the complete, deterministic, global identity set of a layout.

Coverage rule (one rule for flattened slices and DTensor dimension shards): along the
sharded axis (the flattened element index, or the DTensor's ``parameter_dimension``),
the non-empty pieces sorted by start must tile ``[0, extent)`` exactly, with no gap and
no overlap; an empty piece must sit on a partition boundary (0 or the end of a non-empty
piece). Member order does not matter for either layout. The reference required
coordinate order for DTensor regions only; we decided once, for both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .enums import ParameterLayout, PlacementKind
from .errors import ContractError, ContractTypeError
from .identity import IDENTITY_SCHEMA_VERSION, LogicalRegion, LogicalSlice, ShardIdentity, _schema

__all__ = ["ShardingManifest"]


@dataclass(frozen=True, slots=True)
class ShardingManifest:
    """Every shard of every logical parameter of a layout, sorted by ``ShardIdentity.sort_key``.

    Per FQN: one ``ParameterIdentity``, one layout, one process group; ungrouped
    parameters have exactly one shard, grouped ones exactly one shard per member; all
    members agree on the placement topology; extents cover the parameter as the layout
    requires (see the module docstring).
    """

    shards: tuple[ShardIdentity, ...]
    schema_version: int = IDENTITY_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if isinstance(self.shards, (str, bytes, dict)) or not isinstance(self.shards, Iterable):
            raise ContractTypeError("ShardingManifest.shards must be a sequence of ShardIdentity")
        shards = tuple(self.shards)
        if not shards:
            raise ContractError("ShardingManifest.shards must not be empty")
        for index, shard in enumerate(shards):
            if type(shard) is not ShardIdentity:
                raise ContractTypeError(f"ShardingManifest.shards[{index}] must be a ShardIdentity")
        if len(set(shards)) != len(shards):
            raise ContractError("ShardingManifest.shards contains duplicate shards")
        # canonical order: every member that builds the same layout gets an equal manifest (and digest)
        ordered = tuple(sorted(shards, key=lambda s: s.sort_key))
        object.__setattr__(self, "shards", ordered)
        _schema(self.schema_version, "ShardingManifest")
        by_fqn: dict[str, list[ShardIdentity]] = {}
        for shard in ordered:
            by_fqn.setdefault(shard.fqn, []).append(shard)
        for fqn, group in by_fqn.items():
            _check_parameter(fqn, group)

    def for_parameter(self, fqn: str) -> tuple[ShardIdentity, ...]:
        """The shards of ``fqn`` in manifest order (``()`` when absent)."""
        return tuple(s for s in self.shards if s.fqn == fqn)

    @property
    def fqns(self) -> tuple[str, ...]:
        """Sorted FQNs of every parameter in the manifest."""
        return tuple(sorted({s.fqn for s in self.shards}))

    def for_member(self, member: str | None) -> tuple[ShardIdentity, ...]:
        """The shards held by ``member`` (``None``: the ungrouped shards), in manifest order."""
        return tuple(s for s in self.shards if s.local_member == member)

    def restricted_to(self, fqns: Iterable[str]) -> ShardingManifest:
        """A manifest holding only the parameters named in ``fqns`` (each must be present)."""
        wanted = set(fqns)
        missing = wanted - set(self.fqns)
        if missing:
            raise ContractError(f"ShardingManifest has no parameters {sorted(missing)}")
        return ShardingManifest(tuple(s for s in self.shards if s.fqn in wanted))


def _check_parameter(fqn: str, shards: list[ShardIdentity]) -> None:
    first = shards[0]
    for shard in shards[1:]:
        if shard.parameter != first.parameter:
            raise ContractError(f"manifest shards of {fqn!r} disagree on the ParameterIdentity")
        if shard.layout is not first.layout:
            raise ContractError(f"manifest shards of {fqn!r} mix layouts {first.layout.value} and {shard.layout.value}")
        if shard.process_group != first.process_group:
            raise ContractError(f"manifest shards of {fqn!r} use different process groups")
    group = first.process_group
    if group is None:
        if len(shards) != 1:
            raise ContractError(f"an ungrouped parameter {fqn!r} must have exactly one shard, got {len(shards)}")
    else:
        members = [s.local_member for s in shards]
        # key=str: a shard without a member (None) must not break the sort; it then fails the equality
        if sorted(members, key=str) != sorted(group.ordered_members):
            missing = sorted(set(group.ordered_members) - set(m for m in members if m is not None))
            raise ContractError(
                f"manifest shards of {fqn!r} must list each member of {group.semantic_name!r} exactly once; "
                f"missing {missing}, got {members}"
            )
        # the coordinates differ per member; the split itself (axis, kind, parts, dimension) must not
        topology = {tuple(p.topology_key for p in s.placements) for s in shards}
        if len(topology) != 1:
            raise ContractError(f"manifest shards of {fqn!r} disagree on the placement topology")
    layout = first.layout
    numel = first.parameter.numel
    if layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        # flattened slices tile the row-major element index of the whole parameter
        pieces = [(s.extent.flat_offset, s.extent.length) for s in shards if type(s.extent) is LogicalSlice]
        _check_tiling(fqn, pieces, numel, "flattened slices")
    elif layout is ParameterLayout.WHOLE_PARAMETER_OWNER:
        owners = {s.owner for s in shards}
        if len(owners) != 1:
            raise ContractError(f"whole_parameter_owner shards of {fqn!r} disagree on the owner")
    elif layout is ParameterLayout.DTENSOR_1D_DEFAULT_WORLD:
        placement = first.placements[0]
        if placement.kind is PlacementKind.DIMENSION_SHARD:
            dim = placement.parameter_dimension
            assert dim is not None
            pieces = []
            for s in shards:
                region = s.extent
                assert type(region) is LogicalRegion
                # only the sharded dimension is partitioned; the region spans every other dimension whole
                pieces.append((region.offsets[dim], region.lengths[dim]))
            _check_tiling(fqn, pieces, first.parameter.global_shape[dim], f"regions along dimension {dim}")


def _check_tiling(fqn: str, pieces: list[tuple[int, int]], extent: int, what: str) -> None:
    nonempty = sorted((start, length) for start, length in pieces if length > 0)
    cursor = 0
    # an empty piece (a member holding nothing) may sit at 0 or where a non-empty piece ends
    boundaries = {0}
    for start, length in nonempty:
        if start < cursor:
            raise ContractError(f"{what} of {fqn!r} overlap at {start} (covered up to {cursor})")
        if start > cursor:
            raise ContractError(f"{what} of {fqn!r} leave a gap [{cursor}, {start})")
        cursor = start + length
        boundaries.add(cursor)
    if cursor != extent:
        raise ContractError(f"{what} of {fqn!r} cover [0, {cursor}) but the extent is {extent}")
    for start, length in pieces:
        if length == 0 and start not in boundaries:
            raise ContractError(f"an empty piece of {fqn!r} at {start} is not on a partition boundary")

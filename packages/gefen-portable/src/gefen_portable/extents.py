"""Where a member's piece sits inside a logical parameter, as runs of the row-major flat index.

Every extent (a :class:`~gefen_contracts.identity.LogicalSlice` of the flattened parameter or a
:class:`~gefen_contracts.identity.LogicalRegion` box) is reduced to sorted *runs*
``(global_start, length, local_start)``: contiguous ranges of the flat parameter and where
they sit in the piece's own row-major tensor. Assembly and projection are then one
operation, :func:`copy_overlap`, for every pair of layouts (slice to slice, slice to region,
region to region), and one tiling rule checks that fragments cover a parameter exactly once.

Piece shapes (what an element field of one member's piece looks like):

=======================================  ===========================================
shard                                    piece shape
=======================================  ===========================================
replicated                               the global shape
flattened_element_shard                  ``(length,)``
whole_parameter_owner, the owner         the global shape
whole_parameter_owner, a non-owner       no piece (``None``)
dtensor_1d_default_world                 the region's lengths
=======================================  ===========================================
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import torch
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.errors import ContractError
from gefen_contracts.identity import LogicalRegion, LogicalSlice, ParameterIdentity, ShardIdentity

from .errors import PortableStateError

__all__ = [
    "Extent",
    "Run",
    "carries_payload",
    "copy_overlap",
    "covers_parameter",
    "extent_runs",
    "fragment_extent",
    "fragment_shape",
    "overlaps",
    "piece_shape",
    "validate_tiling",
]

Extent = LogicalSlice | LogicalRegion
Run = tuple[int, int, int]


def piece_shape(shard: ShardIdentity) -> tuple[int, ...] | None:
    """The shape of this member's piece of the parameter (``None`` for a non-owner)."""
    layout = shard.layout
    if layout is ParameterLayout.WHOLE_PARAMETER_OWNER:
        return shard.parameter.global_shape if shard.is_owner else None
    if layout is ParameterLayout.REPLICATED:
        return shard.parameter.global_shape
    if layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        return (shard.local_numel,)
    region = shard.logical_region
    assert region is not None
    return region.lengths


def covers_parameter(shard: ShardIdentity) -> bool:
    """True when this member's piece holds every element of the parameter."""
    return piece_shape(shard) is not None and shard.local_numel == shard.parameter.numel


def carries_payload(shard: ShardIdentity) -> bool:
    """True when the piece contributes state: it covers the parameter or holds >= 1 element.

    Empty flattened slices, empty regions and non-owner pieces carry no payload; their
    variant, counters and fields are not part of a portable document.
    """
    # a numel-0 parameter has no element to hold, so its covering pieces must carry its record
    return piece_shape(shard) is not None and (shard.local_numel > 0 or covers_parameter(shard))


def fragment_extent(shard: ShardIdentity) -> Extent:
    """The canonical extent of the fragment a payload piece produces.

    A piece covering the whole parameter (replicated, an owner, a one-member flat group,
    a DTensor replicate) becomes ``LogicalSlice(0, numel)`` whatever its layout, so equal
    logical content has one extent.
    """
    if covers_parameter(shard):
        return LogicalSlice(0, shard.parameter.numel)
    return shard.extent


def is_full(extent: Extent, identity: ParameterIdentity) -> bool:
    return type(extent) is LogicalSlice and extent.flat_offset == 0 and extent.length == identity.numel


def fragment_shape(extent: Extent, identity: ParameterIdentity) -> tuple[int, ...]:
    """Shape of a fragment's field tensors: global for a full extent, else the extent's own."""
    if is_full(extent, identity):
        return identity.global_shape
    if type(extent) is LogicalSlice:
        return (extent.length,)
    assert type(extent) is LogicalRegion
    return extent.lengths


def extent_runs(extent: Extent, shape: Sequence[int]) -> list[Run]:
    """Sorted runs ``(global_start, length, local_start)`` of ``extent`` inside ``shape``."""
    if type(extent) is LogicalSlice:
        return [(extent.flat_offset, extent.length, 0)] if extent.length else []
    assert type(extent) is LogicalRegion
    if extent.numel == 0:
        return []
    rank = len(shape)
    if rank == 0:
        return [(0, 1, 0)]
    # Axes after ``split`` are covered fully, so each index prefix before it is one run.
    split = rank - 1
    while split >= 0 and extent.offsets[split] == 0 and extent.lengths[split] == shape[split]:
        split -= 1
    if split < 0:
        return [(0, math.prod(shape), 0)]
    # elements per index step along axis ``split``: the product of the fully covered trailing axes
    inner = math.prod(shape[split + 1 :])
    run_length = extent.lengths[split] * inner
    strides = [math.prod(shape[axis + 1 :]) for axis in range(rank)]
    # row-major prefixes (one empty prefix when split == 0), so runs come out sorted by global start
    prefixes = itertools.product(*(range(o, o + n) for o, n in zip(extent.offsets[:split], extent.lengths[:split])))
    runs = []
    local = 0
    for prefix in prefixes:
        start = sum(i * s for i, s in zip(prefix, strides)) + extent.offsets[split] * inner
        runs.append((start, run_length, local))
        local += run_length
    return runs


def overlaps(a: Extent, b: Extent, shape: Sequence[int]) -> bool:
    """True when two extents of one parameter share at least one element."""
    return any(True for _ in _intersections(extent_runs(a, shape), extent_runs(b, shape)))


def _intersections(left: list[Run], right: list[Run]) -> Iterable[tuple[int, int, int]]:
    """Yield ``(left_local, right_local, length)`` for every overlap of two sorted run lists."""
    i = j = 0
    while i < len(left) and j < len(right):
        a_start, a_len, a_local = left[i]
        b_start, b_len, b_local = right[j]
        start = max(a_start, b_start)
        end = min(a_start + a_len, b_start + b_len)
        if start < end:
            yield a_local + (start - a_start), b_local + (start - b_start), end - start
        # advance the run that ends first: it cannot overlap any later run of the other sorted list
        if a_start + a_len <= b_start + b_len:
            i += 1
        else:
            j += 1


def copy_overlap(
    source: torch.Tensor,
    source_extent: Extent,
    target: torch.Tensor,
    target_extent: Extent,
    shape: Sequence[int],
) -> int:
    """Copy every element the two extents share from ``source`` into ``target``.

    Both tensors are contiguous and shaped like their extents' pieces. Returns the number of
    elements copied.
    """
    source_flat = source.reshape(-1)
    # target is contiguous, so reshape is a view and the copies below write into target itself
    target_flat = target.reshape(-1)
    copied = 0
    for s_local, t_local, length in _intersections(
        extent_runs(source_extent, shape), extent_runs(target_extent, shape)
    ):
        target_flat[t_local : t_local + length].copy_(source_flat[s_local : s_local + length])
        copied += length
    return copied


def validate_tiling(extents: Sequence[Extent], identity: ParameterIdentity) -> None:
    """Require ``extents`` (in order) to cover ``identity`` exactly once.

    Either one extent covering the whole parameter, or partial non-empty extents, sorted by
    their first flat index, that tile ``[0, numel)`` with no gap and no overlap.
    """
    fqn = identity.fqn
    if not extents:
        raise PortableStateError(f"parameter {fqn!r} has no fragments")
    full = [e for e in extents if is_full(e, identity)]
    if full:
        if len(extents) != 1:
            raise PortableStateError(f"parameter {fqn!r} has a full fragment and other fragments")
        return
    shape = identity.global_shape
    runs: list[tuple[int, int]] = []
    first_starts = []
    for extent in extents:
        if type(extent) is LogicalRegion:
            try:
                extent.validate_bounds(identity)
            except ContractError as exc:  # one exception family for every refused document
                raise PortableStateError(f"a fragment of {fqn!r}: {exc}") from None
        elif type(extent) is LogicalSlice and extent.end > identity.numel:
            raise PortableStateError(f"a fragment of {fqn!r} ends at {extent.end}, beyond numel {identity.numel}")
        pieces = extent_runs(extent, shape)
        if not pieces:
            raise PortableStateError(f"parameter {fqn!r} has an empty partial fragment")
        first_starts.append(pieces[0][0])
        runs.extend((start, length) for start, length, _ in pieces)
    # one canonical fragment order (by first flat index), so equal content has one catalog digest
    if first_starts != sorted(first_starts) or len(set(first_starts)) != len(first_starts):
        raise PortableStateError(f"fragments of {fqn!r} are not in flat order")
    cursor = 0
    # sort runs, not fragments: regions' runs interleave (e.g. column blocks of a matrix)
    for start, length in sorted(runs):
        if start != cursor:
            what = "overlap" if start < cursor else "leave a gap"
            raise PortableStateError(f"fragments of {fqn!r} {what} at flat index {min(start, cursor)}")
        cursor = start + length
    if cursor != identity.numel:
        raise PortableStateError(f"fragments of {fqn!r} cover [0, {cursor}) but numel is {identity.numel}")

"""Assembly and projection by shard identity: any partition of a parameter (flat slices or
DTensor regions) assembles to the global tensor exactly, and the global tensor projects onto
any other partition exactly; tilings with a gap, an overlap or a wrong order are refused."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from gefen_contracts.identity import LogicalRegion, LogicalSlice, ParameterIdentity
from gefen_portable import PortableStateError
from gefen_portable.extents import Extent, copy_overlap, extent_runs, validate_tiling
from hypothesis import given
from hypothesis import strategies as st

FULL_SHAPE = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple)


def _identity(shape: tuple[int, ...]) -> ParameterIdentity:
    return ParameterIdentity("p", shape)


def _piece(global_tensor: torch.Tensor, extent: Extent) -> torch.Tensor:
    """The reference piece: direct slicing of the global tensor."""
    if type(extent) is LogicalSlice:
        return global_tensor.reshape(-1)[extent.flat_offset : extent.end].clone()
    assert type(extent) is LogicalRegion
    view = global_tensor
    for axis, (offset, length) in enumerate(zip(extent.offsets, extent.lengths)):
        view = view.narrow(axis, offset, length)
    return view.clone()


def _piece_shape(extent: Extent) -> tuple[int, ...]:
    return (extent.length,) if type(extent) is LogicalSlice else extent.lengths


@st.composite
def flat_partition(draw: st.DrawFn, numel: int) -> list[Extent]:
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=numel), max_size=4)))
    bounds = [0, *cuts, numel]
    return [LogicalSlice(a, b - a) for a, b in itertools.pairwise(bounds)]


@st.composite
def region_partition(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Extent]:
    dim = draw(st.integers(min_value=0, max_value=len(shape) - 1))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=shape[dim]), max_size=3)))
    bounds = [0, *cuts, shape[dim]]
    regions: list[Extent] = []
    for a, b in itertools.pairwise(bounds):
        offsets = tuple(a if axis == dim else 0 for axis in range(len(shape)))
        lengths = tuple(b - a if axis == dim else size for axis, size in enumerate(shape))
        regions.append(LogicalRegion(offsets, lengths))
    return regions


@st.composite
def partitions(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Extent], list[Extent]]:
    shape = draw(FULL_SHAPE)
    numel = math.prod(shape)
    kinds = [draw(st.sampled_from(["flat", "region"])) for _ in range(2)]
    out = []
    for kind in kinds:
        if kind == "region" and shape:
            out.append(draw(region_partition(shape)))
        else:
            out.append(draw(flat_partition(numel)))
    return shape, out[0], out[1]


@given(partitions(), st.integers(min_value=0, max_value=2**31))
def test_any_partition_assembles_exactly_and_projects_onto_any_other(
    case: tuple[tuple[int, ...], list[Extent], list[Extent]], seed: int
) -> None:
    shape, source, target = case
    generator = torch.Generator().manual_seed(seed)
    global_tensor = torch.randn(shape, generator=generator)
    full: Extent = LogicalSlice(0, math.prod(shape))
    assembled = torch.full(shape, float("nan"))
    written = 0
    for extent in source:
        written += copy_overlap(_piece(global_tensor, extent), extent, assembled, full, shape)
    assert written == math.prod(shape)
    assert torch.equal(assembled.view(torch.int32), global_tensor.view(torch.int32))
    for extent in target:
        piece = torch.full(_piece_shape(extent), float("nan"))
        filled = sum(copy_overlap(_piece(global_tensor, src), src, piece, extent, shape) for src in source)
        assert filled == piece.numel()
        assert torch.equal(piece.view(torch.int32), _piece(global_tensor, extent).view(torch.int32))


@given(partitions())
def test_partitions_without_empty_pieces_tile_and_broken_ones_do_not(
    case: tuple[tuple[int, ...], list[Extent], list[Extent]],
) -> None:
    shape, source, _ = case
    identity = _identity(shape)
    pieces = [e for e in source if extent_runs(e, shape)]
    if not pieces:
        validate_tiling([LogicalSlice(0, identity.numel)], identity)
        return
    validate_tiling(pieces, identity)
    if len(pieces) > 1:
        with pytest.raises(PortableStateError):
            validate_tiling(pieces[1:], identity)  # a gap at the start
        with pytest.raises(PortableStateError):
            validate_tiling([*pieces, pieces[0]], identity)  # an overlap
        with pytest.raises(PortableStateError):
            validate_tiling(list(reversed(pieces)), identity)  # out of order


def test_region_runs_follow_row_major_order() -> None:
    region = LogicalRegion((1, 0, 2), (2, 3, 1))
    runs = extent_runs(region, (4, 3, 4))
    assert runs == [(14, 1, 0), (18, 1, 1), (22, 1, 2), (26, 1, 3), (30, 1, 4), (34, 1, 5)]
    assert extent_runs(LogicalRegion((2, 0), (2, 5)), (4, 5)) == [(10, 10, 0)]
    assert extent_runs(LogicalRegion((), ()), ()) == [(0, 1, 0)]


def test_a_full_fragment_must_be_alone() -> None:
    identity = _identity((2, 3))
    with pytest.raises(PortableStateError):
        validate_tiling([LogicalSlice(0, 6), LogicalSlice(0, 3)], identity)
    with pytest.raises(PortableStateError):
        validate_tiling([], identity)
    with pytest.raises(PortableStateError):
        validate_tiling([LogicalSlice(0, 3), LogicalSlice(3, 0)], identity)

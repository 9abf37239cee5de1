"""Property tests over random valid manifests (random partitions, empty shards included)."""

from __future__ import annotations

import dataclasses
import math

from contract_builders import flat_shard
from gefen_contracts import CodecError, ContractError
from gefen_contracts.codec import from_primitive, to_primitive
from gefen_contracts.digest import descriptor_digest
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.manifest import ShardingManifest
from hypothesis import given
from hypothesis import strategies as st


@st.composite
def partitions(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    numel = math.prod(shape)
    members = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=members - 1, max_size=members - 1)))
    bounds = [0, *cuts, numel]
    pieces = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(members)]
    order = draw(st.permutations(range(members)))
    return shape, [pieces[i] for i in order]


def build(shape: tuple[int, ...], pieces: list[tuple[int, int]], fqn: str = "model.w") -> ShardingManifest:
    group = ProcessGroupIdentity("dp", tuple(f"m{i}" for i in range(len(pieces))))
    return ShardingManifest(
        tuple(flat_shard(fqn, shape, off, length, i, group) for i, (off, length) in enumerate(pieces))
    )


@given(partitions())
def test_random_manifests_round_trip_losslessly(case: tuple[tuple[int, ...], list[tuple[int, int]]]) -> None:
    manifest = build(*case)
    record = to_primitive(manifest)
    assert from_primitive(record, ShardingManifest) == manifest
    assert descriptor_digest(from_primitive(record, ShardingManifest)) == descriptor_digest(manifest)


@given(partitions(), st.data())
def test_any_single_field_change_alters_the_digest(
    case: tuple[tuple[int, ...], list[tuple[int, int]]], data: st.DataObject
) -> None:
    manifest = build(*case)
    digest = descriptor_digest(manifest)
    index = data.draw(st.integers(0, len(manifest.shards) - 1))
    shard = manifest.shards[index]
    field = data.draw(st.sampled_from(["fqn", "shape", "group", "member_name"]))
    if field == "fqn":
        changed = build(case[0], case[1], fqn="model.v")
    elif field == "shape":
        changed = build((*case[0], 1), case[1])
    elif field == "group":
        group = dataclasses.replace(shard.process_group, semantic_name="dp2")  # type: ignore[type-var]
        changed = ShardingManifest(tuple(dataclasses.replace(s, process_group=group) for s in manifest.shards))
    else:
        renamed = ProcessGroupIdentity("dp", tuple(f"n{i}" for i in range(len(case[1]))))
        changed = ShardingManifest(
            tuple(
                dataclasses.replace(s, process_group=renamed, local_member=f"n{s.member_index}")
                for s in manifest.shards
            )
        )
    assert descriptor_digest(changed) != digest


@given(partitions(), st.data())
def test_every_coverage_violation_is_rejected(
    case: tuple[tuple[int, ...], list[tuple[int, int]]], data: st.DataObject
) -> None:
    shape, pieces = case
    numel = math.prod(shape)
    kind = data.draw(st.sampled_from(["gap", "overlap", "missing", "off_boundary_empty"]))
    pieces = list(pieces)
    nonempty = [i for i, (_, length) in enumerate(pieces) if length > 0]
    if kind == "gap" and nonempty:
        i = data.draw(st.sampled_from(nonempty))
        off, length = pieces[i]
        pieces[i] = (off + 1, length - 1) if data.draw(st.booleans()) else (off, length - 1)
    elif kind == "overlap" and len(nonempty) >= 2:
        i = data.draw(st.sampled_from([j for j in nonempty if pieces[j][0] > 0]))
        off, length = pieces[i]
        pieces[i] = (off - 1, length + 1)
    elif kind == "missing" and len(pieces) >= 2:
        group = ProcessGroupIdentity("dp", tuple(f"m{i}" for i in range(len(pieces))))
        shards = [flat_shard("model.w", shape, off, ln, i, group) for i, (off, ln) in enumerate(pieces)]
        drop = data.draw(st.integers(0, len(shards) - 1))
        del shards[drop]
        try:
            ShardingManifest(tuple(shards))
        except ContractError:
            return
        raise AssertionError("a manifest missing a member was accepted")
    elif kind == "off_boundary_empty" and numel >= 2 and len(pieces) >= 2:
        boundaries = {0} | {off + ln for off, ln in pieces if ln > 0}
        inside = [x for x in range(1, numel) if x not in boundaries]
        if not inside:
            return
        i = data.draw(st.integers(0, len(pieces) - 1))
        if pieces[i][1] > 0:
            return  # only empty pieces can be moved off a boundary without changing coverage
        pieces[i] = (data.draw(st.sampled_from(inside)), 0)
    else:
        return
    try:
        build(shape, pieces)
    except ContractError:
        return
    raise AssertionError(f"{kind} accepted: {pieces} over {numel}")


@given(partitions())
def test_non_canonical_records_are_rejected(case: tuple[tuple[int, ...], list[tuple[int, int]]]) -> None:
    manifest = build(*case)
    record = to_primitive(manifest)
    if len(record["shards"]) < 2:
        return
    record["shards"] = list(reversed(record["shards"]))
    try:
        from_primitive(record, ShardingManifest)
    except CodecError:
        return
    raise AssertionError("an unsorted (non-canonical) manifest record was accepted")

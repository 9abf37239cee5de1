from __future__ import annotations

import pytest
from contract_builders import GROUP, flat_shard, replicated
from gefen_contracts import ContractError
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest

THREE = ProcessGroupIdentity("dp3", ("m0", "m1", "m2"))


def region_shard(
    shape: tuple[int, ...], dim: int, offset: int, length: int, member: int, group: ProcessGroupIdentity = GROUP
) -> ShardIdentity:
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = offset, length
    return ShardIdentity(
        ParameterIdentity("w", shape),
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
        LogicalRegion(tuple(offsets), tuple(lengths)),
        (
            ShardPlacement(
                "dp", PlacementKind.DIMENSION_SHARD, member, len(group.ordered_members), parameter_dimension=dim
            ),
        ),
        group,
        group.ordered_members[member],
    )


def test_manifest_sorts_and_queries() -> None:
    a1 = flat_shard("a", (8,), 4, 4, 1)
    a0 = flat_shard("a", (8,), 0, 4, 0)
    b = replicated("b", (2,))
    manifest = ShardingManifest((b, a1, a0))
    assert manifest.shards == (a0, a1, b)
    assert manifest.fqns == ("a", "b")
    assert manifest.for_parameter("a") == (a0, a1)
    assert manifest.for_parameter("zzz") == ()
    assert manifest.restricted_to(["b"]).shards == (b,)


def test_flattened_coverage_gaps_overlaps_and_members() -> None:
    with pytest.raises(ContractError, match="gap"):
        ShardingManifest((flat_shard("a", (8,), 0, 3, 0), flat_shard("a", (8,), 4, 4, 1)))
    with pytest.raises(ContractError, match="overlap"):
        ShardingManifest((flat_shard("a", (8,), 0, 5, 0), flat_shard("a", (8,), 4, 4, 1)))
    with pytest.raises(ContractError, match="cover"):
        ShardingManifest((flat_shard("a", (8,), 0, 4, 0), flat_shard("a", (8,), 4, 3, 1)))
    with pytest.raises(ContractError, match="exactly once"):
        ShardingManifest((flat_shard("a", (8,), 0, 8, 0),))
    with pytest.raises(ContractError, match="duplicate"):
        ShardingManifest((flat_shard("a", (8,), 0, 8, 0), flat_shard("a", (8,), 0, 8, 0)))


def test_empty_flattened_slices_on_boundaries_in_any_member_order() -> None:
    ok = ShardingManifest(
        (
            flat_shard("a", (6,), 0, 3, 0, THREE),
            flat_shard("a", (6,), 3, 0, 2, THREE),
            flat_shard("a", (6,), 3, 3, 1, THREE),
        )
    )
    assert len(ok.shards) == 3
    ShardingManifest(
        (
            flat_shard("a", (6,), 6, 0, 0, THREE),
            flat_shard("a", (6,), 0, 6, 1, THREE),
            flat_shard("a", (6,), 0, 0, 2, THREE),
        )
    )
    with pytest.raises(ContractError, match="boundary"):
        ShardingManifest(
            (
                flat_shard("a", (6,), 0, 3, 0, THREE),
                flat_shard("a", (6,), 4, 0, 1, THREE),
                flat_shard("a", (6,), 3, 3, 2, THREE),
            )
        )


def test_dtensor_regions_follow_the_same_rule() -> None:
    uneven = ShardingManifest((region_shard((5, 4), 0, 0, 3, 0), region_shard((5, 4), 0, 3, 2, 1)))
    assert [s.member_index for s in uneven.shards] == [0, 1]
    ShardingManifest((region_shard((1, 4), 0, 0, 1, 0), region_shard((1, 4), 0, 1, 0, 1)))
    ShardingManifest((region_shard((4, 6), 1, 3, 3, 0), region_shard((4, 6), 1, 0, 3, 1)))
    with pytest.raises(ContractError, match="gap"):
        ShardingManifest((region_shard((5, 4), 0, 0, 2, 0), region_shard((5, 4), 0, 3, 2, 1)))
    with pytest.raises(ContractError, match="overlap"):
        ShardingManifest((region_shard((5, 4), 0, 0, 3, 0), region_shard((5, 4), 0, 2, 3, 1)))
    with pytest.raises(ContractError, match="exactly once"):
        ShardingManifest((region_shard((5, 4), 0, 0, 5, 0),))


def test_whole_owner_manifests() -> None:
    p = ParameterIdentity("w", (2, 2))

    def owner_shard(member: int, owner: str) -> ShardIdentity:
        local = GROUP.ordered_members[member]
        extent = LogicalSlice.full(p) if local == owner else LogicalSlice(0, 0)
        return ShardIdentity(
            p,
            ParameterLayout.WHOLE_PARAMETER_OWNER,
            extent,
            (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, member, 2),),
            GROUP,
            local,
            owner=owner,
        )

    ShardingManifest((owner_shard(0, "rank:1"), owner_shard(1, "rank:1")))
    with pytest.raises(ContractError, match="owner"):
        ShardingManifest((owner_shard(0, "rank:0"), owner_shard(1, "rank:1")))


def test_one_identity_layout_and_group_per_fqn() -> None:
    with pytest.raises(ContractError, match="ParameterIdentity"):
        ShardingManifest((flat_shard("a", (8,), 0, 4, 0), flat_shard("a", (2, 4), 4, 4, 1)))
    other = ProcessGroupIdentity("dp2", ("rank:0", "rank:1"))
    with pytest.raises(ContractError, match="process groups"):
        ShardingManifest((flat_shard("a", (8,), 0, 4, 0), flat_shard("a", (8,), 4, 4, 1, other)))
    with pytest.raises(ContractError, match="mix layouts"):
        ShardingManifest((flat_shard("a", (8,), 0, 8, 0), replicated("a", (8,))))


def test_empty_manifest_and_bad_elements() -> None:
    with pytest.raises(ContractError):
        ShardingManifest(())
    with pytest.raises(TypeError):
        ShardingManifest(("x",))  # type: ignore[arg-type]

from __future__ import annotations

import dataclasses

import pytest
from contract_builders import GROUP, flat_shard, replicated
from gefen_contracts import ContractError, ContractTypeError
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)


class Name(str):
    pass


def test_parameter_identity_keeps_case_and_normalises_shape() -> None:
    p = ParameterIdentity("Model.Layer.Weight", [3, 4])  # type: ignore[arg-type]
    assert p.fqn == "Model.Layer.Weight"
    assert p.global_shape == (3, 4) and p.numel == 12
    assert ParameterIdentity("scalar", ()).numel == 1
    assert ParameterIdentity("empty", (0, 5)).numel == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fqn = "x"  # type: ignore[misc]


@pytest.mark.parametrize("fqn", ["", " a", "a ", ".a", "a.", "a..b", "a\x00b"])
def test_parameter_identity_rejects_bad_fqns(fqn: str) -> None:
    with pytest.raises(ContractError):
        ParameterIdentity(fqn, (1,))


def test_exact_types_are_required() -> None:
    with pytest.raises(ContractTypeError, match="fqn"):
        ParameterIdentity(Name("a"), (1,))
    with pytest.raises(ContractTypeError, match="global_shape"):
        ParameterIdentity("a", "12")  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError, match=r"global_shape\[0\]"):
        ParameterIdentity("a", (True,))  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError):
        ParameterIdentity("a", (2.0,))  # type: ignore[arg-type]
    with pytest.raises(ContractError):
        ParameterIdentity("a", (-1,))
    for version in (True, 1.0, 0, 2):
        with pytest.raises((ContractError, ContractTypeError), match="schema_version"):
            ParameterIdentity("a", (1,), schema_version=version)  # type: ignore[arg-type]


def test_process_group_identity_rules() -> None:
    group = ProcessGroupIdentity("pipeline:1/dp", ["w:b", "w:a"])  # type: ignore[arg-type]
    assert group.ordered_members == ("w:b", "w:a") and group.coordinate("w:a") == 1
    with pytest.raises(ContractError, match="empty"):
        ProcessGroupIdentity("g", ())
    with pytest.raises(ContractError, match="duplicates"):
        ProcessGroupIdentity("g", ("a", "a"))
    with pytest.raises(ContractTypeError):
        ProcessGroupIdentity("g", "ab")  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError):
        ProcessGroupIdentity("g", (Name("a"),))


def test_placement_rules() -> None:
    ShardPlacement("x", PlacementKind.DIMENSION_SHARD, 0, 2, parameter_dimension=1)
    with pytest.raises(ContractError, match="coordinate"):
        ShardPlacement("x", PlacementKind.FLAT_SHARD, 2, 2)
    with pytest.raises(ContractError, match="required"):
        ShardPlacement("x", PlacementKind.DIMENSION_SHARD, 0, 2)
    with pytest.raises(ContractError, match="must be None"):
        ShardPlacement("x", PlacementKind.FLAT_SHARD, 0, 2, parameter_dimension=0)
    with pytest.raises(ContractTypeError):
        ShardPlacement("x", "flat_shard", 0, 2)  # type: ignore[arg-type]


def test_slices_and_regions() -> None:
    p = ParameterIdentity("w", (4, 6))
    assert LogicalSlice.full(p) == LogicalSlice(0, 24)
    with pytest.raises(ContractError):
        LogicalSlice(-1, 2)
    region = LogicalRegion([1, 0], [2, 6])  # type: ignore[arg-type]
    assert region.offsets == (1, 0) and region.rank == 2 and region.numel == 12
    assert LogicalRegion.full(p) == LogicalRegion((0, 0), (4, 6))
    assert region.intersection(LogicalRegion((2, 3), (5, 5))) == LogicalRegion((2, 3), (1, 3))
    assert not region.overlaps(LogicalRegion((3, 0), (1, 6)))
    with pytest.raises(ContractError, match="rank"):
        LogicalRegion((0,), (1, 2))
    with pytest.raises(ContractTypeError):
        LogicalRegion("01", "12")  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="exceeds"):
        LogicalRegion((3, 0), (2, 6)).validate_bounds(p)


def test_sort_key_is_golden() -> None:
    shard = flat_shard("layer.weight", (2, 4), 4, 4, 1)
    assert shard.sort_key == (
        "layer.weight",
        4,
        4,
        "flattened_element_shard",
        "dp",
        1,
        -1,
        (("data_parallel", "flat_shard", 1, 2, -1),),
        (),
        (),
    )


def test_shard_identity_layout_rules() -> None:
    p = ParameterIdentity("w", (4, 2))
    with pytest.raises(ContractError, match="process_group"):
        ShardIdentity(p, ParameterLayout.FLATTENED_ELEMENT_SHARD, LogicalSlice(0, 4))
    with pytest.raises(ContractError, match="exceeds"):
        flat_shard("w", (4, 2), 6, 4, 0)
    with pytest.raises(ContractError, match="coordinate"):
        ShardIdentity(
            p,
            ParameterLayout.FLATTENED_ELEMENT_SHARD,
            LogicalSlice(0, 4),
            (ShardPlacement("dp", PlacementKind.FLAT_SHARD, 0, 2),),
            GROUP,
            "rank:1",
        )
    with pytest.raises(ContractError, match="full"):
        ShardIdentity(p, ParameterLayout.REPLICATED, LogicalSlice(0, 4))
    with pytest.raises(ContractError, match="replicate placement"):
        ShardIdentity(
            p,
            ParameterLayout.REPLICATED,
            LogicalSlice(0, 8),
            (
                ShardPlacement("a", PlacementKind.REPLICATE, 0, 2),
                ShardPlacement("b", PlacementKind.REPLICATE, 0, 2),
            ),
            GROUP,
            "rank:0",
        )
    with pytest.raises(ContractTypeError, match="logical-region"):
        ShardIdentity(
            p,
            ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
            LogicalSlice(0, 8),
            (ShardPlacement("dp", PlacementKind.REPLICATE, 0, 2),),
            GROUP,
            "rank:0",
        )
    with pytest.raises(ContractError, match="span"):
        ShardIdentity(
            p,
            ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
            LogicalRegion((0, 0), (2, 1)),
            (ShardPlacement("dp", PlacementKind.DIMENSION_SHARD, 0, 2, parameter_dimension=0),),
            GROUP,
            "rank:0",
        )
    with pytest.raises(ContractError, match="owner"):
        ShardIdentity(
            p,
            ParameterLayout.WHOLE_PARAMETER_OWNER,
            LogicalSlice(0, 8),
            (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, 1, 2),),
            GROUP,
            "rank:1",
            owner="rank:0",
        )
    owner = ShardIdentity(
        p,
        ParameterLayout.WHOLE_PARAMETER_OWNER,
        LogicalSlice(0, 0),
        (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, 1, 2),),
        GROUP,
        "rank:1",
        owner="rank:0",
    )
    assert not owner.is_owner and owner.logical_slice == LogicalSlice(0, 0)


def test_descriptors_are_insulated_from_caller_lists() -> None:
    shape = [2, 3]
    members = ["a", "b"]
    p = ParameterIdentity("w", shape)  # type: ignore[arg-type]
    g = ProcessGroupIdentity("g", members)  # type: ignore[arg-type]
    shape.append(9)
    members.append("c")
    assert p.global_shape == (2, 3) and g.ordered_members == ("a", "b")


def test_replicated_helper() -> None:
    shard = replicated("a.b", (3,))
    assert shard.member_index == -1 and shard.local_numel == 3 and shard.is_owner

"""The generic identity machinery: rebinding plans, the sealed layout, bound-state documents."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from contract_builders import GROUP, flat_shard, replicated
from gefen_contracts import ContractError, ContractTypeError, LayoutTamperedError, StateValidationError
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import (
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import (
    BoundParameter,
    CodebookProcessGroupBinding,
    SealedLayout,
    build_bound_state,
    has_internal_overlap,
    parse_bound_state,
    plan_rebinding,
)


def accept(shard: ShardIdentity, target: Any) -> None:
    return None


def plan(
    groups: list[dict[str, Any]], rebindings: list[ParameterRebinding], manifest: ShardingManifest, **kw: Any
) -> Any:
    return plan_rebinding(
        groups,
        rebindings,
        manifest=manifest,
        scope=kw.pop("scope", None),
        name_of=lambda g, s, t: f"group_{g}_param_{s}",
        check_layout=kw.pop("check_layout", accept),
    )


def two_params() -> tuple[list[dict[str, Any]], torch.Tensor, torch.Tensor]:
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    return [{"params": [a]}, {"params": [b]}], a, b


def test_replicated_identity_plan_in_slot_order() -> None:
    groups, a, b = two_params()
    manifest = ShardingManifest((replicated("m.a", (2, 3)), replicated("m.b", (4,))))
    result = plan(
        groups, [ParameterRebinding(b, b, manifest.shards[1]), ParameterRebinding(a, a, manifest.shards[0])], manifest
    )
    assert [e.slot.position for e in result.entries] == [(0, 0), (1, 0)]
    assert [e.slot.compatibility_name for e in result.entries] == ["group_0_param_0", "group_1_param_0"]
    assert result.group_params(2) == [[a], [b]]
    assert [s.fqn for _, s in result.local_bindings()] == ["m.a", "m.b"]


def test_request_validation() -> None:
    groups, a, b = two_params()
    manifest = ShardingManifest((replicated("m.a", (2, 3)), replicated("m.b", (4,))))
    ra, rb = manifest.shards
    cases: list[tuple[list[ParameterRebinding], type[Exception], str]] = [
        ([ParameterRebinding(a, a, ra)], ContractError, "missing"),
        ([ParameterRebinding(a, a, ra), ParameterRebinding(a, b, rb)], ContractError, "repeats a source"),
        ([ParameterRebinding(a, a, ra), ParameterRebinding(torch.zeros(4), b, rb)], ContractError, "not a parameter"),
        ([ParameterRebinding(a, a, ra), ParameterRebinding(b, b, ra)], ContractError, "unique"),
        ([ParameterRebinding(a, a, ra), ParameterRebinding(b, torch.zeros(5), rb)], ContractError, "global shape"),
        (
            [ParameterRebinding(a, a, ra), ParameterRebinding(b, torch.zeros(4, dtype=torch.int32), rb)],
            ContractError,
            "dtype",
        ),
        (
            [ParameterRebinding(a, a, ra), ParameterRebinding(b, torch.zeros(1).expand(4), rb)],
            ContractError,
            "overlaps itself",
        ),
        ([ParameterRebinding(a, a, ra), ParameterRebinding(b, a, rb)], ContractError, "global shape"),
        ([ParameterRebinding(a, a, ra), ParameterRebinding(b, None, rb)], ContractError, "None only"),
    ]
    for rebindings, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            plan(groups, rebindings, manifest)
    with pytest.raises(ContractTypeError):
        plan(groups, [], manifest)
    with pytest.raises(ContractTypeError):
        plan(groups, [ParameterRebinding(a, a, ra)], "manifest")  # type: ignore[arg-type]
    other = ShardingManifest((replicated("m.a", (2, 3)), replicated("m.c", (4,))))
    with pytest.raises(ContractError, match="manifest"):
        plan(groups, [ParameterRebinding(a, a, other.shards[0]), ParameterRebinding(b, b, rb)], other)
    b.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="grad"):
        plan(groups, [ParameterRebinding(a, a, ra), ParameterRebinding(b, b, rb)], manifest)


def test_targets_must_be_storage_disjoint_and_not_steal_slots() -> None:
    groups, a, b = two_params()
    manifest = ShardingManifest((replicated("m.a", (2, 3)), replicated("m.b", (4,))))
    buffer = torch.zeros(9)
    overlapping = [
        ParameterRebinding(a, buffer[:6].view(2, 3), manifest.shards[0]),
        ParameterRebinding(b, buffer[5:9], manifest.shards[1]),
    ]
    with pytest.raises(ContractError, match="overlap in storage"):
        plan(groups, overlapping, manifest)
    adjacent = [
        ParameterRebinding(a, buffer[:6].view(2, 3), manifest.shards[0]),
        ParameterRebinding(b, buffer[6 : 10 - 1].clone().resize_(4), manifest.shards[1]),
    ]
    plan(groups, adjacent, manifest)
    strided = torch.zeros(4, 3)
    with pytest.raises(ContractError, match="non-contiguous"):
        plan(
            groups,
            [
                ParameterRebinding(a, strided[:2], manifest.shards[0]),
                ParameterRebinding(b, strided[:, 0], manifest.shards[1]),
            ],
            manifest,
        )
    spaced = torch.zeros(20)  # a strided view whose span lies past the other target's: disjoint
    plan(
        groups,
        [
            ParameterRebinding(a, spaced[:6].view(2, 3), manifest.shards[0]),
            ParameterRebinding(b, spaced[8::3], manifest.shards[1]),
        ],
        manifest,
    )
    array = np.zeros(16, dtype=np.float32)  # two torch storages over one buffer
    aliased = [
        ParameterRebinding(a, torch.from_numpy(array[:6]).view(2, 3), manifest.shards[0]),
        ParameterRebinding(b, torch.from_numpy(array[4:8]), manifest.shards[1]),
    ]
    with pytest.raises(ContractError, match="overlap in storage"):
        plan(groups, aliased, manifest)
    c = torch.nn.Parameter(torch.zeros(4))
    groups3 = [{"params": [a]}, {"params": [b, c]}]
    manifest3 = ShardingManifest((replicated("m.a", (2, 3)), replicated("m.b", (4,)), replicated("m.c", (4,))))
    stealing = [
        ParameterRebinding(a, a, manifest3.shards[0]),
        ParameterRebinding(b, c, manifest3.shards[1]),
        ParameterRebinding(c, torch.zeros(4), manifest3.shards[2]),
    ]
    with pytest.raises(ContractError, match="occupies another slot"):
        plan(groups3, stealing, manifest3)


def test_flattened_and_whole_owner_targets() -> None:
    flat = torch.nn.Parameter(torch.zeros(8))
    shard = flat_shard("m.w", (2, 4), 4, 4, 1)
    manifest = ShardingManifest((flat_shard("m.w", (2, 4), 0, 4, 0), shard))
    result = plan([{"params": [flat]}], [ParameterRebinding(flat, torch.zeros(4), shard)], manifest)
    assert result.entries[0].target is not None and result.entries[0].target.numel() == 4
    with pytest.raises(ContractError, match="contiguous 1-D"):
        plan([{"params": [flat]}], [ParameterRebinding(flat, torch.zeros(2, 2), shard)], manifest)
    with pytest.raises(ContractError, match="layout refused"):
        plan([{"params": [flat]}], [ParameterRebinding(flat, torch.zeros(4), shard)], manifest, check_layout=_refuse)
    identity = ParameterIdentity("m.o", (2, 2))

    def owner(member: int) -> ShardIdentity:
        local = GROUP.ordered_members[member]
        extent = LogicalSlice.full(identity) if member == 0 else LogicalSlice(0, 0)
        return ShardIdentity(
            identity,
            ParameterLayout.WHOLE_PARAMETER_OWNER,
            extent,
            (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, member, 2),),
            GROUP,
            local,
            owner="rank:0",
        )

    o = torch.nn.Parameter(torch.zeros(2, 2))
    pruned = plan([{"params": [o]}], [ParameterRebinding(o, None, owner(1))], ShardingManifest((owner(0), owner(1))))
    assert pruned.group_params(1) == [[]] and pruned.local_bindings()[0][0] is None


def _refuse(shard: ShardIdentity, target: Any) -> None:
    raise ContractError("layout refused by the optimizer")


def test_scope_must_match_the_manifest_group() -> None:
    flat = torch.nn.Parameter(torch.zeros(8))
    solo = ProcessGroupIdentity("solo", ("rank:0",))
    shard = ShardIdentity(
        ParameterIdentity("m.w", (8,)),
        ParameterLayout.FLATTENED_ELEMENT_SHARD,
        LogicalSlice(0, 8),
        (ShardPlacement("dp", PlacementKind.FLAT_SHARD, 0, 1),),
        solo,
        "rank:0",
    )
    manifest = ShardingManifest((shard,))
    scope = CodebookProcessGroupBinding(solo, "rank:0", None, "cpu")
    assert plan([{"params": [flat]}], [ParameterRebinding(flat, flat, shard)], manifest, scope=scope).scope is scope
    other = CodebookProcessGroupBinding(ProcessGroupIdentity("other", ("rank:0",)), "rank:0", None, "cpu")
    with pytest.raises(ContractError, match="scope binding"):
        plan([{"params": [flat]}], [ParameterRebinding(flat, flat, shard)], manifest, scope=other)
    with pytest.raises(ContractTypeError, match="scope"):
        plan([{"params": [flat]}], [ParameterRebinding(flat, flat, shard)], manifest, scope="solo")


def test_internal_overlap_detection() -> None:
    assert not has_internal_overlap(torch.zeros(3, 4))
    assert not has_internal_overlap(torch.zeros(4, 6)[:, ::2])
    assert not has_internal_overlap(torch.zeros(4, 6).t())
    assert has_internal_overlap(torch.zeros(1, 4).expand(3, 4))
    assert has_internal_overlap(torch.zeros(10).as_strided((3, 3), (1, 1)))


def test_sealed_layout_detects_tampering_through_public_containers() -> None:
    groups, a, b = two_params()
    for g in groups:
        g["param_names"] = ["x"]
    manifest = ShardingManifest((replicated("m.a", (2, 3)), replicated("m.b", (4,))))
    sealed = SealedLayout(
        plan(
            groups,
            [ParameterRebinding(a, a, manifest.shards[0]), ParameterRebinding(b, b, manifest.shards[1])],
            manifest,
        ),
        2,
    )
    live = [{"params": [a], "param_names": ["group_0_param_0"]}, {"params": [b], "param_names": ["group_1_param_0"]}]
    state: dict[Any, Any] = {a: {}}
    sealed.verify(live, state)
    assert sealed.shard_identity(b).fqn == "m.b"
    with pytest.raises(KeyError):
        sealed.shard_identity(torch.zeros(4))
    with pytest.raises(AttributeError):
        sealed.manifest = manifest  # type: ignore[misc]
    tampered: list[Any] = [
        ([{"params": [b], "param_names": ["group_0_param_0"]}, live[1]], state),
        ([live[0]], state),
        ([live[0], {"params": [b], "param_names": ["renamed"]}], state),
        (live, {a: {}, torch.zeros(1): {}}),
    ]
    for groups_view, state_view in tampered:
        with pytest.raises(LayoutTamperedError, match="changed outside post_sharding"):
            sealed.verify(groups_view, state_view)


def test_bound_state_documents_round_trip_and_reject_corruption() -> None:
    manifest = ShardingManifest((replicated("m.a", (2,)),))
    entry = BoundParameter(
        "group_0_param_0", manifest.shards[0], {"lr": 0.1}, "stepped", {"step": 3, "m": torch.tensor([1.0, -0.0])}
    )
    doc = build_bound_state(
        implementation="x.Opt",
        policy={"p": [1, 2]},
        common={"c": torch.ones(2)},
        manifest=manifest,
        parameters={"m.a": entry},
    )
    buffer = io.BytesIO()
    torch.save(doc, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    parsed = parse_bound_state(loaded, implementation="x.Opt", policy={"p": [1, 2]}, manifest=manifest)
    assert parsed.parameters["m.a"].state["step"] == 3
    assert torch.equal(parsed.parameters["m.a"].state["m"], torch.tensor([1.0, -0.0]))
    assert parsed.parameters["m.a"].state["m"] is not loaded["parameters"]["m.a"]["state"]["m"]
    corruptions = [
        ({**doc, "format_version": True}, "format_version"),
        ({**doc, "implementation": "y.Opt"}, "implementation"),
        ({**doc, "policy": {"p": [1]}}, "policy"),
        ({**doc, "policy": {"p": [True, 2]}}, "policy"),  # compared exactly: True is not 1
        ({**doc, "common": {"c": torch.ones(2, dtype=torch.uint16)}}, "uint16 tensors are not allowed"),
        ({**doc, "extra": 1}, "keys"),
        ({**doc, 1: "stray"}, "keys"),  # a non-str key: the message sorted mixed keys (TypeError)
        ({**doc, "common": {"c": torch.tensor([float("nan")])}}, "non-finite"),
        ({**doc, "parameters": {"m.b": doc["parameters"]["m.a"]}}, "shard of"),
    ]
    for corrupted, fragment in corruptions:
        with pytest.raises(StateValidationError, match=fragment):
            parse_bound_state(corrupted, implementation="x.Opt", policy={"p": [1, 2]}, manifest=manifest)
    with pytest.raises(StateValidationError, match="manifest"):
        parse_bound_state(
            doc, implementation="x.Opt", policy={"p": [1, 2]}, manifest=ShardingManifest((replicated("m.z", (2,)),))
        )
    with pytest.raises(StateValidationError, match="not allowed"):
        build_bound_state(implementation="x", policy={"f": print}, common={}, manifest=manifest, parameters={})


def test_a_bound_state_document_of_another_member_is_refused_with_shards_of_equal_size() -> None:
    """Issue 22 (lie f): each shard of the document being *an* element of the manifest is not
    enough; with ``local_shards`` it must be exactly this member's."""
    mine, theirs = flat_shard("m.a", (4,), 0, 2, 0), flat_shard("m.a", (4,), 2, 2, 1)
    manifest = ShardingManifest((mine, theirs))
    entry = BoundParameter("group_0_param_0", theirs, {"lr": 0.1}, "stepped", {"m": torch.zeros(2)})
    doc = build_bound_state(implementation="x.Opt", policy={}, common={}, manifest=manifest, parameters={"m.a": entry})
    parse_bound_state(doc, implementation="x.Opt", policy={}, manifest=manifest)  # an element of the manifest
    parse_bound_state(doc, implementation="x.Opt", policy={}, manifest=manifest, local_shards=[theirs])
    with pytest.raises(StateValidationError, match="another member's slice"):
        parse_bound_state(doc, implementation="x.Opt", policy={}, manifest=manifest, local_shards=[mine])
    with pytest.raises(StateValidationError, match="missing"):
        parse_bound_state(
            doc, implementation="x.Opt", policy={}, manifest=manifest, local_shards=[theirs, replicated("m.b", (2,))]
        )

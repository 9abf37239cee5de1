"""Resharding, continuation and failure propagation on real gloo groups (3 ranks, reused).

Every case trains a source layout, exports, moves the state (a weights-only round-tripped
document, or a PortableState whose missing fragments the import fetches over the group),
imports into another layout and compares with a replicated single-process reference bit for
bit, before and after continuing training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import portable_dist_ranks as ranks
import pytest
from gefen_contracts.testing import GlooWorld

pytestmark = pytest.mark.distributed

OWNERS_2 = {"layer.weight": 0, "layer.bias": 1, "odd": 1, "scalar": 0, "empty": 1}
OWNERS_3 = {"layer.weight": 2, "layer.bias": 0, "odd": 1, "scalar": 2, "empty": 0}
UNEVEN_2 = {"layer.bias": [0, 0, 6], "odd": [0, 20, 21]}
UNEVEN_3 = {"layer.weight": [0, 5, 5, 24], "odd": [0, 1, 2, 21], "layer.bias": [0, 6, 6, 6]}


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(3, gloo_timeout_s=30, case_timeout_s=120) as launched:
        yield launched


def _run(world: GlooWorld, *args: Any) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = world.run(ranks.reshard, *args)
    for rank, result in enumerate(results):
        assert not result.get("problems"), f"rank {rank}: {result['problems']}"
        assert result.get("objects", 0) == 0, "the library used an object collective"
    return results


@pytest.mark.parametrize(
    "target",
    [
        {"kind": "flattened", "members": 2},
        {"kind": "flattened", "members": 3, "cuts": UNEVEN_3},
    ],
    ids=["flattened2", "flattened3-uneven"],
)
def test_replicated_one_member_reshards_onto_flattened_groups(world: GlooWorld, target: dict[str, Any]) -> None:
    source = {"kind": "replicated", "members": 1}
    results = _run(world, source, target, "document", True)
    digests = {r["document_digest"] for r in results[: target["members"]]}
    assert len(digests) == 1


def test_flattened_two_members_reshard_onto_one_member_through_a_document(world: GlooWorld) -> None:
    source = {"kind": "flattened", "members": 2, "cuts": UNEVEN_2}
    results = _run(world, source, {"kind": "replicated", "members": 1}, "document", True)
    assert results[0]["catalog"] == results[1]["catalog"]


def test_flattened_two_members_reshard_onto_three_fetching_only_needed_fragments(world: GlooWorld) -> None:
    source = {"kind": "flattened", "members": 2, "cuts": UNEVEN_2}
    target = {"kind": "flattened", "members": 3, "cuts": UNEVEN_3}
    results = _run(world, source, target, "state", True)
    assert results[0]["catalog"] == results[1]["catalog"]
    assert results[2]["received"] > 0, "rank 2 held no fragment and must have fetched its pieces"
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results)


def test_whole_owner_two_members_redistribute_onto_three(world: GlooWorld) -> None:
    source = {"kind": "owner", "members": 2, "owners": OWNERS_2}
    target = {"kind": "owner", "members": 3, "owners": OWNERS_3}
    _run(world, source, target, "state", False)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (
            {"kind": "regions", "members": 2, "cuts": {"odd": [0, 7, 7]}},
            {"kind": "flattened", "members": 3, "cuts": UNEVEN_3},
        ),
        ({"kind": "flattened", "members": 2, "cuts": UNEVEN_2}, {"kind": "regions", "members": 3}),
    ],
    ids=["regions2-to-flattened3", "flattened2-to-regions3"],
)
def test_dtensor_regions_and_flat_slices_reshard_into_each_other(
    world: GlooWorld, source: dict[str, Any], target: dict[str, Any]
) -> None:
    _run(world, source, target, "state", True)


def test_replicated_three_members_keep_one_copy_per_fragment(world: GlooWorld) -> None:
    source = {"kind": "replicated", "members": 3}
    target = {"kind": "flattened", "members": 3}
    results = _run(world, source, target, "state", True)
    assert len({r["catalog"] for r in results}) == 1


@pytest.mark.parametrize(
    "layout",
    [
        {"kind": "flattened", "members": 2, "cuts": UNEVEN_2},
        {"kind": "owner", "members": 2, "owners": OWNERS_2},
        {"kind": "replicated", "members": 3},
    ],
    ids=["flattened2", "owner2", "replicated3"],
)
def test_same_layout_round_trip_continues_bit_exactly(world: GlooWorld, layout: dict[str, Any]) -> None:
    for rank, problems in enumerate(world.run(ranks.same_layout_continuation, layout)):
        assert not problems, f"rank {rank}: {problems}"


PHASES = [
    ("export.prepare", 1, "prepare"),
    ("export.announce", 0, "catalog.announce"),
    ("export.metadata", 1, "catalog.metadata"),
    ("export.allocate", 0, "catalog.allocate"),
    ("export.verify", 1, "catalog.verify"),
    ("export.finalize", 0, "finalize"),
    ("import.document", 1, "document"),
    ("import.fetch", 2, "fetch.fetch"),
    ("import.prepare", 2, "prepare"),
    ("import.commit", 1, "commit"),
]


@pytest.mark.parametrize(("fault", "bad_rank", "phase"), PHASES, ids=[p[0] for p in PHASES])
def test_a_one_rank_failure_makes_every_rank_raise_the_same_error_with_nothing_mutated(
    world: GlooWorld, fault: str, bad_rank: int, phase: str
) -> None:
    outcomes = world.run(ranks.failure_case, fault, bad_rank)
    members = 2 if fault.startswith("export") else 3
    errors = [o["error"] for o in outcomes[:members]]
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} did not raise"
        assert error[0] == "PortableCollectiveError", error
        assert error[1] == phase, error
    assert len({e[2] for e in errors}) == 1, f"ranks raised different messages: {errors}"
    assert "coordinate" in errors[0][2]
    for rank, outcome in enumerate(outcomes[:members]):
        assert not outcome["changed"], f"rank {rank} changed: {outcome['changed']}"


@pytest.mark.parametrize(
    ("what", "expected"),
    [("transaction", "transaction id"), ("limits", "limits"), ("invalid_transaction", "transaction_id")],
)
def test_divergent_or_invalid_arguments_fail_the_first_gate_everywhere(
    world: GlooWorld, what: str, expected: str
) -> None:
    outcomes = world.run(ranks.divergence_case, what)
    messages = {o["error"][1] for o in outcomes}
    assert len(messages) == 1
    assert all(o["error"][0] == "prepare" for o in outcomes)
    assert expected in messages.pop()
    assert not any(o["changed"] for o in outcomes)


def test_composite_reshards_both_children_and_continues_bit_exactly(world: GlooWorld) -> None:
    outcomes = world.run(ranks.composite_case, False)
    for rank, outcome in enumerate(outcomes):
        assert outcome["error"] is None, outcome["error"]
        assert not outcome["problems"], f"rank {rank}: {outcome['problems']}"
    assert len({o["digest"] for o in outcomes}) == 1


def test_composite_import_stages_both_children_before_the_shared_vote(world: GlooWorld) -> None:
    outcomes = world.run(ranks.composite_case, True)
    assert len({o["error"] for o in outcomes}) == 1
    phase, message = outcomes[0]["error"]
    assert phase == "second.prepare" and "injected failure" in message
    for rank, outcome in enumerate(outcomes):
        assert not outcome["changed"], f"rank {rank}: {outcome['changed']}"

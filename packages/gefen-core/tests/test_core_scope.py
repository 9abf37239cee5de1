"""The codebook process-group scope of Gefen and GefenMuon in two real gloo processes.

Each rank holds its pieces of one driver model (replicated, flattened element shards, or
whole-parameter owners) and a single-process optimizer over the complete parameters is the
oracle: scoped training, ``initialize_collective_state`` and ``refresh_collective_state`` match it bit for bit;
a one-rank failure injected at every protocol phase raises on every rank with nothing changed;
the collective budget is counted by wrapping ``torch.distributed``. The rank functions live in
``gefen_core_scope_cases`` (shared helpers, training, checkpoints), ``gefen_core_scope_failure_cases``
(injected failures, disagreements) and ``gefen_core_scope_layout_cases`` (GefenMuon whole-parameter
owners, FSDP2); ``test_core_scope_three.py`` runs the same cases on three ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gefen_core_scope_cases as cases
import gefen_core_scope_failure_cases as failure_cases
import gefen_core_scope_layout_cases as layout_cases
import pytest
from gefen_contracts.testing import GlooWorld
from gefen_core.codebook_scope import PHASES
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.distributed

#: GefenMuon phases that a ``step()`` reaches (a refresh and ``initialize`` are Gefen's cases).
MUON_PHASES = (
    "entry checks",
    "closure",
    "gradient preflight",
    "AMP agreement",
    "period selection",
    "histogram and solve",
    "commit",
)


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(2) as gloo:
        yield gloo


def assert_raised_everywhere_unchanged(results: list[dict[str, Any]], failing: int, phase: str) -> None:
    """Every rank raised ``CollectiveFailureError`` for ``phase``, only ``failing`` as the local
    failure, no rank's deep snapshot changed, and the same operation succeeds afterwards."""
    for rank, result in enumerate(results):
        outcome = result[phase]
        assert outcome["raised"] == "CollectiveFailureError", (rank, phase, outcome)
        assert outcome["local"] is (rank == failing), (rank, phase, outcome)
        assert outcome["diffs"] == [], (rank, phase, outcome["diffs"])
        retry = outcome.get("retry_raised", outcome.get("retry"))
        assert retry is None, (rank, phase, retry)
    assert "Injected" in results[failing][phase]["message"]


def test_scoped_training_is_bit_exact_with_one_process(world: GlooWorld) -> None:
    for result in world.run(cases.scoped_training_matches_one_process):
        assert result["exact"], "scoped replicated + flattened training must match one process bit for bit"
        assert result["codebook_equal_oracle"] and result["codebooks_agree"]
        assert result["periods"] == result["oracle_periods"]
        assert result["global_step"] == 4


def test_initialize_and_refresh_learn_one_process_codebook(world: GlooWorld) -> None:
    for result in world.run(cases.initialize_and_refresh_match_one_process):
        assert result["initialized"] == (True, True) and result["init_equal"] and result["init_again"]
        assert result["refreshed"] == (True, True) and result["refresh_changed"] and result["refresh_equal"]
        assert result["exact_after_refresh"]


def test_collective_budget_per_operation(world: GlooWorld) -> None:
    results = world.run(cases.collective_counts)
    assert results[0] == results[1]
    counts = results[0]
    assert counts["budget"] == 2
    assert counts["steady_step_1"] == counts["steady_step_2"] == 1  # the header
    assert counts["steady_step_with_closure"] == 2  # entry vote + header
    # learning step: header, non-zero vote, histogram, commit (periods follow the shape: no gradient gather)
    assert counts["learning_step"] == 4
    assert counts["refresh"] == 3  # header, histogram, commit
    assert counts["initialize_existing"] == 1  # the header only


def test_a_one_rank_failure_at_every_phase_raises_everywhere_without_mutation(world: GlooWorld) -> None:
    results = world.run(failure_cases.one_rank_failures, 0, PHASES)
    for phase in PHASES:
        assert_raised_everywhere_unchanged(results, 0, phase)
        assert all(result[phase]["codebooks_agree"] for result in results)


def test_amp_found_inf_disagreement_raises_and_an_agreed_overflow_skips(world: GlooWorld) -> None:
    for result in world.run(failure_cases.amp_disagreement):
        assert result["supports_amp"]
        assert result["divergent"]["raised"] == "ShardAgreementError" and result["divergent"]["diffs"] == []
        assert result["divergent"]["scaler_dropped"] == ["grad_scale", "found_inf"]  # a retry unscales once
        assert "gradient-scaler" in result["divergent"]["message"]
        assert result["overflow"]["raised"] is None and result["skipped"]
        assert result["stepped"]


def test_gradient_presence_and_manifest_disagreements_raise_everywhere(world: GlooWorld) -> None:
    for result in world.run(failure_cases.disagreements):
        for label, needle in (("presence", "gradients"), ("manifest", "manifests")):
            outcome = result[label]
            assert outcome["raised"] == "ShardAgreementError", (label, outcome)
            assert needle in outcome["message"] and outcome["diffs"] == []


def test_checkpoints_carry_the_scope_record_and_refuse_another_member(world: GlooWorld) -> None:
    for rank, result in enumerate(world.run(cases.checkpoints)):
        assert result["scope_record"] == {"semantic_name": "dp", "ordered_members": ["rank:0", "rank:1"]}
        assert result["slot_members"] == [f"rank:{rank}"]
        assert result["native"] and result["canonical"], "same-member resume must be bit-exact"
        for label in ("foreign_native", "foreign_canonical", "unscoped_target"):
            outcome = result[label]
            assert outcome["raised"] == "StateValidationError" and outcome["diffs"] == [], (label, outcome)


def test_muon_whole_parameter_owners_train_like_one_process(world: GlooWorld) -> None:
    results = world.run(layout_cases.muon_whole_owner)
    for result in results:
        assert result["exact"] and result["codebook_equal_oracle"]
        assert result["owner_claims"] == [("adapter_defined", True)]
        assert "codebook scope" in result["unscoped_refused"] and not result["closure_ran"]
    assert [r["states"] for r in results] == [["a", "c"], ["b", "c"]]  # owners hold state, non-owners none


def test_muon_one_rank_failure_raises_everywhere_without_mutation(world: GlooWorld) -> None:
    results = world.run(layout_cases.muon_one_rank_failure, MUON_PHASES)
    for phase in MUON_PHASES:
        assert_raised_everywhere_unchanged(results, 0, phase)


def test_fsdp2_with_a_scope_is_bit_exact_with_one_process(world: GlooWorld) -> None:
    for result in world.run(layout_cases.fsdp2_scoped_matches_one_process):
        assert result["exact"] and result["codebook_equal_oracle"]
        assert result["periods"] == result["oracle_periods"]


def test_a_nonfinite_gradient_on_one_member_is_decided_on_every_member(world: GlooWorld) -> None:
    """Issue 19: the rank with the NaN used to step into NaN state while the others went on."""
    results = world.run(failure_cases.nonfinite_gradient)
    for rank, result in enumerate(results):
        raised = result["raised"]
        assert raised["raised"] == "CollectiveFailureError" and raised["local"] is (rank == 0), (rank, raised)
        assert raised["diffs"] == [], (rank, raised["diffs"])
        assert result["skipped"]["raised"] is None and result["skipped"]["global_step"] == 1, (rank, result)
        assert result["stepped"]["raised"] is None and result["stepped"]["global_step"] == 2, (rank, result)
    assert "NaN or inf" in results[0]["raised"]["message"]


def test_a_layout_tampered_on_one_member_fails_every_member_of_each_collective_operation(world: GlooWorld) -> None:
    """initialize/refresh_collective_state checked the layout before their vote: member 0
    raised LayoutTamperedError alone and the others waited in the header's all_gather."""
    for rank, results in enumerate(world.run(failure_cases.tampered_layout)):
        for operation, result in results.items():
            assert result["raised"] == "CollectiveFailureError", (rank, operation, result)
            assert result["local"] is (rank == 0) and result["diffs"] == [], (rank, operation, result)
            if rank == 0:
                assert "LayoutTamperedError" in result["message"], (operation, result)


def test_the_last_flattened_piece_of_a_ragged_parameter_keeps_its_period(world: GlooWorld) -> None:
    """The piece after the cut ends at the parameter's end (a block boundary) but is no
    multiple of 2048: it took a period of its own (1707) and drifted from one process."""
    for result in world.run(layout_cases.ragged_flattened_matches_one_process):
        assert result["periods"] == (2048, 2048) and result["exact"], result


def test_a_scoped_optimizer_deep_copies_onto_its_group_and_refuses_pickling_by_name(world: GlooWorld) -> None:
    for result in world.run(failure_cases.scoped_copies):
        assert result["same_group"] and result["equal"] and result["distinct"], result
        assert "holds a live process group" in result["pickled"] and "state_dict()" in result["pickled"], result

"""The codebook scope in three gloo processes: the middle member holds empty flattened shards
(the cuts fall at 2048 of 4096 elements), and failures are injected on that member."""

from __future__ import annotations

from collections.abc import Iterator

import gefen_core_scope_cases as cases
import gefen_core_scope_failure_cases as failure_cases
import gefen_core_scope_layout_cases as layout_cases
import pytest
from gefen_contracts.testing import GlooWorld
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)
from test_core_scope import assert_raised_everywhere_unchanged

pytestmark = pytest.mark.distributed

#: One phase per operation and protocol stage (the two-rank module covers every phase).
PHASES_ON_THREE = ("closure", "gradient preflight", "histogram and solve", "refresh preamble", "initialize preamble")


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(3) as gloo:
        yield gloo


def test_scoped_training_with_an_empty_member_is_bit_exact(world: GlooWorld) -> None:
    for result in world.run(cases.scoped_training_matches_one_process, 3, 2):
        assert result["exact"] and result["codebook_equal_oracle"] and result["codebooks_agree"]


def test_initialize_and_refresh_on_three_members(world: GlooWorld) -> None:
    for result in world.run(cases.initialize_and_refresh_match_one_process):
        assert result["init_equal"] and result["refresh_equal"] and result["exact_after_refresh"]


def test_a_failure_on_the_empty_member_raises_everywhere(world: GlooWorld) -> None:
    results = world.run(failure_cases.one_rank_failures, 1, PHASES_ON_THREE)
    for phase in PHASES_ON_THREE:
        assert_raised_everywhere_unchanged(results, 1, phase)


def test_collective_budget_does_not_grow_with_members(world: GlooWorld) -> None:
    counts = world.run(cases.collective_counts)
    assert all(c == counts[0] for c in counts)
    assert counts[0]["steady_step_1"] == 1 and counts[0]["steady_step_with_closure"] == 2


def test_muon_owners_on_three_members(world: GlooWorld) -> None:
    for result in world.run(layout_cases.muon_whole_owner):
        assert result["exact"] and result["codebook_equal_oracle"]
    phases = ("closure", "histogram and solve")
    results = world.run(layout_cases.muon_one_rank_failure, phases, 2)
    for phase in phases:
        assert_raised_everywhere_unchanged(results, 2, phase)


def test_fsdp2_with_a_scope_on_three_members_is_bit_exact(world: GlooWorld) -> None:
    for result in world.run(layout_cases.fsdp2_scoped_matches_one_process):
        assert result["exact"] and result["codebook_equal_oracle"]

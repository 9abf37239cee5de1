"""The kit's identity checks: an honest adopter of the identity Protocols passes, and each
lie about post_sharding, the sealed-layout guard, canonical local state or flattened shards
is named by the check that caught it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gefen_contracts.testing import CheckStatus, ConformanceTarget, assert_conformant, run_conformance
from gefen_contracts.testing.checks import builtin_checks
from gefen_contracts.testing.checks.plans import flat_slices


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


IDENTITY_CHECKS = {
    "identity.post_sharding",
    "identity.sealed_layout_guard",
    "checkpoint.canonical_local",
    "identity.flattened_training",
    "identity.flattened_checkpoints",
}


def test_an_honest_adopter_passes_every_identity_check() -> None:
    report = run_conformance("contracts_bound_toys:bound_sgd")
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status is CheckStatus.PASSED}
    assert passed >= IDENTITY_CHECKS
    claims = {claim for r in report.results for claim in r.claims}
    # found only by binding the optimizer: the fresh contract does not make these claims
    assert {
        "feature:canonical_identity",
        "checkpoint:canonical_local:replicated:atomic",
        "checkpoint:canonical_local:flattened_element_shard:atomic",
    } <= claims


BROKEN = {
    "unguarded_step": ("identity.sealed_layout_guard", "step() after param_groups[0]['params'][0] was replaced"),
    "guard_before_closure_only": ("identity.sealed_layout_guard", "step(closure) whose closure replaced a slot"),
    "mutating_prepare": ("identity.post_sharding", "prepare_post_sharding changed the optimizer"),
    "binds_after_steps": ("identity.post_sharding", "post_sharding after a step (not pristine): was accepted"),
    "stale_import": ("checkpoint.canonical_local", "an import prepared before a step: was accepted"),
    "lossy_export": ("checkpoint.canonical_local", "continuation after a canonical-local round trip"),
    "lax_import": ("checkpoint.canonical_local", "a corrupted document (unknown_state_key): was accepted"),
    "flat_lie": ("identity.flattened_training", "rebound flattened shards vs an optimizer built on the shards"),
}


@pytest.mark.parametrize("factory", sorted(BROKEN))
def test_each_broken_identity_adopter_fails_the_check_that_owns_the_promise(factory: str) -> None:
    check, fragment = BROKEN[factory]
    selected = [c for c in builtin_checks() if c.name == check]
    report = run_conformance(f"contracts_bound_toys:{factory}", checks=selected)
    failed = {r.name: r.detail for r in report.failures}
    assert check in failed, report.format()
    assert fragment in failed[check], failed[check]


def test_flattened_shards_are_contiguous_near_even_pieces_in_member_order() -> None:
    assert flat_slices(10, 2) == [(0, 5), (5, 5)]
    assert flat_slices(7, 3) == [(0, 3), (3, 3), (6, 1)]
    assert flat_slices(1, 2) == [(0, 1), (1, 0)]  # an empty piece on the boundary
    assert flat_slices(6, 2, whole_to_first=True) == [(0, 6), (6, 0)]


def test_a_target_waiving_the_identity_checks_reports_them_waived() -> None:
    target = ConformanceTarget(factory=__import__("contracts_bound_toys").bound_sgd, name="bound")
    report = run_conformance(target, waive={name: "tested elsewhere" for name in IDENTITY_CHECKS})
    waived = {r.name for r in report.results if r.status is CheckStatus.WAIVED}
    assert waived >= IDENTITY_CHECKS and report.ok


def test_a_contract_that_raises_once_bound_fails_the_provider_check() -> None:
    # its bound-only claims (canonical local state, ...) were dropped silently: PASS with fewer checks
    report = run_conformance("contracts_bound_toys:contract_fails_when_bound")
    failed = {result.name: result.detail for result in report.failures}
    assert "contract.provider" in failed, report.format()
    assert "finalized by post_sharding raised AttributeError" in failed["contract.provider"]


def test_a_contributed_check_whose_covers_raises_fails_alone() -> None:
    class BrokenCovers:
        name = "contributed.broken_covers"

        def covers(self, claims: frozenset[str]) -> frozenset[str]:
            raise TypeError("unhashable type: 'list'")

        def run(self, context: object) -> None:
            raise AssertionError("never reached")

    report = run_conformance("contracts_bound_toys:bound_sgd", checks=[*builtin_checks(), BrokenCovers()])
    results = {result.name: result for result in report.results}
    assert results["contributed.broken_covers"].status is CheckStatus.FAILED
    assert "covers() raised TypeError" in results["contributed.broken_covers"].detail
    assert sum(result.status is CheckStatus.PASSED for result in report.results) > 1

"""gefen-dcp's contributed conformance checks: found through the entry point, pass the
reference adopter, and name the claim each broken adopter breaks."""

from __future__ import annotations

import pytest
from gefen_contracts.testing import CheckStatus, assert_conformant, run_conformance
from gefen_contracts.testing.runner import contributed_checks
from gefen_dcp.conformance import ParameterShapedAtomicLoadCheck, ParameterShapedRoundTripCheck

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SINGLE_PROCESS = [ParameterShapedRoundTripCheck(), ParameterShapedAtomicLoadCheck()]


def test_checks_are_registered_through_the_entry_point() -> None:
    checks, broken = contributed_checks()
    assert not broken
    names = {c.name for c in checks}
    assert {
        "dcp.parameter_shaped_roundtrip",
        "dcp.parameter_shaped_atomic_load",
        "dcp.parameter_shaped_reshard",
    } <= names


@pytest.mark.slow
@pytest.mark.distributed
def test_reference_adopter_passes_the_whole_kit() -> None:
    report = run_conformance("gefen_dcp.testing:conformance_factory")
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status is CheckStatus.PASSED}
    assert {
        "dcp.parameter_shaped_roundtrip",
        "dcp.parameter_shaped_atomic_load",
        "dcp.parameter_shaped_reshard",
    } <= passed
    covered = {claim for r in report.results if r.status is CheckStatus.PASSED for claim in r.claims}
    assert "checkpoint:parameter_shaped:transition:dtensor_1d_default_world->replicated:placement_reshard" in covered


@pytest.mark.parametrize(
    ("factory", "check", "fragment"),
    [
        ("forgetful", "dcp.parameter_shaped_roundtrip", "tensor bytes differ"),
    ],
)
def test_broken_adopters_fail_the_check_they_break(factory: str, check: str, fragment: str) -> None:
    report = run_conformance(f"dcp_broken_adopters:{factory}", checks=SINGLE_PROCESS)
    failed = {r.name: r.detail for r in report.failures}
    assert check in failed, report.format()
    assert fragment in failed[check], failed[check]


def test_checks_cover_nothing_for_optimizers_without_the_parameter_shaped_feature() -> None:
    from gefen_dcp.conformance import checks

    claims = frozenset(
        {
            "contract",
            "training:dtensor_1d_default_world",
            "checkpoint:canonical_global:transition:replicated->dtensor_1d_default_world:placement_reshard",
        }
    )
    assert all(not check.covers(claims) for check in checks())

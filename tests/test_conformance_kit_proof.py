"""The conformance kit passes an honest adopter that is not Gefen and names every lie."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conformance_broken_adopters import EXPECTED_FAILURES
from gefen_contracts.testing import CheckStatus, ConformanceTarget, assert_conformant, run_conformance
from gefen_example_sgd import ContractedSGD, conformance_factory

HERE = Path(__file__).parent


def test_example_adopter_passes_the_kit() -> None:
    report = run_conformance("gefen_example_sgd:conformance_factory")
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status is CheckStatus.PASSED}
    assert {"checkpoint.native_roundtrip", "checkpoint.native_atomic_load", "state.declared_variants"} <= passed
    assert "checkpoint.torch_recipe" in passed  # torch's recipe, nested and flattened


@pytest.mark.parametrize("factory", sorted(EXPECTED_FAILURES))
def test_each_broken_adopter_fails_with_its_claim_named(factory: str) -> None:
    check, fragment = EXPECTED_FAILURES[factory]
    report = run_conformance(f"conformance_broken_adopters:{factory}")
    assert not report.ok
    failed = {r.name: r for r in report.failures}
    assert check in failed, report.format()
    assert fragment in failed[check].detail, failed[check].detail
    assert check in report.format()


def test_unverified_claims_fail_unless_waived() -> None:
    target = ConformanceTarget(factory=conformance_factory, name="sgd")
    report = run_conformance(target, checks=[])
    assert not report.ok and report.executed == 0
    assert {r.name for r in report.unverified} >= {"claim checkpoint:native_optimizer:replicated"}
    claims = [r.claims[0] for r in report.unverified]
    waived = run_conformance(target, checks=[], waive={c: "tested elsewhere" for c in claims})
    assert not waived.unverified and not waived.ok, "a run that executed zero checks must fail"
    assert "no check was executed" in waived.format()


def test_factory_errors_are_reported_not_raised() -> None:
    def broken(named: list[tuple[str, object]]) -> ContractedSGD:
        raise RuntimeError("cannot build")

    report = run_conformance(ConformanceTarget(factory=broken))  # type: ignore[arg-type]
    assert not report.ok and "cannot build" in report.failures[0].detail


@pytest.mark.slow
def test_pytest_plugin_runs_the_kit_from_the_command_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    # a repository's own suite beside the run: a conformance run must not collect it
    (tmp_path / "test_unrelated.py").write_text("def test_unrelated():\n    raise AssertionError('collected')\n")
    good = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gefen-conformance", "gefen_example_sgd:conformance_factory", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert good.returncode == 0, good.stdout + good.stderr
    assert "passed" in good.stdout and "test_unrelated" not in good.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--gefen-conformance", "conformance_broken_adopters:mutating_query_factory", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert bad.returncode != 0
    assert "contract.deterministic_and_pure" in bad.stdout


def test_a_rank_claim_the_kit_cannot_exercise_stays_unverified() -> None:
    from gefen_contracts.testing.checks.training import ParameterRanksCheck

    # a 5-D claim has no shape in the kit: covering it would count it executed without running it
    assert ParameterRanksCheck().covers(frozenset({"ranks:5", "ranks:2", "contract"})) == {"ranks:2"}


def test_copies_check_runs_the_deep_copy_when_the_target_model_does_not_pickle() -> None:
    from gefen_contracts.testing.checks import CopiesCheck
    from gefen_contracts.testing.model import make_kit_model

    def unpicklable_model(seed: int) -> torch.nn.Module:
        model = make_kit_model(seed)
        model.scale = lambda x: x  # a local lambda: pickle refuses the model, deepcopy takes it
        return model

    target = ConformanceTarget(factory=conformance_factory, name="sgd", model_builder=unpicklable_model)
    report = run_conformance(target, checks=[CopiesCheck()])
    (result,) = [r for r in report.results if r.name == "training.copies"]
    assert result.status is CheckStatus.PASSED, result.detail
    assert "pickle not exercised" in result.detail and "copy.deepcopy continued bit for bit" in result.detail


def test_an_empty_first_group_is_no_reason_for_the_kit_to_fail() -> None:
    """The staged-load check copied its extra parameter's dtype from ``param_groups[0]``'s first
    parameter and raised IndexError on an empty first group (ZeRO builds them)."""
    from gefen_contracts.testing.checks import AtomicLoadCheck

    def empty_first(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedSGD:
        groups = [{"params": []}, {"params": [p for _, p in named_parameters]}]
        return ContractedSGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)

    report = run_conformance(ConformanceTarget(factory=empty_first, name="sgd"), checks=[AtomicLoadCheck()])
    (result,) = [r for r in report.results if r.name == "checkpoint.native_atomic_load"]
    assert result.status is CheckStatus.PASSED, result.detail

"""The portable checks join the conformance kit through ``gefen.conformance``: a conforming
adopter passes them, and adopters that lose state or accept corrupted documents fail them."""

from __future__ import annotations

from typing import Any

import portable_sgd_adopter as adopter
import torch
from gefen_contracts.testing import CheckStatus, ConformanceTarget, load_target, run_conformance
from gefen_contracts.testing.runner import contributed_checks
from gefen_contracts.transactions import StagedTransaction

SPEC = "portable_sgd_adopter:conformance_factory"


def _status(report: Any, name: str) -> CheckStatus:
    return next(r.status for r in report.results if r.name == name)


def test_the_checks_are_contributed_through_the_entry_point_group() -> None:
    checks, broken = contributed_checks()
    assert not broken
    names = {c.name for c in checks}
    assert {"portable.roundtrip", "portable.atomic_import"} <= names


def test_a_conforming_adopter_passes_the_whole_kit() -> None:
    report = run_conformance(load_target(SPEC))
    assert report.ok, report.format()
    assert _status(report, "portable.roundtrip") is CheckStatus.PASSED
    assert _status(report, "portable.atomic_import") is CheckStatus.PASSED
    covered = {c for r in report.results if r.status is CheckStatus.PASSED for c in r.claims}
    assert {"feature:portable_state", "checkpoint:canonical_global:replicated"} <= covered
    assert "checkpoint:canonical_global:replicated:atomic" in covered


class Forgetful(adopter.PortableSGD):
    """Stages an import but keeps only the counters: the momentum is lost."""

    def portable_prepare_import(self, **kwargs: Any) -> StagedTransaction:
        staged = super().portable_prepare_import(**kwargs)
        payload = staged.claim(self, kind="portable_import", current_token=self._version)
        new_state, step = payload  # type: ignore[misc]
        for entry in new_state.values():
            entry["momentum_buffer"] = torch.zeros_like(entry["momentum_buffer"])
        return StagedTransaction(self, kind="portable_import", token=self._version, payload=(new_state, step))


class Credulous(adopter.PortableSGD):
    """Accepts any variant and any options (it does not validate what it stages)."""

    def portable_prepare_import(self, **kwargs: Any) -> StagedTransaction:
        slots = kwargs["slots"]
        new_state = {}
        for slot in slots:
            piece = self.pieces[slot.fqn]
            if piece is not None and "momentum" in slot.element_fields:
                new_state[piece] = {"momentum_buffer": slot.element_fields["momentum"].clone(), "step": 1}
        return StagedTransaction(self, kind="portable_import", token=self._version, payload=(new_state, 0))


def _factory(cls: type[adopter.PortableSGD]) -> Any:
    def factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> adopter.PortableSGD:
        specs = {name: tuple(p.shape) for name, p in named_parameters}
        return cls(adopter.replicated_manifest(specs, None), None, dict(named_parameters), scaled=True, adopt=True)

    return factory


def test_an_adopter_that_loses_state_on_import_fails_the_round_trip_check() -> None:
    target = ConformanceTarget(
        _factory(Forgetful), name="forgetful", waive=adopter.conformance_factory.conformance_waive
    )  # type: ignore[attr-defined]
    report = run_conformance(target)
    assert _status(report, "portable.roundtrip") is CheckStatus.FAILED
    assert not report.ok


def test_an_adopter_that_accepts_corrupted_documents_fails_the_atomic_check() -> None:
    target = ConformanceTarget(
        _factory(Credulous), name="credulous", waive=adopter.conformance_factory.conformance_waive
    )  # type: ignore[attr-defined]
    report = run_conformance(target)
    result = next(r for r in report.results if r.name == "portable.atomic_import")
    assert result.status is CheckStatus.FAILED and "accepted" in result.detail


class LossyExport(adopter.PortableSGD):
    """Exports its momentum rounded to bfloat16 (lie h/i of issue 22): the import is lossy,
    yet re-exporting the imported state gives the same document."""

    def portable_export(self) -> Any:
        exported = super().portable_export()
        for slot in exported.slots:
            for tensor in slot.element_fields.values():
                tensor.copy_(tensor.to(torch.bfloat16).to(tensor.dtype))  # the exported copy, rounded
        return exported


def test_a_lossy_export_fails_the_round_trip_on_the_state_not_only_the_losses() -> None:
    target = ConformanceTarget(_factory(LossyExport), name="lossy", waive=adopter.conformance_factory.conformance_waive)  # type: ignore[attr-defined]
    report = run_conformance(target)
    result = next(r for r in report.results if r.name == "portable.roundtrip")
    assert result.status is CheckStatus.FAILED, report.format()
    assert "native state after a portable import" in result.detail, result.detail

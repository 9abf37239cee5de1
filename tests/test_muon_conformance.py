"""The conformance kit against GefenMuon, once per ``sharded_mode`` and for the main levers.

Claims the kit cannot execute in one process (DTensor training per mode, DTensor resume and
world-size changes) are waived by name (``gefen_core.conformance.MUON_WAIVERS``), each
pointing at the gloo test that executes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gefen_contracts.testing import (
    ConformanceTarget,
    assert_conformant,
    enumerate_claims,
    replicated_copy_plan,
    run_conformance,
)
from gefen_core import GefenMuon
from gefen_core.conformance import CHECK_WAIVERS, MUON_WAIVERS, matrix_loss, matrix_model


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _factory(**options: Any) -> Callable[[list[tuple[str, torch.nn.Parameter]]], torch.optim.Optimizer]:
    def build(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        return GefenMuon(named, lr=1e-2, fused=False, **options)

    return build


def _bf16_model(seed: int) -> torch.nn.Module:
    return matrix_model(seed).to(torch.bfloat16)


#: gefen-dcp's resharding check spawns two gloo worlds per target; every configuration runs the
#: other contributed checks, and the claims this one executes are executed by
#: tests/test_gefen_dcp_state_resharding.py (FSDP2 on gloo, 20 steps within 5e-3).
RESHARD_WAIVER = {
    "dcp.parameter_shaped_reshard": "executed by tests/test_gefen_dcp_state_resharding.py; `gefen conformance` runs it in full"
}

CONFIGS: dict[str, dict[str, Any]] = {
    "exact": {},
    "approx": {"sharded_mode": "approx"},
    "distributed": {"sharded_mode": "distributed"},
    "normuon_tuned3": {"normuon": True, "ns_schedule": "tuned3", "adjust_lr_fn": "match_rms_adamw"},
    "stochastic_round_cautious": {"stochastic_round": True, "cautious": True, "nesterov": False},
    "bf16": {},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conformance(name: str) -> None:
    target = ConformanceTarget(
        factory=_factory(**CONFIGS[name]),
        name=f"gefen-muon[{name}]",
        model_builder=_bf16_model if name == "bf16" else matrix_model,
        loss_fn=matrix_loss,
        spec="gefen_core.conformance:muon_factory",
        # the 2-rank scope check runs on the packaged factory; the gloo reshard check in
        # tests/test_gefen_dcp_state_resharding.py
        waive={**MUON_WAIVERS, **CHECK_WAIVERS, **RESHARD_WAIVER},
    )
    report = run_conformance(target)
    assert_conformant(report)
    executed = {r.name for r in report.results if r.status.value == "passed"}
    assert {
        "checkpoint.native_roundtrip",
        "checkpoint.native_atomic_load",
        "training.replicated",
        "state.declared_variants",
    } <= executed
    _, optimizer = target.build()
    claims = enumerate_claims(optimizer.optimizer_contract())  # type: ignore[attr-defined]
    # The kit also collects the claims of a bound contract (its identity checks bind a replicated copy).
    model, bound = target.build()
    plan = replicated_copy_plan(list(model.named_parameters()))
    bound.post_sharding(plan.rebindings, manifest=plan.manifest)  # type: ignore[attr-defined]
    claims |= enumerate_claims(bound.optimizer_contract())  # type: ignore[attr-defined]
    multi = {"dcp.parameter_shaped_reshard", "portable.reshard"}
    waived = {r.name for r in report.results if r.status.value == "waived"} - multi
    covered = {c for r in report.results if r.name in multi for c in r.claims}
    scope = "feature:collective_scope"  # covered by the waived scope check, so not listed separately
    expected = {f"claim {c}" for c in MUON_WAIVERS if c in claims - covered and c != scope}
    assert waived == expected | (set(CHECK_WAIVERS) - multi)
    assert any(c.startswith("training:dtensor") for c in claims)


def test_the_packaged_factory_passes_through_the_cli_loader() -> None:
    report = run_conformance("gefen_core.conformance:muon_factory", waive=RESHARD_WAIVER)
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status.value == "passed"}
    assert {"scope.collective_protocol", "portable.roundtrip", "portable.atomic_import"} <= passed
    assert {"dcp.parameter_shaped_roundtrip", "portable.reshard"} <= passed  # replicated 1 -> 2 members

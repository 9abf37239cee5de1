"""The conformance kit against every optimizer the project ships, and the docs' example adopter.

One command shows that the whole convention holds::

    uv run pytest tests/test_conformance_all.py -q

Every target must pass with each claim either executed by a kit check or waived by name with
a reason that names the test executing it (claims a single process cannot execute: FSDP2
training, DTensor checkpoints, world-size changes). Gefen-family optimizers run as the
meta-package wires them (``fused=None``: gefen-kernels' CPU kernel when it supports the
tensors), and once more through their packages' own factories (reference path).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen.integrations.conformance import HYBRID_WAIVERS
from gefen_contracts.testing import (
    CheckStatus,
    ConformanceReport,
    ConformanceTarget,
    assert_conformant,
    enumerate_claims,
    run_conformance,
)
from gefen_contracts.testing.model import make_kit_model
from gefen_core.conformance import MUON_WAIVERS, WAIVERS, matrix_loss, matrix_model
from gefen_example_sgd import ContractedSGD
from gefen_hybrid import CompositeOptimizer
from gefen_hybrid.conformance import DTENSOR_WAIVERS
from torch import nn

Named = list[tuple[str, nn.Parameter]]
#: A waiver's reason must name the test module that executes the claim.
NAMES_A_TEST = re.compile(r"tests/\S*test_\w+\.py")


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    import gefen_kernels

    gefen_kernels.cpu_kernel_status()  # the CPU kernel is built (or loaded) once, up front
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _bf16_kit_model(seed: int) -> nn.Module:
    return make_kit_model(seed).to(torch.bfloat16)


def _bf16_loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 16, (6, 5), generator=generator)
    target = torch.randn(6, 4, generator=generator)
    return nn.functional.mse_loss(model(tokens).float(), target)


def _gefen(**options: Any) -> Callable[[Named], torch.optim.Optimizer]:
    return lambda named: Gefen(named, lr=1e-2, **options)


def _muon(**options: Any) -> Callable[[Named], torch.optim.Optimizer]:
    return lambda named: GefenMuon(named, lr=1e-2, **options)


def _hybrid(**options: Any) -> Callable[[Named], torch.optim.Optimizer]:
    return lambda named: GefenMuonHybrid(named, **{"lr": 1e-2, **options})


def _muon_with_example_sgd(named: Named) -> torch.optim.Optimizer:
    return CompositeOptimizer.from_factories(
        named,
        {
            "muon": lambda part: GefenMuon(part, lr=1e-2),
            "backup": lambda part: ContractedSGD(part, lr=0.05, momentum=0.9, weight_decay=0.01),
        },
    )


_COMPOSITE_FSDP2 = (
    "the composite's FSDP2 wiring with a GefenMuon child is executed by tests/test_integration_distributed.py; "
    "GefenMuon under FSDP2 by packages/gefen-core/tests/test_core_muon_distributed.py"
)
_MUON_COMPOSITE_WAIVERS = {
    f"training:dtensor_1d_default_world[gefen.muon.sharded_mode={mode},gefen.role=muon]": _COMPOSITE_FSDP2
    for mode in ("exact", "approx", "distributed")
}

#: Target name -> the target. Packaged factories are given by spec (as `gefen conformance` takes them).
TARGETS: dict[str, ConformanceTarget | str] = {
    # Gefen, as the meta-package wires it (kernels when they support the tensors).
    "gefen[default]": ConformanceTarget(_gefen(), "gefen[default]", waive=WAIVERS),
    "gefen[block_v]": ConformanceTarget(_gefen(factored_v_2d=False), "gefen[block_v]", waive=WAIVERS),
    "gefen[stochastic_round,decay]": ConformanceTarget(
        _gefen(stochastic_round=True, weight_decay=0.1), "gefen[stochastic_round,decay]", waive=WAIVERS
    ),
    "gefen[deterministic,period_one_1d]": ConformanceTarget(
        _gefen(deterministic=True, force_1d_period_one=True), "gefen[deterministic,period_one_1d]", waive=WAIVERS
    ),
    "gefen[bf16]": ConformanceTarget(
        _gefen(), "gefen[bf16]", model_builder=_bf16_kit_model, loss_fn=_bf16_loss, waive=WAIVERS
    ),
    "gefen[reference path]": "gefen_core.conformance:factory",
    # GefenMuon (matrices only).
    **{
        f"gefen-muon[{label}]": ConformanceTarget(
            _muon(**options),
            f"gefen-muon[{label}]",
            model_builder=matrix_model,
            loss_fn=matrix_loss,
            waive=MUON_WAIVERS,
        )
        for label, options in {
            "exact": {},
            "distributed": {"sharded_mode": "distributed"},
            "approx": {"sharded_mode": "approx"},
            "normuon,tuned3,match_rms": {"normuon": True, "ns_schedule": "tuned3", "adjust_lr_fn": "match_rms_adamw"},
            "tuned4,cautious,stochastic_round": {"ns_schedule": "tuned4", "cautious": True, "stochastic_round": True},
        }.items()
    },
    "gefen-muon[reference path]": "gefen_core.conformance:muon_factory",
    # GefenMuonHybrid, both backups, the recipes and the main levers.
    "hybrid[gefen backup]": "gefen.integrations.conformance:hybrid_factory",
    "hybrid[adamw backup]": "gefen.integrations.conformance:hybrid_adamw_factory",
    "hybrid[balanced sft]": ConformanceTarget(
        _hybrid(backup_optimizer="adamw", weight_decay=0.01, ns_schedule="tuned3", normuon=True),
        "hybrid[balanced sft]",
        waive=HYBRID_WAIVERS,
    ),
    "hybrid[minimum state]": ConformanceTarget(
        _hybrid(backup_lr=5e-3, backup_1d_period_one=True), "hybrid[minimum state]", waive=HYBRID_WAIVERS
    ),
    "hybrid[quality-first pretraining]": ConformanceTarget(
        _hybrid(backup_optimizer="adamw", ns_schedule="standard", ns_steps=5, normuon=False),
        "hybrid[quality-first pretraining]",
        waive=HYBRID_WAIVERS,
    ),
    "hybrid[distributed mode,no-decay group,factored backup]": ConformanceTarget(
        _hybrid(
            sharded_mode="distributed",
            weight_decay=0.1,
            no_decay_substrings=("bias", "norm"),
            backup_kwargs={"factored_v_2d": True},
        ),
        "hybrid[distributed mode,no-decay group,factored backup]",
        waive=HYBRID_WAIVERS,
    ),
    "hybrid[bf16]": ConformanceTarget(
        _hybrid(), "hybrid[bf16]", model_builder=_bf16_kit_model, loss_fn=_bf16_loss, waive=HYBRID_WAIVERS
    ),
    # ContractedAdamW alone, gefen-hybrid's own composite, the docs' example adopter.
    "contracted-adamw": "gefen_hybrid.conformance:adamw_factory",
    "contracted-adamw[amsgrad,foreach]": "conformance_all_factories:contracted_adamw_amsgrad_foreach",
    "composite[adamw+adamw]": "gefen_hybrid.conformance:composite_factory",
    "example-adopter[contracted-sgd]": "gefen_example_sgd:conformance_factory",
    "composite[gefen-muon+contracted-sgd]": ConformanceTarget(
        _muon_with_example_sgd, "composite[gefen-muon+contracted-sgd]", waive=_MUON_COMPOSITE_WAIVERS
    ),
}


_HYBRID_GLOO = "executed under FSDP2 on 2 gloo ranks by packages/gefen-hybrid/tests/test_hybrid_distributed.py"
#: gefen-hybrid's packaged waivers say where in prose; these name the test module (same claims).
EXTRA_WAIVERS: dict[str, dict[str, str]] = {
    "contracted-adamw": dict.fromkeys(DTENSOR_WAIVERS, _HYBRID_GLOO),
    "contracted-adamw[amsgrad,foreach]": dict.fromkeys(DTENSOR_WAIVERS, _HYBRID_GLOO),
    "composite[adamw+adamw]": dict.fromkeys(
        (
            "training:dtensor_1d_default_world[gefen.role=muon]",
            "training:dtensor_1d_default_world[gefen.role=backup]",
            "checkpoint:composite_native:dtensor_1d_default_world",
            "checkpoint:composite_native:dtensor_1d_default_world:atomic",
        ),
        _HYBRID_GLOO,
    ),
}


def _claims(target: ConformanceTarget | str) -> frozenset[str]:
    from gefen_contracts.testing import load_target

    resolved = load_target(target) if isinstance(target, str) else target
    _, optimizer = resolved.build()
    return frozenset(enumerate_claims(optimizer.optimizer_contract()))  # type: ignore[attr-defined]


def _check_report(report: ConformanceReport, claims: frozenset[str]) -> None:
    assert_conformant(report)
    by_status: dict[CheckStatus, set[str]] = {}
    for result in report.results:
        by_status.setdefault(result.status, set()).add(result.name)
        if result.status is CheckStatus.WAIVED:
            assert NAMES_A_TEST.search(result.detail), f"{result.name}: the waiver names no test: {result.detail!r}"
    passed = by_status.get(CheckStatus.PASSED, set())
    assert {"contract.valid_and_immutable", "training.replicated", "checkpoint.native_roundtrip"} <= passed
    # Every claim is executed by a passed check, or it (or the check that executes it) is waived by
    # name: nothing is left unaccounted for.
    accounted = (CheckStatus.PASSED, CheckStatus.WAIVED)
    covered = {claim for result in report.results if result.status in accounted for claim in result.claims}
    waived = {name.removeprefix("claim ") for name in by_status.get(CheckStatus.WAIVED, set())}
    assert claims - covered - waived - {"contract"} == set(), sorted(claims - covered - waived)


#: The kit's multi-process checks, executed once each elsewhere (they spawn gloo ranks for a minute
#: or more per target, so this all-targets run skips them by name).
MULTI_PROCESS_CHECKS: dict[str, str] = {
    "dcp.parameter_shaped_reshard": (
        "executed on gloo ranks by tests/test_gefen_dcp_state_resharding.py (Gefen, GefenMuon), "
        "tests/test_adamw_composite_resharding.py (ContractedAdamW, the composite) and packages/gefen-dcp/tests/test_dcp_conformance.py"
    ),
    "scope.collective_protocol": (
        "executed on 2 gloo ranks by tests/test_core_conformance.py and tests/test_muon_conformance.py "
        "(the packaged factories)"
    ),
    "portable.reshard": (
        "executed on 3 gloo ranks by tests/test_adamw_composite_conformance.py (ContractedAdamW, the composite), "
        "tests/test_muon_conformance.py (GefenMuon) and tests/test_conformance_portable_gloo.py (a third party)"
    ),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_shipped_optimizer_keeps_the_convention(name: str) -> None:
    target = TARGETS[name]
    report = run_conformance(target, waive={**MULTI_PROCESS_CHECKS, **EXTRA_WAIVERS.get(name, {})})
    _check_report(report, _claims(target))


def test_the_hybrid_makes_the_claims_the_waivers_name() -> None:
    """The waivers are not stale: each hybrid DTensor waiver names a claim the hybrid makes."""
    claims = _claims("gefen.integrations.conformance:hybrid_factory") | _claims(
        TARGETS["hybrid[distributed mode,no-decay group,factored backup]"]
    )
    checks = {name for name in HYBRID_WAIVERS if ":" not in name}  # kit checks, not claims
    assert checks == {"identity.flattened_training"}
    assert any(c.startswith("training:flattened_element_shard[") and "role=backup" in c for c in claims)
    stale = {
        name
        for name in set(HYBRID_WAIVERS) - checks
        if "sharded_mode=approx" not in name  # approx is waived for completeness; no config here claims it
        and name not in claims
    }
    assert stale == set()

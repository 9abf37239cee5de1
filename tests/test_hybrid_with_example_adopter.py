"""The composite composes any two contracted children, including the docs' example adopter."""

from __future__ import annotations

import torch
from gefen_contracts.testing import ConformanceTarget, assert_conformant, run_conformance
from gefen_example_sgd import ContractedSGD
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from torch import nn


def sgd_factory(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return ContractedSGD(named, lr=0.05, momentum=0.9, weight_decay=0.01)


def adamw_factory(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return ContractedAdamW(named, lr=5e-3, weight_decay=0.01)


def composite_factory(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    return CompositeOptimizer.from_factories(named, {"muon": sgd_factory, "backup": adamw_factory})


def test_composite_of_the_example_adopter_and_contracted_adamw_passes_the_kit() -> None:
    waive = {
        "training:dtensor_1d_default_world[gefen.role=backup]": "executed by gefen-hybrid's gloo/FSDP2 tests",
    }
    report = run_conformance(ConformanceTarget(composite_factory, name="sgd+adamw composite"), waive=waive)
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status.value == "passed"}
    assert {"composite.rules", "checkpoint.native_atomic_load", "checkpoint.native_roundtrip"} <= passed


def test_with_a_model_the_embedding_goes_to_the_backup_by_module_type() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = CompositeOptimizer.from_factories(model, {"muon": sgd_factory, "backup": adamw_factory})
    routing = dict(optimizer.parameter_routing())
    assert routing == {"0.weight": "backup", "1.weight": "muon", "1.bias": "backup", "2.weight": "backup", "2.bias": "backup"}

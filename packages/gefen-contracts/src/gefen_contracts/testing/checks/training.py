"""Replicated training claims, executed single-process."""

from __future__ import annotations

import torch

from ...enums import ParameterLayout
from ..claims import training_claim
from ..context import CheckContext

__all__ = ["ReplicatedTrainingCheck"]


class ReplicatedTrainingCheck:
    """Plain tensors train: parameters move, stay finite, and two twins agree bitwise."""

    name = "training.replicated"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        prefix = training_claim(ParameterLayout.REPLICATED.value)
        return frozenset(c for c in claims if c == prefix or c.startswith(prefix + "["))

    def run(self, context: CheckContext) -> None:
        model, optimizer = context.fresh()
        twin_model, twin = context.fresh()
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        context.train(model, optimizer, context.target.steps)
        context.train(twin_model, twin, context.target.steps)
        moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), initial[n])]
        assert moved, "no parameter changed after training steps"
        for name, parameter in model.named_parameters():
            assert torch.isfinite(parameter.detach().float()).all(), f"parameter {name!r} became non-finite"
        context.assert_models_bitwise_equal(model, twin_model, "two identical training runs")

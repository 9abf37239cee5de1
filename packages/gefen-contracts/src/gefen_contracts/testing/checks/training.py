"""Replicated training and precision claims, executed single-process."""

from __future__ import annotations

import torch

from ...enums import CheckpointTransport, ParameterLayout
from ..claims import checkpoint_claim, training_claim
from ..context import CheckContext
from .checkpoint import assert_trees_equal

__all__ = ["PrecisionsCheck", "ReplicatedTrainingCheck"]

_NATIVE_CLAIMS = frozenset(
    checkpoint_claim(t.value, ParameterLayout.REPLICATED.value)
    for t in (CheckpointTransport.NATIVE_OPTIMIZER, CheckpointTransport.COMPOSITE_NATIVE)
)


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


class PrecisionsCheck:
    """Every claimed precision is exercised: the kit model in that dtype trains (parameters
    move, stay finite and keep the dtype) and, where native checkpoints are claimed, a
    weights-only save loads into a twin of that dtype that continues bit for bit."""

    name = "training.precisions"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset(c for c in claims if c.startswith("precision:"))

    def run(self, context: CheckContext) -> None:
        problems = []
        for claim in sorted(self.covers(context.claims)):
            dtype = getattr(torch, claim.partition(":")[2])
            try:
                self._exercise(context, dtype, native=bool(_NATIVE_CLAIMS & context.claims))
            except Exception as exc:
                problems.append(f"{claim} is claimed but {type(exc).__name__}: {exc}")
        assert not problems, "; ".join(problems)
        context.notes.append(f"{len(self.covers(context.claims))} claimed precisions stepped, saved and loaded")

    @staticmethod
    def _exercise(context: CheckContext, dtype: torch.dtype, *, native: bool) -> None:
        steps = context.target.steps
        model, optimizer = context.fresh(0, dtype)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        context.train(model, optimizer, steps)
        assert any(not torch.equal(p.detach(), initial[n]) for n, p in model.named_parameters()), (
            "no parameter changed after training steps"
        )
        for name, parameter in model.named_parameters():
            assert parameter.dtype == dtype, f"parameter {name!r} is {parameter.dtype} after training"
            assert torch.isfinite(parameter.detach().float()).all(), f"parameter {name!r} became non-finite"
        if not native:
            return
        saved = context.weights_only_roundtrip(optimizer.state_dict())
        twin_model, twin = context.fresh(0, dtype)
        context.copy_parameters(model, twin_model)
        twin.load_state_dict(saved)
        context.train(model, optimizer, steps, start=steps)
        context.train(twin_model, twin, steps, start=steps)
        context.assert_models_bitwise_equal(model, twin_model, f"{dtype} continuation after a native round trip")
        assert_trees_equal(optimizer.state_dict(), twin.state_dict(), f"{dtype} state_dict after continuation")

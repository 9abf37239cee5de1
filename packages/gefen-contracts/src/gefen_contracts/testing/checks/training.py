"""Replicated training and precision claims, executed single-process."""

from __future__ import annotations

import copy
import pickle

import torch

from ...enums import CheckpointTransport, ParameterLayout
from ..claims import checkpoint_claim, rank_claim, training_claim
from ..context import CheckContext
from .checkpoint import assert_trees_equal
from .state import check_state_matches

__all__ = ["CopiesCheck", "ParameterRanksCheck", "PrecisionsCheck", "ReplicatedTrainingCheck"]

#: One parameter shape of each rank the kit exercises (``ranks:N`` claims).
RANK_SHAPES = {0: (), 1: (6,), 2: (4, 6), 3: (2, 3, 4), 4: (2, 2, 3, 2)}

_NATIVE_CLAIMS = frozenset(
    checkpoint_claim(t.value, ParameterLayout.REPLICATED.value)
    for t in (CheckpointTransport.NATIVE_OPTIMIZER, CheckpointTransport.COMPOSITE_NATIVE)
)


class ReplicatedTrainingCheck:
    """Plain tensors train: parameters move, stay finite, and two twins agree bitwise; a third
    twin whose groups' ``lr`` is halved after its first step (as a scheduler does) ends
    elsewhere (a step that reads ``lr`` from ``defaults`` or a copy ignores a schedule)."""

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
        if context.target.steps < 2:
            context.notes.append("an lr edit between steps not exercised: the target trains one step")
            return
        scheduled_model, scheduled = context.fresh()
        context.train(scheduled_model, scheduled, 1)
        halved = 0
        for group in scheduled.param_groups:
            rate = group.get("lr")
            if isinstance(rate, torch.Tensor):
                rate.mul_(0.5)  # in place, as a scheduler updates a tensor rate
            elif isinstance(rate, float):
                group["lr"] = rate * 0.5
            else:
                continue
            halved += 1
        if not halved:
            context.notes.append("an lr edit between steps not exercised: no group holds a float or tensor 'lr'")
            return
        context.train(scheduled_model, scheduled, context.target.steps - 1, start=1)
        assert any(
            not torch.equal(a.detach(), b.detach())
            for a, b in zip(model.parameters(), scheduled_model.parameters(), strict=True)
        ), "halving every group's lr after the first step changed nothing: step() does not read param_groups' lr"


class CopiesCheck:
    """A trained optimizer survives ``copy.deepcopy`` and a pickle round trip, taken with its
    model as torch's optimizers are (EMA and lookahead copies, ``torch.save(optimizer)``):
    each copy continues bit for bit as an uncopied twin does, its parameter groups hold the
    copied model's parameters, and the original, stepped after its copies, still matches the
    twin (they share no storage). torch keeps only ``defaults``, ``state`` and
    ``param_groups`` through a copy, so an attribute set in ``__init__`` and read by ``step``
    is lost unless ``__getstate__``/``__setstate__`` carry or rebuild it."""

    name = "training.copies"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return ReplicatedTrainingCheck().covers(claims)

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model, optimizer = context.trained()
        copies = {"copy.deepcopy": copy.deepcopy((model, optimizer))}
        try:
            pickled = pickle.dumps((model, optimizer))
        except Exception as exc:
            # the model is the target's own: a model pickle cannot take is no finding against
            # the optimizer, and deepcopy (above) still exercises the optimizer's own state
            pickled = None
            context.notes.append(f"pickle not exercised: the model or optimizer does not pickle ({exc!r})")
        if pickled is not None:
            copies["a pickle round trip"] = pickle.loads(pickled)
        twin_model, twin = context.trained()
        context.train(twin_model, twin, steps, start=steps)
        for how, (copied_model, copied) in copies.items():
            held = {id(p) for group in copied.param_groups for p in group["params"]}
            assert held == {id(p) for p in copied_model.parameters()}, (
                f"after {how} the optimizer's groups do not hold the copied model's parameters"
            )
            try:
                context.train(copied_model, copied, steps, start=steps)
            except Exception as exc:
                raise AssertionError(f"the optimizer cannot step after {how}: {type(exc).__name__}: {exc}") from exc
            context.assert_models_bitwise_equal(copied_model, twin_model, f"continuation after {how}")
            assert_trees_equal(copied.state_dict(), twin.state_dict(), f"state_dict after {how} and continuation")
        context.train(model, optimizer, steps, start=steps)
        context.assert_models_bitwise_equal(model, twin_model, "the original, stepped after its copies were")
        context.notes.append(f"{' and '.join(copies)} continued bit for bit")


class PrecisionsCheck:
    """Every claimed precision is exercised: the kit model in that dtype trains (parameters
    move, stay finite and keep the dtype; the state matches its declared variants, dtypes
    and shapes in that precision too) and, where native checkpoints are claimed, a
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
        check_state_matches(optimizer, f"{dtype} training")
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


class ParameterRanksCheck:
    """Every claimed parameter rank trains: a parameter of that rank (its own optimizer, from
    the target's factory) moves and stays finite over the target's steps, and its state
    matches the declared variants, dtypes and shapes at that rank. The kit model has
    1-D and 2-D parameters only, so without this a contract claiming every rank was never
    held to it."""

    name = "training.parameter_ranks"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        # a rank without a shape here (5-D and up) stays unverified rather than covered unexecuted
        return frozenset(rank_claim(rank) for rank in RANK_SHAPES) & claims

    def run(self, context: CheckContext) -> None:
        problems = []
        ranks = sorted(rank for rank in RANK_SHAPES if rank_claim(rank) in context.claims)
        for rank in ranks:
            generator = torch.Generator().manual_seed(100 + rank)
            parameter = torch.nn.Parameter(torch.randn(RANK_SHAPES[rank], generator=generator))
            initial = parameter.detach().clone()
            try:
                optimizer = context.target.factory([(f"rank{rank}.weight", parameter)])
                for _ in range(context.target.steps):
                    optimizer.zero_grad(set_to_none=True)
                    parameter.grad = torch.randn(RANK_SHAPES[rank], generator=generator)
                    optimizer.step()
                check_state_matches(optimizer, f"a {rank}-D parameter")
            except Exception as exc:
                problems.append(
                    f"{rank_claim(rank)} is claimed but a {rank}-D parameter raised {type(exc).__name__}: {exc}"
                )
                continue
            if not torch.isfinite(parameter.detach()).all():
                problems.append(f"a {rank}-D parameter became non-finite")
            elif torch.equal(parameter.detach(), initial):
                problems.append(f"a {rank}-D parameter did not move")
        assert not problems, "; ".join(problems)
        context.notes.append(f"parameters of ranks {ranks} stepped")

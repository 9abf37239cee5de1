"""Bound twins for the identity checks: optimizers finalized by ``post_sharding`` on the kit's
own plans, and a single-process stand-in for a two-member flattened layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..context import CheckContext, assert_tensors_bitwise_equal
from .plans import (
    ShardingPlan,
    flattened_plan,
    gather_flat,
    install_parameters,
    replicated_copy_plan,
    scatter_flat_grads,
)

__all__ = [
    "BoundTwin",
    "FlatWorld",
    "assert_tensors_bitwise_equal",
    "build_model_and_optimizer",
    "flat_step",
    "named_trainable",
]


def named_trainable(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def build_model_and_optimizer(
    context: CheckContext, seed: int = 0, *, reverse: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer; ``reverse`` hands the factory the parameters in reverse
    order (a reordered target: every slot position differs)."""
    torch.manual_seed(seed)
    model = context.target.model_builder(seed)
    named = named_trainable(model)
    if reverse:
        named = named[::-1]
    return model, context.target.factory(named)  # type: ignore[arg-type]


@dataclass
class BoundTwin:
    """A model whose parameters were replaced by the rebound copies, and its finalized optimizer."""

    model: nn.Module
    optimizer: Any
    plan: ShardingPlan

    @classmethod
    def replicated(cls, context: CheckContext, seed: int = 0, *, reverse: bool = False) -> BoundTwin:
        """Fresh model and optimizer, every parameter rebound to an identical copy."""
        model, optimizer = build_model_and_optimizer(context, seed, reverse=reverse)
        named = named_trainable(model)
        plan = replicated_copy_plan(named)
        optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)  # type: ignore[attr-defined]
        install_parameters(model, {id(p): plan.targets[name] for name, p in named})
        return cls(model, optimizer, plan)


class FlatWorld:
    """Two members of a flattened layout in one process: member ``m``'s optimizer is built on
    the full parameters and rebound to member ``m``'s slices (``bound=True``), or built
    directly on the slices (``bound=False``). With ``whole_last`` the last parameter lives
    wholly on member 0, so member 1 holds an empty shard of it; without, every parameter is
    cut near-evenly (the kit model's shards are then of equal size on both members, which a
    cross-member refusal needs: a size check alone cannot refuse them).
    """

    MEMBERS = 2

    def __init__(
        self,
        context: CheckContext,
        *,
        bound: bool = True,
        reverse: bool = False,
        values: dict[str, torch.Tensor] | None = None,
        whole_last: bool = True,
    ) -> None:
        self.context = context
        self.plans: list[ShardingPlan] = []
        self.optimizers: list[Any] = []
        for member in range(self.MEMBERS):
            model, built = build_model_and_optimizer(context, 0, reverse=reverse)
            optimizer: Any = built
            named = named_trainable(model)
            whole = [named[-1][0]] if whole_last else []
            plan = flattened_plan(named, member, whole_to_first=whole, values=values)
            if bound:
                optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
            else:
                targets = plan.named_targets()
                optimizer = context.target.factory(targets[::-1] if reverse else targets)  # type: ignore[arg-type]
            self.plans.append(plan)
            self.optimizers.append(optimizer)

    def compare(self, other: FlatWorld, what: str) -> None:
        """Every member's shards equal ``other``'s, bit for bit."""
        for member, (mine, theirs) in enumerate(zip(self.plans, other.plans)):
            for name, tensor in mine.targets.items():
                assert_tensors_bitwise_equal(tensor, theirs.targets[name], f"{what}: member {member} shard of {name!r}")

    def values(self, driver: nn.Module) -> dict[str, torch.Tensor]:
        """The full parameter values this world holds (gathered into ``driver``)."""
        gather_flat(driver, self.plans)
        return {name: p.detach().clone() for name, p in driver.named_parameters()}


def flat_step(driver: nn.Module, step_index: int, source: FlatWorld, worlds: Sequence[FlatWorld]) -> None:
    """One step of every world with the gradient of ``source``'s current values."""
    gather_flat(driver, source.plans)
    driver.zero_grad(set_to_none=True)
    source.context.target.loss_fn(driver, step_index).backward()  # type: ignore[no-untyped-call]
    for world in worlds:
        for plan, optimizer in zip(world.plans, world.optimizers):
            scatter_flat_grads(driver, plan, plan.targets)
            optimizer.step()

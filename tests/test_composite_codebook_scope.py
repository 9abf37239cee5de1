"""A CompositeOptimizer of GefenMuon (matrices) and Gefen (the rest) under one codebook scope,
in two gloo processes: the composite hands the scope to both children, scoped training is
bit-exact with one process, and a one-rank failure raises on every rank.

(Two siblings, gefen-core and gefen-hybrid, so the test lives at the top level.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any
from unittest import mock

import pytest
import torch
from gefen_contracts import CollectiveFailureError
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import (
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.testing import GlooWorld, deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CodebookProcessGroupBinding, CollectiveCounter
from gefen_core import Gefen, GefenMuon
from gefen_hybrid import CompositeOptimizer
from torch import nn

pytestmark = pytest.mark.distributed

MATRICES = ("a", "b", "c")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(16, 24) * 0.5)
        self.a = nn.Parameter(torch.randn(24, 16) * 0.2)
        self.b = nn.Parameter(torch.randn(16, 24) * 0.2)
        self.c = nn.Parameter(torch.randn(24, 24) * 0.2)
        self.bias = nn.Parameter(torch.zeros(24))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        return torch.tanh(torch.tanh(hidden @ self.c) @ self.a) @ self.b + self.bias


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _backward(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(40 + step)
    tokens = torch.randint(0, 16, (6, 5), generator=generator)
    target = torch.randn(6, 24, generator=generator)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(tokens), target).backward()  # type: ignore[no-untyped-call]


def _composite(model: nn.Module) -> CompositeOptimizer:
    named = list(model.named_parameters())
    split = {
        "muon": [(n, p) for n, p in named if n in MATRICES],
        "backup": [(n, p) for n, p in named if n not in MATRICES],
    }
    factories = {
        "muon": lambda params: GefenMuon(params, lr=1e-2, fused=False),
        "backup": lambda params: Gefen(params, lr=1e-2, fused=False),
    }
    return CompositeOptimizer.from_factories(split, factories)


def _bind(model: nn.Module, optimizer: CompositeOptimizer, rank: int, world: int) -> None:
    """Every parameter REPLICATED over the world group, bound in place, with a codebook scope."""
    members = tuple(f"rank:{r}" for r in range(world))
    group = ProcessGroupIdentity("dp", members)
    import torch.distributed as dist

    scope = CodebookProcessGroupBinding(group, members[rank], dist.group.WORLD, torch.device("cpu"))
    rebindings, shards = [], []
    for name, parameter in model.named_parameters():
        identity = ParameterIdentity(name, tuple(parameter.shape))
        for member in range(world):
            placement = ShardPlacement("dp", PlacementKind.REPLICATE, member, world)
            shard = ShardIdentity(
                identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity), (placement,), group, members[member]
            )
            shards.append(shard)
            if member == rank:
                rebindings.append(ParameterRebinding(parameter, parameter, shard))
    optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), scope=scope)


def rank_scoped_composite(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, oracle_model = _net(), _net()
    optimizer, oracle = _composite(model), _composite(oracle_model)
    _bind(model, optimizer, rank, world)
    scopes = {role: child.collective_scope() for role, child in optimizer.child_optimizers().items()}  # type: ignore[attr-defined]
    counter = CollectiveCounter()
    for step in range(3):
        _backward(model, step)
        _backward(oracle_model, step)
        oracle.step()
        if step == 2:
            with counter.patched():
                optimizer.step()
        else:
            optimizer.step()
    exact = all(torch.equal(p, q) for p, q in zip(model.parameters(), oracle_model.parameters(), strict=True))
    _backward(model, 3)
    before = deep_snapshot(optimizer, model)

    # rank 0's scoped child fails its gradient preflight (the plan it makes before the header)
    scoped = next(child for role, child in optimizer.child_optimizers().items() if scopes[role] is not None)  # type: ignore[attr-defined]
    failure = RuntimeError("injected failure")
    try:
        with mock.patch.object(type(scoped._binding), "plan", side_effect=failure) if rank == 0 else nullcontext():
            optimizer.step()
        raised = None
    except CollectiveFailureError as exc:
        raised = ("CollectiveFailureError", exc.local)
    except Exception as exc:
        raised = (type(exc).__name__, str(exc))
    # The composite's change counter is a freshness token (bumped by its children's step
    # pre-hooks so staged transactions go stale); it is not state, so it may advance.
    diffs = [d for d in snapshot_diff(before, optimizer, model) if not d.startswith("root0._changes.")]
    optimizer.step()  # the retry succeeds on every rank
    return {
        "exact": exact,
        "scoped_children": sorted(role for role, scope in scopes.items() if scope is not None),
        "steady_collectives": counter.total,
        "raised": raised,
        "diffs": diffs[:3],
    }


def kit_composite_factory(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The kit's target: GefenMuon on the kit model's matrices, Gefen on the rest (routed by the composite)."""
    return CompositeOptimizer.from_factories(
        named,
        {
            "muon": lambda params: GefenMuon(params, lr=1e-2, fused=False),
            "backup": lambda params: Gefen(params, lr=1e-2, fused=False),
        },
    )


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(2) as gloo:
        yield gloo


def test_a_scoped_gefen_composite_trains_like_one_process_and_fails_together(world: GlooWorld) -> None:
    results = world.run(rank_scoped_composite)
    for rank, result in enumerate(results):
        assert result["scoped_children"] == ["backup", "muon"]
        assert result["exact"], "the scoped composite must train bit-exactly like one process"
        assert result["raised"] == ("CollectiveFailureError", rank == 0), result
        assert result["diffs"] == [], result["diffs"]
    assert results[0]["steady_collectives"] == results[1]["steady_collectives"]


def test_the_composite_does_not_claim_collective_scope_and_says_why() -> None:
    """Both Gefen children claim ``collective_scope``, but the composite does not implement
    ``CollectiveScoped`` itself (no ``collective_budget()``), so it does not claim it and the kit's
    scope check does not apply to it; it still hands its scope binding to both children (above)."""
    from gefen_contracts.testing.model import make_kit_model

    optimizer = kit_composite_factory(list(make_kit_model(0).named_parameters()))
    status = optimizer.optimizer_contract().capabilities.feature("collective_scope")  # type: ignore[attr-defined]
    assert not status.supported and "CollectiveScoped" in status.reasons[0]
    for child in optimizer.child_optimizers().values():  # type: ignore[attr-defined]
        assert child.optimizer_contract().capabilities.supports("collective_scope")

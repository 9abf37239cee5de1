"""The conformance check of the ``collective_scope`` claim, contributed to the kit through the
``gefen.conformance`` entry-point group (``gefen_core = "gefen_core.scope_conformance:checks"``).

``scope.collective_protocol`` executes ``feature:collective_scope`` for any importable
target (``MODULE:FACTORY``) in two gloo processes. Each rank builds the target's model and
optimizer (same seed, same data), rebinds every parameter to a ``REPLICATED`` copy whose
shard names the world group, and installs a ``CodebookProcessGroupBinding`` over it with
``post_sharding(..., scope=binding)``. Then:

* scoped training is bit-identical to the same optimizer in one process (each logical
  parameter counts once in whatever is learned collectively, so replicas learn what one
  process learns), and the replicas stay identical;
* a steady-state ``step()`` runs at most ``collective_budget()`` host-synchronising
  collectives (counted by wrapping ``torch.distributed``);
* a closure that fails on rank 0 only makes every rank raise
  ``gefen_contracts.CollectiveFailureError`` (``local`` only on rank 0) with every rank's
  optimizer and model unchanged (deep snapshot), and the next step succeeds everywhere.

Without an importable target or ``torch.distributed`` the claim stays unverified.
"""

from __future__ import annotations

from typing import Any

import torch
from gefen_contracts import FEATURE_COLLECTIVE_SCOPE, CollectiveFailureError
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
from gefen_contracts.testing import (
    CheckContext,
    ConformanceCheck,
    GlooWorld,
    deep_snapshot,
    install_parameters,
    snapshot_diff,
)
from gefen_contracts.testing.context import Unverifiable
from gefen_contracts.testing.target import load_target

__all__ = ["CollectiveScopeCheck", "checks", "scoped_rank"]

_CLAIM = f"feature:{FEATURE_COLLECTIVE_SCOPE}"
_STEPS = 3


def _bind(model: torch.nn.Module, optimizer: Any, rank: int, world_size: int) -> None:
    """Rebind every trainable parameter to a REPLICATED copy over the world group, with a scope."""
    import torch.distributed as dist
    from gefen_contracts.torch_support import CodebookProcessGroupBinding

    members = tuple(f"rank:{r}" for r in range(world_size))
    group = ProcessGroupIdentity("kit.scope", members)
    rebindings, shards, copies = [], [], {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        identity = ParameterIdentity(name, tuple(parameter.shape))
        for member in range(world_size):
            placement = ShardPlacement("kit", PlacementKind.REPLICATE, member, world_size)
            full = LogicalSlice.full(identity)
            shards.append(
                ShardIdentity(identity, ParameterLayout.REPLICATED, full, (placement,), group, members[member])
            )
        copy = torch.nn.Parameter(parameter.detach().clone())
        rebindings.append(ParameterRebinding(parameter, copy, shards[-world_size + rank]))
        copies[id(parameter)] = copy
    scope = CodebookProcessGroupBinding(group, members[rank], dist.group.WORLD, torch.device("cpu"))
    optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), scope=scope)
    install_parameters(model, copies)


def scoped_rank(rank: int, world_size: int, spec: str) -> dict[str, Any]:
    """(A gloo rank function.) Train the target under a scope and inject a rank-0 closure failure."""
    import torch.distributed as dist
    from gefen_contracts.torch_support import CollectiveCounter

    target = load_target(spec)
    torch.manual_seed(0)
    model, built = target.build(0)
    optimizer: Any = built  # claims collective_scope (the check covers nothing else)
    torch.manual_seed(0)
    twin_model, twin = target.build(0)
    _bind(model, optimizer, rank, world_size)

    def train(m: torch.nn.Module, o: Any, index: int) -> None:
        o.zero_grad(set_to_none=True)
        target.loss_fn(m, index).backward()  # type: ignore[no-untyped-call]
        o.step()

    counter = CollectiveCounter()
    for index in range(_STEPS):
        train(twin_model, twin, index)
        if index == _STEPS - 1:
            with counter.patched():
                train(model, optimizer, index)
        else:
            train(model, optimizer, index)
    values = [p.detach().clone() for p in model.parameters()]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, values)
    replicas_equal = all(all(torch.equal(a, b) for a, b in zip(values, other, strict=True)) for other in everyone)
    before = deep_snapshot(optimizer, model)

    def closure() -> torch.Tensor:
        if rank == 0:
            raise RuntimeError("kit: injected closure failure")
        return torch.zeros(())

    try:
        optimizer.step(closure)
        raised: tuple[str, bool | None] = ("nothing", None)
    except CollectiveFailureError as exc:
        raised = ("CollectiveFailureError", exc.local)
    except Exception as exc:
        raised = (f"{type(exc).__name__}: {exc}", None)
    diffs = snapshot_diff(before, optimizer, model)[:3]
    try:
        train(model, optimizer, _STEPS)
        retry = "ok"
    except Exception as exc:
        retry = f"{type(exc).__name__}: {exc}"
    return {
        "trained_like_one_process": all(
            a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.detach().view(torch.uint8))
            for a, b in zip(values, twin_model.parameters(), strict=True)
        ),
        "replicas_equal": replicas_equal,
        "steady_collectives": counter.total,
        "budget": optimizer.collective_budget(),
        "raised": raised,
        "diffs": diffs,
        "retry": retry,
    }


class CollectiveScopeCheck:
    """``scope.collective_protocol`` (module docstring)."""

    name = "scope.collective_protocol"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({_CLAIM}) & claims

    def run(self, context: CheckContext) -> None:
        spec = context.target.spec
        if spec is None:
            raise Unverifiable("the scope protocol needs an importable MODULE:FACTORY target for spawned ranks")
        if not torch.distributed.is_available():
            raise Unverifiable("torch.distributed is not available")
        with GlooWorld(2) as world:
            results = world.run(scoped_rank, spec)
        problems = []
        for rank, result in enumerate(results):
            if not result["trained_like_one_process"]:
                problems.append(f"rank {rank}: scoped replicated training differs from one process")
            if not result["replicas_equal"]:
                problems.append(f"rank {rank}: the replicas diverged")
            if result["steady_collectives"] > result["budget"]:
                problems.append(
                    f"rank {rank}: a steady step ran {result['steady_collectives']} collectives, more than "
                    f"collective_budget() = {result['budget']}"
                )
            if result["raised"] != ("CollectiveFailureError", rank == 0):
                problems.append(f"rank {rank}: a rank-0 closure failure raised {result['raised']}")
            if result["diffs"]:
                problems.append(f"rank {rank}: the failed step changed {result['diffs']}")
            if result["retry"] != "ok":
                problems.append(f"rank {rank}: the step after the failure raised {result['retry']}")
        assert not problems, "; ".join(problems)
        context.notes.append(
            f"2 gloo ranks: bit-exact with one process, {results[0]['steady_collectives']} collective(s) per steady "
            f"step (budget {results[0]['budget']}), a rank-0 closure failure raised on both ranks unchanged"
        )


def checks() -> list[ConformanceCheck]:
    """The checks gefen-core contributes to the conformance kit."""
    return [CollectiveScopeCheck()]

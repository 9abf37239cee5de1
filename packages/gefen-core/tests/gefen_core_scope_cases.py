"""Rank functions for the codebook-scope tests (run inside gloo ranks; importable by name).

Every rank builds the same full "driver" model (same seed, same data), computes the full
gradient, and hands its optimizer its own pieces: replicated parameters whole, flattened ones
as this member's contiguous slice, whole-parameter ones only on their owner. A single-process
optimizer over the driver's full parameters is the oracle.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CodebookProcessGroupBinding, CollectiveCounter
from gefen_core import Gefen
from gefen_core.param_state import period_of

LR = 1e-2
AXIS = "dp"
#: What ``torch.amp.GradScaler`` sets on an optimizer for one step (inputs, not state).
SCALER_ATTRIBUTES = ("grad_scale", "found_inf")


def members(world: int) -> tuple[str, ...]:
    return tuple(f"rank:{r}" for r in range(world))


def binding(rank: int, world: int, name: str = "dp") -> CodebookProcessGroupBinding:
    group = dist.group.WORLD if world > 1 else None
    return CodebookProcessGroupBinding(
        ProcessGroupIdentity(name, members(world)), f"rank:{rank}", group, torch.device("cpu")
    )


# -- plans ----------------------------------------------------------------------------------------


@dataclass
class Spec:
    """How one parameter is laid out: ``"repl"``, ``"flat"`` (with the members' cut points) or
    ``"owner"`` (with the owning rank)."""

    layout: str
    cuts: tuple[int, ...] = ()
    owner: int = 0


def even_cuts(numel: int, world: int) -> tuple[int, ...]:
    size = -(-numel // world)
    return tuple(min(numel, size * r) for r in range(1, world))


def _shards(name: str, shape: tuple[int, ...], spec: Spec, world: int, group_name: str) -> list[ShardIdentity]:
    identity = ParameterIdentity(name, shape)
    group = ProcessGroupIdentity(group_name, members(world))
    out = []
    if spec.layout == "repl":
        for r in range(world):
            placement = ShardPlacement(AXIS, PlacementKind.REPLICATE, r, world)
            out.append(
                ShardIdentity(
                    identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity), (placement,), group, f"rank:{r}"
                )
            )
    elif spec.layout == "flat":
        bounds = (0, *spec.cuts, identity.numel)
        for r in range(world):
            placement = ShardPlacement(AXIS, PlacementKind.FLAT_SHARD, r, world)
            extent = LogicalSlice(bounds[r], bounds[r + 1] - bounds[r])
            out.append(
                ShardIdentity(
                    identity, ParameterLayout.FLATTENED_ELEMENT_SHARD, extent, (placement,), group, f"rank:{r}"
                )
            )
    else:
        for r in range(world):
            placement = ShardPlacement(AXIS, PlacementKind.WHOLE_PARAMETER_OWNER, r, world)
            extent = LogicalSlice.full(identity) if r == spec.owner else LogicalSlice(0, 0)
            out.append(
                ShardIdentity(
                    identity,
                    ParameterLayout.WHOLE_PARAMETER_OWNER,
                    extent,
                    (placement,),
                    group,
                    f"rank:{r}",
                    owner=f"rank:{spec.owner}",
                )
            )
    return out


@dataclass
class Bound:
    """A rank's optimizer over its pieces of ``driver`` and how to feed it gradients."""

    optimizer: Any
    pieces: dict[str, torch.Tensor | None]
    shards: dict[str, ShardIdentity]
    manifest: ShardingManifest

    def feed(self, driver: torch.nn.Module) -> None:
        """Give every local piece its part of the driver's full gradient."""
        for name, parameter in driver.named_parameters():
            piece = self.pieces[name]
            if piece is None:
                continue
            grad = parameter.grad
            if grad is None:
                piece.grad = None
                continue
            piece.grad = _local(grad, self.shards[name]).clone()

    def values(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.pieces.items() if p is not None}


def _local(full: torch.Tensor, shard: ShardIdentity) -> torch.Tensor:
    extent = shard.extent
    assert type(extent) is LogicalSlice
    if shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        return full.detach().reshape(-1)[extent.flat_offset : extent.end]
    return full.detach()


def bind(
    driver: torch.nn.Module,
    layouts: dict[str, Spec],
    rank: int,
    world: int,
    factory: Callable[[list[tuple[str, torch.nn.Parameter]]], Any],
    *,
    scope: CodebookProcessGroupBinding | None,
    group_name: str = "dp",
) -> Bound:
    """Build ``factory`` over copies of the driver's parameters and post-shard it to this rank's pieces."""
    named = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in driver.named_parameters()]
    optimizer = factory(named)
    rebindings, all_shards, pieces, local = [], [], {}, {}
    for name, parameter in named:
        shards = _shards(name, tuple(parameter.shape), layouts[name], world, group_name)
        all_shards.extend(shards)
        mine = shards[rank]
        local[name] = mine
        if mine.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not mine.is_owner:
            target = None
        else:
            target = torch.nn.Parameter(_local(parameter, mine).clone())
        pieces[name] = target
        rebindings.append(ParameterRebinding(parameter, target, mine))
    manifest = ShardingManifest(tuple(all_shards))
    optimizer.post_sharding(rebindings, manifest=manifest, scope=scope)
    return Bound(optimizer, pieces, local, manifest)


# -- models and data ----------------------------------------------------------------------------


class Net(torch.nn.Module):
    """Embedding, two projections and a bias; the 2-D weights have power-of-two sizes so that
    even cuts fall on block boundaries for every power-of-two period."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(16, 32) * 0.5)
        self.up = torch.nn.Parameter(torch.randn(128, 32) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(128, 32) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        return torch.tanh(hidden @ self.up.T) @ self.down + self.bias


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def backward(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 16, (8, 5), generator=generator)
    target = torch.randn(8, 32, generator=generator)
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(tokens), target)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss.detach()


def gefen_factory(**options: Any) -> Callable[[list[tuple[str, torch.nn.Parameter]]], Any]:
    def build(named: list[tuple[str, torch.nn.Parameter]]) -> Gefen:
        return Gefen(named, lr=LR, fused=False, factored_v_2d=False, **options)

    return build


def layouts_for(world: int) -> dict[str, Spec]:
    """Replicated embedding and bias; the 4096-element weights cut at 2048 (a multiple of every
    possible period), so with three members the middle one holds empty shards."""
    cuts = (2048,) if world == 2 else (2048,) * (world - 1)
    return {
        "embed": Spec("repl"),
        "up": Spec("flat", cuts),
        "down": Spec("flat", cuts),
        "bias": Spec("repl"),
    }


def save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _equal_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def sync_driver(driver: torch.nn.Module, bound: Bound, world: int) -> None:
    """What an adapter's all-gather does after a step: the driver takes every member's pieces."""
    mine = {name: (bound.shards[name], p.detach().clone()) for name, p in bound.pieces.items() if p is not None}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    with torch.no_grad():
        for name, parameter in driver.named_parameters():
            for pieces in everyone:
                if name in pieces:
                    shard, value = pieces[name]
                    _local(parameter, shard).copy_(value)


def _expected(driver: torch.nn.Module, bound: Bound) -> dict[str, torch.Tensor]:
    return {
        name: _local(p, bound.shards[name]).clone() for name, p in driver.named_parameters() if name in bound.pieces
    }


def train_beside_oracle(
    oracle_model: torch.nn.Module,
    oracle: Any,
    driver: torch.nn.Module,
    bound: Bound,
    world: int,
    steps: int,
    loss: Callable[[torch.nn.Module, int], object] = backward,
) -> None:
    """``steps`` steps of the one-process oracle and of this member's bound pieces on the same
    batches, the driver synced with every member's pieces after each."""
    for step in range(steps):
        loss(oracle_model, step)
        oracle.step()
        loss(driver, step)
        bound.feed(driver)
        bound.optimizer.step()
        sync_driver(driver, bound, world)


# -- cases ----------------------------------------------------------------------------------------


def scoped_training_matches_one_process(
    rank: int, world: int, steps: int = 4, refresh_every: int = 0
) -> dict[str, Any]:
    """Replicated and flattened pieces under a scope train bit-exactly like one process over the
    complete parameters (even cuts on block boundaries); the codebook agrees everywhere."""
    driver = make_net()
    oracle_model = make_net()
    oracle = gefen_factory(codebook_refresh_every=refresh_every)(list(oracle_model.named_parameters()))
    bound = bind(
        driver,
        layouts_for(world),
        rank,
        world,
        gefen_factory(codebook_refresh_every=refresh_every),
        scope=binding(rank, world),
    )
    train_beside_oracle(oracle_model, oracle, driver, bound, world, steps)
    exact = _equal_values(bound.values(), _expected(oracle_model, bound))
    codebooks: list[Any] = [None] * world
    dist.all_gather_object(codebooks, save(bound.optimizer.codebook))
    periods = {
        bound.shards[name].fqn: period_of(bound.optimizer.state[p])
        for name, p in bound.pieces.items()
        if p is not None and bound.optimizer.state.get(p)
    }
    oracle_periods = {name: period_of(oracle.state[p]) for name, p in oracle_model.named_parameters()}
    return {
        "exact": exact,
        "codebook_equal_oracle": torch.equal(bound.optimizer.codebook, oracle.codebook),
        "codebooks_agree": all(c == codebooks[0] for c in codebooks),
        "periods": periods,
        "oracle_periods": oracle_periods,
        "global_step": bound.optimizer.global_step,
    }


def initialize_and_refresh_match_one_process(rank: int, world: int) -> dict[str, Any]:
    """``initialize_collective_state`` equals one process's over the concatenated gradients; after steps,
    ``refresh_collective_state`` equals one process's refresh, and training continues bit-exactly."""
    driver = make_net()
    oracle_model = make_net()
    oracle = gefen_factory()(list(oracle_model.named_parameters()))
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    backward(oracle_model, 0)
    backward(driver, 0)
    bound.feed(driver)
    results: dict[str, Any] = {}
    results["initialized"] = (bound.optimizer.initialize_collective_state(), oracle.initialize_collective_state())
    results["init_equal"] = torch.equal(bound.optimizer.codebook, oracle.codebook)
    results["init_again"] = bound.optimizer.initialize_collective_state()
    for step in range(3):
        if step:
            backward(oracle_model, step)
            backward(driver, step)
            bound.feed(driver)
        oracle.step()
        bound.optimizer.step()
        sync_driver(driver, bound, world)
    backward(oracle_model, 7)
    backward(driver, 7)
    bound.feed(driver)
    before = bound.optimizer.codebook
    results["refreshed"] = (bound.optimizer.refresh_collective_state(), oracle.refresh_collective_state())
    results["refresh_changed"] = not torch.equal(before, bound.optimizer.codebook)
    results["refresh_equal"] = torch.equal(bound.optimizer.codebook, oracle.codebook)
    oracle.step()
    bound.optimizer.step()
    results["exact_after_refresh"] = _equal_values(bound.values(), _expected(oracle_model, bound))
    return results


def collective_counts(rank: int, world: int) -> dict[str, Any]:
    """Collectives per scoped operation, counted by wrapping ``torch.distributed``."""
    driver = make_net()
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    counts: dict[str, Any] = {"budget": bound.optimizer.collective_budget()}

    def counted(label: str, action: Callable[[], object]) -> None:
        counter = CollectiveCounter()
        with counter.patched():
            action()
        counts[label] = counter.total

    backward(driver, 0)
    bound.feed(driver)
    counted("learning_step", bound.optimizer.step)
    for step in (1, 2):
        backward(driver, step)
        bound.feed(driver)
        counted(f"steady_step_{step}", bound.optimizer.step)

    def closure() -> torch.Tensor:
        loss = backward(driver, 3)
        bound.feed(driver)
        return loss

    counted("steady_step_with_closure", lambda: bound.optimizer.step(closure))
    backward(driver, 4)
    bound.feed(driver)
    counted("refresh", bound.optimizer.refresh_collective_state)
    counted("initialize_existing", bound.optimizer.initialize_collective_state)
    return counts


# -- outcomes and checkpoints ----------------------------------------------------------------------


def _outcome(action: Callable[[], object], roots: Sequence[Any]) -> dict[str, Any]:
    before = deep_snapshot(*roots)
    scaler = {name: getattr(roots[0], name) for name in SCALER_ATTRIBUTES if hasattr(roots[0], name)}
    try:
        action()
        result: dict[str, Any] = {"raised": None}
    except CollectiveFailureError as exc:
        result = {"raised": "CollectiveFailureError", "local": exc.local, "phase": exc.phase, "message": str(exc)}
    except Exception as exc:
        result = {"raised": type(exc).__name__, "message": str(exc)}
    # a raising step drops the gradient scaler's inputs (forget_scaler_state): put them back
    # so that the snapshot compares the optimizer's own state
    result["scaler_dropped"] = [name for name in scaler if not hasattr(roots[0], name)]
    for name, value in scaler.items():
        setattr(roots[0], name, value)
    result["diffs"] = snapshot_diff(before, *roots)[:3]
    return result


def checkpoints(rank: int, world: int) -> dict[str, Any]:
    """Native checkpoints carry the rank-neutral scope record and a rank-local shard guard; the
    same member resumes bit-exactly; another member's checkpoint is refused; canonical local
    documents round-trip and another member's document is refused. The driver stays fixed
    (it only supplies the gradients of each step)."""
    driver = make_net()
    layouts = layouts_for(world)

    def fresh(scope: bool = True) -> Bound:
        return bind(make_net(), layouts, rank, world, gefen_factory(), scope=binding(rank, world) if scope else None)

    def train(bound: Bound, steps: range) -> None:
        for step in steps:
            backward(driver, step)
            bound.feed(driver)
            bound.optimizer.step()

    straight = fresh()
    train(straight, range(4))
    first = fresh()
    train(first, range(2))
    native = save(first.optimizer.state_dict())
    document = save(first.optimizer.export_local_state())
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (native, document))
    guard = load(native)["gefen_shard_identity"]
    results: dict[str, Any] = {
        "scope_record": guard["scope"],
        "slot_members": sorted({s["shard"]["local_member"] for s in guard["slots"]}),
    }
    for label in ("native", "canonical"):
        target = fresh()
        with torch.no_grad():
            for name, piece in target.pieces.items():
                piece.copy_(first.pieces[name])  # type: ignore[union-attr,arg-type]
        if label == "native":
            target.optimizer.load_state_dict(load(native))
        else:
            target.optimizer.commit_local_import(target.optimizer.prepare_local_import(load(document)))
        train(target, range(2, 4))
        results[label] = _equal_values(straight.values(), target.values())
    foreign = fresh()
    roots = (foreign.optimizer, *[p for p in foreign.pieces.values() if p is not None])
    other_native, other_document = everyone[(rank + 1) % world]
    results["foreign_native"] = _outcome(lambda: foreign.optimizer.load_state_dict(load(other_native)), roots)
    results["foreign_canonical"] = _outcome(lambda: foreign.optimizer.prepare_local_import(load(other_document)), roots)
    unscoped = fresh(scope=False)
    roots = (unscoped.optimizer, *[p for p in unscoped.pieces.values() if p is not None])
    results["unscoped_target"] = _outcome(lambda: unscoped.optimizer.load_state_dict(load(native)), roots)
    return results

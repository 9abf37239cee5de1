"""Rank functions for the codebook-scope tests (run inside gloo ranks; importable by name).

Every rank builds the same full "driver" model (same seed, same data), computes the full
gradient, and hands its optimizer its own pieces: replicated parameters whole, flattened ones
as this member's contiguous slice, whole-parameter ones only on their owner. A single-process
optimizer over the driver's full parameters is the oracle.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from gefen_contracts import (
    CollectiveFailureError,
    LogicalSlice,
    ParameterIdentity,
    ParameterLayout,
    ParameterRebinding,
    PlacementKind,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardingManifest,
    ShardPlacement,
)
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CodebookProcessGroupBinding, CollectiveCounter
from gefen_core import Gefen, GefenMuon
from gefen_core.codebook_scope import PHASES, injected_failures

LR = 1e-2
AXIS = "dp"


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
    for step in range(steps):
        backward(oracle_model, step)
        oracle.step()
        backward(driver, step)
        bound.feed(driver)
        bound.optimizer.step()
        sync_driver(driver, bound, world)
    exact = _equal_values(bound.values(), _expected(oracle_model, bound))
    codebooks: list[Any] = [None] * world
    dist.all_gather_object(codebooks, save(bound.optimizer.codebook))
    periods = {
        bound.shards[name].fqn: int(bound.optimizer.state[p]["automatic_period"])
        for name, p in bound.pieces.items()
        if p is not None and bound.optimizer.state.get(p)
    }
    oracle_periods = {name: int(oracle.state[p]["automatic_period"]) for name, p in oracle_model.named_parameters()}
    return {
        "exact": exact,
        "codebook_equal_oracle": torch.equal(bound.optimizer.codebook, oracle.codebook),
        "codebooks_agree": all(c == codebooks[0] for c in codebooks),
        "periods": periods,
        "oracle_periods": oracle_periods,
        "global_step": bound.optimizer.global_step,
    }


def initialize_and_refresh_match_one_process(rank: int, world: int) -> dict[str, Any]:
    """``initialize_codebook`` equals one process's over the concatenated gradients; after steps,
    ``refresh_codebook`` equals one process's refresh, and training continues bit-exactly."""
    driver = make_net()
    oracle_model = make_net()
    oracle = gefen_factory()(list(oracle_model.named_parameters()))
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    backward(oracle_model, 0)
    backward(driver, 0)
    bound.feed(driver)
    results: dict[str, Any] = {}
    results["initialized"] = (bound.optimizer.initialize_codebook(), oracle.initialize_codebook())
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
    results["refreshed"] = (bound.optimizer.refresh_codebook(), oracle.refresh_codebook())
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
    counted("refresh", bound.optimizer.refresh_codebook)
    counted("initialize_existing", bound.optimizer.initialize_codebook)
    return counts


# -- failures ---------------------------------------------------------------------------------------


class Injected(RuntimeError):
    """The failure a test hook raises."""


def _raise() -> None:
    raise Injected("injected failure")


@contextmanager
def _hooks(active: bool, phase: str) -> Iterator[None]:
    if active:
        with injected_failures({phase: _raise}):
            yield
    else:
        yield


def _outcome(action: Callable[[], object], roots: Sequence[Any]) -> dict[str, Any]:
    before = deep_snapshot(*roots)
    try:
        action()
        result: dict[str, Any] = {"raised": None}
    except CollectiveFailureError as exc:
        result = {"raised": "CollectiveFailureError", "local": exc.local, "phase": exc.phase, "message": str(exc)}
    except Exception as exc:
        result = {"raised": type(exc).__name__, "message": str(exc)}
    result["diffs"] = snapshot_diff(before, *roots)[:3]
    return result


#: Phase -> the operation a failure at that phase is injected into.
OPERATION_OF = {
    "entry checks": "step_closure",
    "closure": "step_closure",
    "gradient preflight": "first_step",
    "AMP agreement": "first_step",
    "period selection": "first_step",
    "histogram and solve": "first_step",
    "re-quantisation": "refresh",
    "refresh preamble": "refresh",
    "initialize preamble": "initialize",
    "commit": "first_step",
}
assert set(OPERATION_OF) == set(PHASES)


def one_rank_failures(rank: int, world: int, failing: int, phases: Sequence[str]) -> dict[str, Any]:
    """For each phase: a failure on ``failing`` only makes every rank raise, nothing changed; then
    the same operation succeeds and every rank agrees."""
    results: dict[str, Any] = {}
    for phase in phases:
        driver = make_net()
        bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
        operation = OPERATION_OF[phase]
        if operation in ("refresh", "step_closure"):
            backward(driver, 0)
            bound.feed(driver)
            bound.optimizer.step()
        backward(driver, 1)
        bound.feed(driver)
        opt = bound.optimizer

        def closure() -> torch.Tensor:
            return torch.zeros(())  # leaves the attached gradients alone (the snapshot includes them)

        def act(op: str = operation, opt: Any = opt) -> object:
            if op == "step_closure":
                return opt.step(closure)
            if op == "refresh":
                return opt.refresh_codebook()
            if op == "initialize":
                return opt.initialize_codebook()
            return opt.step()

        roots = (opt, *[p for p in bound.pieces.values() if p is not None])
        with _hooks(rank == failing, phase):
            outcome = _outcome(act, roots)
        retried = _outcome(act, roots)
        codebooks: list[Any] = [None] * world
        dist.all_gather_object(codebooks, save(opt.codebook))
        outcome["retry_raised"] = retried["raised"]
        outcome["codebooks_agree"] = all(c == codebooks[0] for c in codebooks)
        results[phase] = outcome
    return results


def amp_disagreement(rank: int, world: int) -> dict[str, Any]:
    """A found_inf seen on one member only raises everywhere (no mutation); an agreed overflow skips."""
    driver = make_net()
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    opt = bound.optimizer
    backward(driver, 0)
    bound.feed(driver)
    opt.step()
    backward(driver, 1)
    bound.feed(driver)
    roots = (opt, *[p for p in bound.pieces.values() if p is not None])
    opt.grad_scale = torch.tensor(2.0**10)
    opt.found_inf = torch.tensor(1.0 if rank == 0 else 0.0)
    divergent = _outcome(opt.step, roots)
    opt.found_inf = torch.tensor(1.0)
    overflow = _outcome(opt.step, roots)
    skipped = opt.global_step == 1
    opt.found_inf = torch.tensor(0.0)
    stepped = _outcome(opt.step, roots)
    return {
        "supports_amp": opt._step_supports_amp_scaling,
        "divergent": divergent,
        "overflow": overflow,
        "skipped": skipped,
        "stepped": stepped["raised"] is None and opt.global_step == 2,
    }


def disagreements(rank: int, world: int) -> dict[str, Any]:
    """Gradient presence or a manifest differing on one member raises the same error everywhere."""
    results: dict[str, Any] = {}
    driver = make_net()
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    opt = bound.optimizer
    backward(driver, 0)
    bound.feed(driver)
    if rank == 0:
        bound.pieces["up"].grad = None  # type: ignore[union-attr]
    roots = (opt, *[p for p in bound.pieces.values() if p is not None])
    results["presence"] = _outcome(opt.step, roots)
    other = layouts_for(world)
    if rank == 0:
        other["bias"] = Spec("flat", even_cuts(32, world))
    mismatched = bind(driver, other, rank, world, gefen_factory(), scope=binding(rank, world))
    backward(driver, 0)
    mismatched.feed(driver)
    roots = (mismatched.optimizer, *[p for p in mismatched.pieces.values() if p is not None])
    results["manifest"] = _outcome(mismatched.optimizer.step, roots)
    return results


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


# -- GefenMuon whole-parameter owners -----------------------------------------------------------------


class Matrices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(24, 16) * 0.2)
        self.b = torch.nn.Parameter(torch.randn(16, 24) * 0.2)
        self.c = torch.nn.Parameter(torch.randn(24, 24) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ self.c) @ self.a) @ self.b


def make_matrices(seed: int = 0) -> Matrices:
    torch.manual_seed(seed)
    return Matrices()


def matrix_backward(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(500 + step)
    x = torch.randn(6, 24, generator=generator)
    target = torch.randn(6, 24, generator=generator)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), target).backward()  # type: ignore[no-untyped-call]


def muon_whole_owner(rank: int, world: int, steps: int = 3) -> dict[str, Any]:
    """Whole-parameter owners under a scope: owners compute, the adapter broadcasts from the owner,
    and every member ends bit-exactly where one process would; an unscoped whole-owner layout
    refuses to step before its closure runs."""
    layouts = {"a": Spec("owner", owner=0), "b": Spec("owner", owner=1 % world), "c": Spec("repl")}

    def factory(named: list[tuple[str, torch.nn.Parameter]]) -> GefenMuon:
        return GefenMuon(named, lr=LR, fused=False)

    driver = make_matrices()
    oracle_model = make_matrices()
    oracle = factory(list(oracle_model.named_parameters()))
    bound = bind(driver, layouts, rank, world, factory, scope=binding(rank, world))
    contract = bound.optimizer.optimizer_contract()
    owner_claims = [t for t in contract.capabilities.training if t.layout is ParameterLayout.WHOLE_PARAMETER_OWNER]
    for step in range(steps):
        matrix_backward(oracle_model, step)
        oracle.step()
        matrix_backward(driver, step)
        bound.feed(driver)
        bound.optimizer.step()
        with torch.no_grad():  # the adapter's post-step sync: broadcast from the owner
            for name, parameter in driver.named_parameters():
                piece = bound.pieces[name]
                if piece is not None:
                    parameter.copy_(piece)
                dist.broadcast(parameter.data, src=layouts[name].owner if layouts[name].layout == "owner" else 0)
                if piece is not None:
                    piece.copy_(parameter)
    exact = all(torch.equal(a, b) for a, b in zip(driver.parameters(), oracle_model.parameters()))
    unscoped = bind(make_matrices(), layouts, rank, world, factory, scope=None)
    ran: list[int] = []

    def closure() -> None:
        ran.append(1)

    try:
        unscoped.optimizer.step(closure)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {
        "exact": exact,
        "codebook_equal_oracle": torch.equal(bound.optimizer.codebook, oracle.codebook),
        "owner_claims": [(t.process_group_scope.value, t.requires_post_step_parameter_sync) for t in owner_claims],
        "states": sorted(name for name, p in bound.pieces.items() if p is not None and bound.optimizer.state.get(p)),
        "unscoped_refused": refused,
        "closure_ran": bool(ran),
    }


def muon_one_rank_failure(rank: int, world: int, phases: Sequence[str], failing: int = 0) -> dict[str, Any]:
    """GefenMuon under a scope: a one-rank failure at ``phases`` of a first ``step(closure)``
    raises everywhere with nothing changed; the retried step succeeds."""
    layouts = {"a": Spec("owner", owner=0), "b": Spec("owner", owner=1 % world), "c": Spec("repl")}

    def factory(named: list[tuple[str, torch.nn.Parameter]]) -> GefenMuon:
        return GefenMuon(named, lr=LR, fused=False)

    results: dict[str, Any] = {}
    for phase in phases:
        driver = make_matrices()
        bound = bind(driver, layouts, rank, world, factory, scope=binding(rank, world))
        matrix_backward(driver, 0)
        bound.feed(driver)
        roots = (bound.optimizer, *[p for p in bound.pieces.values() if p is not None])
        step = bound.optimizer.step

        def act(step: Callable[..., object] = step) -> object:
            return step(lambda: torch.zeros(()))

        with _hooks(rank == failing, phase):
            results[phase] = _outcome(act, roots)
        results[phase]["retry"] = _outcome(act, roots)["raised"]
    return results


# -- FSDP2 ---------------------------------------------------------------------------------------------


class Tower(torch.nn.Module):
    """Two (384, 32) matrices: Shard(0) cuts at multiples of 64 rows = 2048 elements for 2 and 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(384, 32) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(384, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1.T) @ self.w2


def make_tower() -> Tower:
    torch.manual_seed(0)
    return Tower()


def tower_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(300 + step)
    x = torch.randn(16, 32, generator=generator)
    y = torch.randn(16, 32, generator=generator)
    return torch.nn.functional.mse_loss(model(x), y)


def fsdp2_scoped_matches_one_process(rank: int, world: int, steps: int = 4) -> dict[str, Any]:
    """FSDP2 (fully_shard, Shard(0)) + Gefen bound to each DTensor's local shard as a flattened
    element shard, with a codebook scope over the world: bit-exact with one process (on more
    than two ranks, one process stepping on FSDP's reduced gradient, since averaging three
    equal gradients rounds before the optimizer sees them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_tower()
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    optimizer = Gefen(named, lr=LR, fused=False, factored_v_2d=False)
    scope = binding(rank, world)
    group = scope.identity
    rebindings, shards = [], []
    flats: dict[str, torch.Tensor] = {}
    for name, parameter in named:
        with torch.no_grad():
            local = parameter.to_local()  # type: ignore[attr-defined]
            flat = local.view(-1)  # shares the DTensor's local storage
        identity = ParameterIdentity(name, tuple(parameter.shape))
        rows = -(-parameter.shape[0] // world)
        cols = parameter.shape[1]
        for r in range(world):
            start = min(rows * r, parameter.shape[0]) * cols
            stop = min(rows * (r + 1), parameter.shape[0]) * cols
            shard = ShardIdentity(
                identity,
                ParameterLayout.FLATTENED_ELEMENT_SHARD,
                LogicalSlice(start, stop - start),
                (ShardPlacement(AXIS, PlacementKind.FLAT_SHARD, r, world),),
                group,
                f"rank:{r}",
            )
            shards.append(shard)
            if r == rank:
                rebindings.append(ParameterRebinding(parameter, flat, shard))
        flats[name] = flat
    optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), scope=scope)
    oracle_model = make_tower()
    oracle = Gefen(list(oracle_model.named_parameters()), lr=LR, fused=False, factored_v_2d=False)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        tower_loss(model, step).backward()  # type: ignore[no-untyped-call]
        for name, parameter in named:
            flats[name].grad = parameter.grad.to_local().reshape(-1)  # type: ignore[union-attr]
        optimizer.step()
        oracle_model.zero_grad(set_to_none=True)
        if world == 2:  # FSDP's average of two equal gradients is exact: the oracle runs its own backward
            tower_loss(oracle_model, step).backward()  # type: ignore[no-untyped-call]
        else:  # (g + g + g) / 3 rounds: the oracle steps on FSDP's reduced gradient, gathered in full
            for (_, parameter), reference in zip(named, oracle_model.parameters()):
                reference.grad = parameter.grad.full_tensor()  # type: ignore[union-attr]
        oracle.step()
    periods = {name: int(optimizer.state[flats[name]]["automatic_period"]) for name in flats}
    oracle_periods = {name: int(oracle.state[p]["automatic_period"]) for name, p in oracle_model.named_parameters()}
    exact = all(
        torch.equal(p.full_tensor(), q)  # type: ignore[attr-defined]
        for (_, p), q in zip(named, oracle_model.parameters())
    )
    return {
        "exact": exact,
        "periods": periods,
        "oracle_periods": oracle_periods,
        "codebook_equal_oracle": torch.equal(optimizer.codebook, oracle.codebook),
    }

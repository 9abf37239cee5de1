"""Whole-parameter-owner (GefenMuon) and FSDP2 rank functions for the codebook-scope tests (gloo ranks).

GefenMuon with whole-parameter owners under a scope, and Gefen bound to FSDP2 ``Shard(0)``
DTensor shards, each checked bit-exactly against one process. The shared plans and helpers
live in ``gefen_core_scope_cases``, the failure hooks in ``gefen_core_scope_failure_cases``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity, ShardPlacement
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_core import Gefen, GefenMuon
from gefen_core.param_state import period_of
from gefen_core_scope_cases import (
    AXIS,
    LR,
    Spec,
    _outcome,
    bind,
    binding,
    gefen_factory,
    train_beside_oracle,
)
from gefen_core_scope_failure_cases import closure, failing_at

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
            return step(closure)

        with failing_at(rank == failing, phase, bound.optimizer):
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
    periods = {name: period_of(optimizer.state[flats[name]]) for name in flats}
    oracle_periods = {name: period_of(oracle.state[p]) for name, p in oracle_model.named_parameters()}
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


class RaggedVector(torch.nn.Module):
    """One 1-D parameter of 5462 = 2 x 2731 elements: no divisor in [64, 2048], so ragged
    blocks of 2048 (the last one 1366 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.v = torch.nn.Parameter(torch.randn(5462) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.v * x).sin().sum()


def ragged_flattened_matches_one_process(rank: int, world: int, steps: int = 3) -> dict[str, Any]:
    """A ragged-block 1-D parameter cut at 2048 (a block boundary) across a scope: the last
    piece ends at the parameter's end, so it keeps the parameter's period and trains bit-exactly
    like one process."""

    def backward(model: torch.nn.Module, step: int) -> None:
        generator = torch.Generator().manual_seed(70 + step)
        model.zero_grad(set_to_none=True)
        model(torch.randn(5462, generator=generator)).backward()

    torch.manual_seed(0)
    driver = RaggedVector()
    torch.manual_seed(0)
    oracle_model = RaggedVector()
    oracle = gefen_factory()(list(oracle_model.named_parameters()))
    bound = bind(driver, {"v": Spec("flat", (2048,))}, rank, world, gefen_factory(), scope=binding(rank, world))
    train_beside_oracle(oracle_model, oracle, driver, bound, world, steps, backward)
    piece = bound.pieces["v"]
    assert piece is not None
    return {
        "exact": torch.equal(driver.v, oracle_model.v),
        "periods": (period_of(oracle.state[oracle_model.v]), period_of(bound.optimizer.state[piece])),
    }

"""Rank functions for test_core_distributed.py (run inside gloo ranks; importable by name)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from gefen_core import Gefen

STEPS = 6
LR = 1e-2


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 48),
        torch.nn.Tanh(),
        torch.nn.Linear(48, 1),  # a 1-row weight: rank 1's shard is empty
    )


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 24, generator=generator), torch.randn(16, 1, generator=generator)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, steps: int, rank: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def ddp_replicas(rank: int, world: int) -> dict[str, Any]:
    """DDP with different data per rank: replicas stay bit-identical; close to one process."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model())
    opt = Gefen(model.parameters(), lr=LR)
    train(model, opt, 0, STEPS, rank)
    reference = make_model()
    ref_opt = Gefen(reference.parameters(), lr=LR)
    for step in range(STEPS):
        ref_opt.zero_grad()
        loss = (
            sum(torch.nn.functional.mse_loss(reference(x), y) for x, y in (batch(step, r) for r in range(world)))
            / world
        )
        loss.backward()  # type: ignore[union-attr]
        ref_opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    gap = max(((p - q).abs().max() / (STEPS * LR)).item() for p, q in zip(params, reference.parameters()))
    return {"params": _save(params), "codebook": _save(opt.codebook), "gap": gap}


def _fsdp_model(mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_parity(
    rank: int, world: int, clip_threshold: float | None = None, min_dim: int = 0, stochastic_round: bool = False
) -> dict[str, Any]:
    """FSDP2 with the default constructor versus a single-process run on the same data.

    After one step (identical gradients) the sharded factored statistics must equal the
    single-process ones; after ``STEPS`` the parameters must stay close. With ``clip_threshold``
    factored updates are clipped (a small one clips every one), the statistic summed over the
    row shards. ``min_dim`` is ``min_dim_size_to_factor``: 0 factors every matrix, the default
    (128) gives these narrow ones a per-element ``v`` instead. With ``stochastic_round`` every
    element must draw what it draws in one process (a row shard's draws start at its first row).
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = _fsdp_model(mesh)
    options = {
        "clip_threshold": clip_threshold,
        "min_dim_size_to_factor": min_dim,
        "stochastic_round": stochastic_round,
    }
    opt = Gefen(model.named_parameters(), lr=LR, **options)
    initial = [p.detach().clone() for p in make_model().parameters()]
    reference = make_model()
    # under FSDP2 a sharded 1-D parameter keeps per-element state (periods.shape_period)
    ref_opt = Gefen(reference.named_parameters(), lr=LR, force_1d_period_one=True, **options)
    train(model, opt, 0, 1)
    train(reference, ref_opt, 0, 1)
    col_gaps: dict[str, float] = {}
    row_gaps: dict[str, float] = {}
    replicated: dict[str, bool] = {}
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        state = opt.state[p]
        if "v_col" not in state:
            continue
        v_col = state["v_col"]
        gathered = [torch.empty_like(v_col) for _ in range(world)]
        dist.all_gather(gathered, v_col)
        replicated[name] = all(torch.equal(gathered[0], g) for g in gathered)
        expected = ref_opt.state[q]["v_col"]
        col_gaps[name] = ((v_col - expected).abs().max() / expected.abs().max()).item()
        rows = p.to_local().shape[0]  # type: ignore[attr-defined]
        first_row = rank * -(-p.shape[0] // world)
        expected_rows = ref_opt.state[q]["v_row"][first_row : first_row + rows]
        row_gaps[name] = ((state["v_row"] - expected_rows).abs().max() / expected.abs().max()).item() if rows else 0.0
    from gefen_contracts.torch_support import CollectiveCounter

    x, y = batch(1)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    counter = CollectiveCounter()
    with counter.patched():
        opt.preflight_step()
    preflight_collectives = counter.total
    opt.zero_grad()
    train(model, opt, 1, STEPS - 1)
    train(reference, ref_opt, 1, STEPS - 1)
    gaps: dict[str, float] = {}
    for (name, p), (_, q), start in zip(model.named_parameters(), reference.named_parameters(), initial):
        full = p.full_tensor()  # type: ignore[attr-defined]
        moved = (q.detach() - start).norm()
        gaps[name] = ((full - q.detach()).norm() / moved).item()
    return {
        "two_d": sorted(name for name, p in reference.named_parameters() if p.dim() == 2),
        "element": sorted(name for name, p in model.named_parameters() if "v" in opt.state[p]),
        "gaps": gaps,
        "col_gaps": col_gaps,
        "row_gaps": row_gaps,
        "replicated": replicated,
        "preflight_collectives": preflight_collectives,
    }


def fsdp_checkpoints(rank: int, world: int) -> dict[str, Any]:
    """Per-rank native checkpoints (``torch.save`` of ``state_dict()``, DTensors inside) and
    torch's DCP helpers resume bit-exactly."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    straight = _fsdp_model(mesh)
    straight_opt = Gefen(straight.parameters(), lr=LR, weight_decay=0.1)
    train(straight, straight_opt, 0, 4)

    halves = _fsdp_model(mesh)
    first = Gefen(halves.parameters(), lr=LR, weight_decay=0.1)
    train(halves, first, 0, 2)
    native = _save(first.state_dict())
    via_dcp = _save(get_optimizer_state_dict(halves, first))
    model_state = {k: v.detach().clone() for k, v in halves.state_dict().items()}

    results: dict[str, Any] = {}
    for label, payload in (("native", native), ("dcp", via_dcp)):
        model = _fsdp_model(mesh)
        model.load_state_dict(model_state)
        opt = Gefen(model.parameters(), lr=LR, weight_decay=0.1)
        if label == "native":
            opt.load_state_dict(_load(payload))
        else:
            set_optimizer_state_dict(model, opt, _load(payload))
        train(model, opt, 2, 2)
        results[label] = all(
            torch.equal(a.to_local(), b.to_local())  # type: ignore[attr-defined]
            for a, b in zip(straight.parameters(), model.parameters())
        )
    return results


def _outcome(run: Any) -> dict[str, Any]:
    from gefen_contracts import CollectiveFailureError

    try:
        run()
    except CollectiveFailureError as exc:
        cause = exc.__cause__
        return {"type": "CollectiveFailureError", "local": exc.local, "cause": type(cause).__name__ if cause else None}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def fsdp_failures_and_presence(rank: int, world: int) -> dict[str, Any]:
    """A first gradient with an inf on rank 0 only (one reduce-scatter's bad element): rank 0's
    step raised, rank 1's waited forever in the codebook's all-reduce. Then the ranks step
    different matrices (rank 1 drops one gradient): the factored statistics' packets of
    two same-shaped matrices were summed into each other. Both now raise on every rank,
    change nothing, and a clean step afterwards trains on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Gefen(model.named_parameters(), lr=LR, min_dim_size_to_factor=0)

    def backward(step: int) -> None:
        opt.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()

    def snapshot() -> list[torch.Tensor]:
        tensors = [p.to_local().clone() for p in model.parameters()]  # type: ignore[attr-defined]
        for entry in opt.state.values():
            tensors += [
                v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                for v in entry.values()
                if torch.is_tensor(v)
            ]
        return tensors

    backward(0)
    if rank == 0:
        model[1].bias.grad.to_local()[0] = float("inf")  # type: ignore[union-attr]
    before = snapshot()
    failure = _outcome(opt.step)
    failure_unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot())) and not opt.state
    backward(1)
    opt.step()  # a clean step learns the codebook on both ranks
    backward(2)
    if rank == 1:
        model[0].weight.grad = None
    before = snapshot()
    presence = _outcome(opt.step)
    presence_unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    backward(3)
    opt.step()
    return {
        "failure": failure,
        "failure_unchanged": failure_unchanged,
        "presence": presence,
        "presence_unchanged": presence_unchanged,
        "trained_on": opt.global_step,
    }

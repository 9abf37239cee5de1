"""Rank functions for GefenMuon's gloo tests (run inside spawned ranks; importable by name)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from gefen_contracts import StateValidationError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.state_layout import match_variants
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CollectiveCounter
from gefen_core import GefenMuon, muon_execution
from gefen_core.muon_distributed import shard_rows
from gefen_core_test_support import edit_mirror, mirror_of

LR = 5e-3
SHAPES: dict[str, list[tuple[int, int]]] = {
    "even": [(8, 6), (6, 10)],
    "uneven": [(5, 4), (7, 12)],
    "empty": [(1, 4), (9, 3)],
}


def save(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def shard(full: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``full``'s ``Shard(0)`` DTensor on ``mesh`` without a collective (every rank holds ``full``)."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = int(mesh.size()), int(mesh.get_local_rank())
    start, length = shard_rows(full.shape[0], world, rank)
    local = full[start : start + length].clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def full_matrices(shapes: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def named_pairs(params: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}.weight", p) for i, p in enumerate(params)]


def sharded_params(shapes: list[tuple[int, int]], mesh: Any) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(shard(full, mesh)) for full in full_matrices(shapes, 0)]


def plain_params(shapes: list[tuple[int, int]]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(full) for full in full_matrices(shapes, 0)]


def set_grads(params: list[torch.nn.Parameter], step: int, mesh: Any | None) -> None:
    for p, grad in zip(params, full_matrices([tuple(p.shape) for p in params], 100 + step)):  # type: ignore[misc]
        p.grad = shard(grad + 0.1, mesh) if mesh is not None else grad + 0.1


def train(opt: GefenMuon, params: list[torch.nn.Parameter], start: int, steps: int, mesh: Any | None) -> None:
    for step in range(start, start + steps):
        set_grads(params, step, mesh)
        opt.step()


def full_values(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in params]  # type: ignore[operator]


def _variants(opt: GefenMuon, params: list[torch.nn.Parameter]) -> list[list[str]]:
    contract = opt.optimizer_contract()
    names = []
    for p in params:
        state = opt.state.get(p)
        if not state:
            names.append([])
            continue
        matches = match_variants(
            contract.state_layout,
            list(state),
            parameter_layout=ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
            parameter_rank=2,
            mode_tags=opt.state_mode_tags(p),
        )
        names.append([m.name for m in matches])
    return names


def parity(rank: int, world: int, mode: str, case: str, normuon: bool, steps: int = 3) -> dict[str, Any]:
    """A sharded run against a one-process oracle on the same full gradients."""
    mesh = _mesh(world)
    shapes = SHAPES[case]
    options = {"lr": LR, "weight_decay": 0.1, "normuon": normuon, "fused": False}
    params = sharded_params(shapes, mesh)
    opt = GefenMuon(named_pairs(params), sharded_mode=mode, **options)  # type: ignore[arg-type]
    oracle_params = plain_params(shapes)
    oracle = GefenMuon(named_pairs(oracle_params), **options)  # type: ignore[arg-type]
    train(opt, params, 0, steps, mesh)
    train(oracle, oracle_params, 0, steps, None)
    ours, theirs = full_values(params), full_values(oracle_params)
    start = full_matrices(shapes, 0)
    return {
        "max_abs": max(float((a - b).abs().max()) for a, b in zip(ours, theirs)),
        "bitwise": all(torch.equal(a, b) for a, b in zip(ours, theirs)),
        "moved": all(not torch.equal(a, s) for a, s in zip(ours, start)),
        "finite": all(bool(torch.isfinite(a).all()) for a in ours),
        "variants": _variants(opt, params),
        "state_rows": [int(opt.state[p]["m_codes"].numel()) if opt.state.get(p) else 0 for p in params],
        "codebook": save(opt.codebook),
    }


def collectives(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Collectives of a steady-state step (and of a preflight, which must run none)."""
    mesh = _mesh(world)
    params = sharded_params([(8, 6), (6, 10), (5, 4)], mesh)
    opt = GefenMuon(named_pairs(params), sharded_mode=mode, lr=LR, fused=False)
    train(opt, params, 0, 1, mesh)
    set_grads(params, 1, mesh)
    preflight = CollectiveCounter()
    with preflight.patched():
        opt.preflight_step()
    step = CollectiveCounter()
    with step.patched():
        opt.step()
    return {"preflight": preflight.total, "step": dict(step.calls)}


def fsdp_model(rank: int, world: int, mode: str) -> dict[str, Any]:
    """fully_shard end to end (every rank sees the same batch) against one process."""
    from torch.distributed.fsdp import fully_shard

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(12, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 5, bias=False)
        )

    mesh = _mesh(world)
    sharded = model()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    reference = model()
    opts = [
        GefenMuon(sharded.named_parameters(), lr=1e-2, sharded_mode=mode, fused=False),
        GefenMuon(reference.named_parameters(), lr=1e-2, fused=False),
    ]
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 5, generator=generator)
        for net, opt in zip((sharded, reference), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    ours = [p.full_tensor() for p in sharded.parameters()]  # type: ignore[operator]
    return {"max_abs": max(float((a - b).abs().max()) for a, b in zip(ours, reference.parameters()))}


def _opt_for_faults(world: int, mode: str, trained: int = 1) -> tuple[GefenMuon, list[torch.nn.Parameter], Any]:
    mesh = _mesh(world)
    params = sharded_params([(8, 6), (6, 10), (5, 4)], mesh)
    opt = GefenMuon(named_pairs(params), sharded_mode=mode, lr=LR, fused=False)
    train(opt, params, 0, trained, mesh)
    set_grads(params, trained, mesh)
    return opt, params, mesh


def _boom(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected fault on rank 0")


def fault(rank: int, world: int, mode: str, where: str) -> dict[str, Any]:
    """Inject a failure on rank 0 at ``where``; every rank must raise the same error (no hang)."""
    # (a gradient is checked while the codebook is unlearned: the first step's)
    opt, params, _ = _opt_for_faults(world, mode, trained=0 if where == "gradient preflight" else 1)
    closure = None
    patches = contextlib.ExitStack()  # faults injected into the step's functions, on rank 0 only
    if rank == 0:
        if where in ("entry checks", "entry checks without closure"):
            opt.param_groups[0]["lr"] = -1.0
        elif where == "gradient preflight":
            params[1].grad.to_local().fill_(float("nan"))  # type: ignore[union-attr]
        elif where == "amp":
            opt.found_inf = torch.ones(1)  # type: ignore[attr-defined]
        elif where == "bucket gather":
            patches.enter_context(mock.patch.object(muon_execution, "_local_pieces", _boom))
        elif where == "update broadcast":
            patches.enter_context(mock.patch.object(muon_execution, "_update", _boom))
    if where == "amp" and rank != 0:
        opt.found_inf = torch.zeros(1)  # type: ignore[attr-defined]
    if where in ("entry checks", "closure"):

        def closure() -> torch.Tensor:
            if rank == 0 and where == "closure":
                raise RuntimeError("closure boom on rank 0")
            return torch.zeros(())

    before = deep_snapshot(opt, *params)
    found_inf = getattr(opt, "found_inf", None)
    try:
        with patches:
            opt.step(closure)
        outcome = {"error": None, "message": ""}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    # a raising step drops the gradient scaler's input (forget_scaler_state); the rest is state
    outcome["scaler_dropped"] = found_inf is not None and not hasattr(opt, "found_inf")
    if found_inf is not None:
        opt.found_inf = found_inf  # type: ignore[attr-defined]
    outcome["unchanged"] = not snapshot_diff(before, opt, *params)
    outcome["global_step"] = opt.global_step
    dist.barrier()
    return outcome


def late_nan(rank: int, world: int, mode: str) -> dict[str, Any]:
    """A NaN in rank 1's rows of the first matrix (owned by rank 0 in "distributed" mode) after
    the codebook is learned: taken on every rank, as one process and torch's Muon take it."""
    opt, params, _ = _opt_for_faults(world, mode)
    if rank == 1:
        params[0].grad.to_local()[0, 0] = float("nan")  # type: ignore[union-attr]
    try:
        opt.step()
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    values = full_values(params)
    return {"error": error, "finite": [bool(torch.isfinite(v).all()) for v in values], "values": save(values)}


def presence(rank: int, world: int, mode: str, what: str = "gradient") -> dict[str, Any]:
    """A parameter with a gradient on one rank only (or a codebook that differs) is refused on
    every rank before any mutation."""
    opt, params, _ = _opt_for_faults(world, mode)
    if rank == 1 and what == "gradient":
        params[2].grad = None
    if rank == 1 and what == "codebook":
        opt._codebook = torch.linspace(-1.0, 1.0, 256)
    before = deep_snapshot(opt, *params)
    try:
        opt.step()
        return {"error": None}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "unchanged": not snapshot_diff(before, opt, *params)}


def resume(rank: int, world: int, mode: str) -> dict[str, Any]:
    """Same-topology native resume is bit-exact; the consolidated dict and full values are returned."""
    mesh = _mesh(world)
    shapes = [(8, 6), (6, 10), (5, 4)]
    options = {"lr": LR, "normuon": True, "sharded_mode": mode, "fused": False}
    straight = sharded_params(shapes, mesh)
    opt = GefenMuon(named_pairs(straight), **options)  # type: ignore[arg-type]
    train(opt, straight, 0, 4, mesh)
    halves = sharded_params(shapes, mesh)
    first = GefenMuon(named_pairs(halves), **options)  # type: ignore[arg-type]
    train(first, halves, 0, 2, mesh)
    saved = first.state_dict()
    data = save(saved)
    at_two = save(full_values(halves))
    resumed = GefenMuon(named_pairs(halves), **options)  # type: ignore[arg-type]
    resumed.load_state_dict(load(data))
    train(resumed, halves, 2, 2, mesh)
    everyone: list[bytes | None] = [None] * world
    dist.all_gather_object(everyone, data)
    other = everyone[(rank + 1) % world]
    assert other is not None
    foreign = ""
    try:
        GefenMuon(named_pairs(sharded_params(shapes, mesh)), **options).load_state_dict(load(other))  # type: ignore[arg-type]
    except StateValidationError as exc:
        foreign = str(exc)
    return {
        "bitwise": all(torch.equal(a, b) for a, b in zip(full_values(straight), full_values(halves))),
        "checkpoint": data,
        "owned_states": sorted(i for i, p in enumerate(resumed.param_groups[0]["params"]) if resumed.state.get(p)),
        "saved_states": sorted(saved["state"]),
        "at_two": at_two,
        "final": save(full_values(straight)),
        "foreign": foreign,
        "identical_dicts": other == data,
    }


def manifest_corruptions(rank: int, world: int) -> dict[str, str]:
    """Every owner-manifest corruption is refused before any mutation."""
    mesh = _mesh(world)
    shapes = [(8, 6), (6, 10), (5, 4)]
    params = sharded_params(shapes, mesh)
    opt = GefenMuon(named_pairs(params), sharded_mode="distributed", lr=LR, fused=False)
    train(opt, params, 0, 2, mesh)
    valid = load(save(opt.state_dict()))

    def edit(apply: Any) -> Any:
        """Apply to the owner manifest (a JSON string) at the top level and in every group's mirror."""

        def edited(raw: str) -> str:
            manifest = json.loads(raw)
            apply(manifest)
            return json.dumps(manifest)

        def run(sd: dict[str, Any]) -> None:
            sd["gefen_muon_owners"] = edited(sd["gefen_muon_owners"])
            for group in sd["param_groups"]:
                edit_mirror(group, owners=edited(mirror_of(group)["owners"]))

        return run

    def as_dict(sd: dict[str, Any]) -> None:
        """Version 6's form: the manifest as a dict (DCP keys its leaves by the world size)."""
        sd["gefen_muon_owners"] = json.loads(sd["gefen_muon_owners"])
        for group in sd["param_groups"]:
            edit_mirror(group, owners=sd["gefen_muon_owners"])

    corruptions = {
        "not consolidated": edit(lambda m: m.__setitem__("consolidated", False)),
        "owner manifest": edit(lambda m: m.__setitem__("ownership", "round_robin")),
        "breaks the rule": edit(lambda m: m["entries"][1].__setitem__("owner", 0)),
        "is named": edit(lambda m: m["entries"][0].__setitem__("name", "other")),
        "has shape": edit(lambda m: m["entries"][2].__setitem__("shape", [4, 5])),
        "initialized": lambda sd: sd["state"].pop(1),
        "world_size": edit(lambda m: m.__setitem__("world_size", 0)),
        "disagree on owners": lambda sd: edit_mirror(sd["param_groups"][0], owners=None),
        "must be the JSON string": as_dict,
    }
    results = {}
    for expected, corrupt in corruptions.items():
        broken = load(save(valid))
        corrupt(broken)
        before = deep_snapshot(opt, *params)
        try:
            opt.load_state_dict(broken)
            results[expected] = "accepted"
        except StateValidationError as exc:
            message = str(exc)
            results[expected] = "ok" if expected in message and not snapshot_diff(before, opt, *params) else message
    opt.load_state_dict(valid)
    return results


def load_checkpoint(rank: int, world: int, data: bytes, at_two: bytes, mode: str) -> dict[str, Any]:
    """Load a checkpoint saved on another world size and continue two steps."""
    mesh = _mesh(world)
    shapes = [(8, 6), (6, 10), (5, 4)]
    params = [torch.nn.Parameter(shard(value, mesh)) for value in load(at_two)]
    opt = GefenMuon(named_pairs(params), lr=LR, normuon=True, sharded_mode=mode, fused=False)
    opt.load_state_dict(load(data))
    owned = [i for i, p in enumerate(params) if opt.state.get(p)]
    train(opt, params, 2, 2, mesh)
    del shapes
    return {"final": save(full_values(params)), "owned": owned}


def local_gradient_on_one_rank(rank: int, world: int, mode: str) -> dict[str, Any]:
    """A sharded matrix without a gradient this step (on every rank, so presence agrees) and a
    plain matrix whose gradient exists on rank 0 only, before the codebook is learned: every
    rank learns (an empty histogram adds nothing), so the next collective lines up."""
    mesh = _mesh(world)
    sharded = sharded_params([(8, 6)], mesh)
    local = plain_params([(4, 4)])
    opt = GefenMuon(named_pairs([*sharded, *local]), lr=1e-2, sharded_mode=mode)
    if rank == 0:
        local[0].grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    opt.step()
    after = torch.ones(8, dtype=torch.float64)
    dist.all_reduce(after)  # the user's next collective: it met the learning's vote before
    assert opt.codebook is not None
    return {"codebook": save(opt.codebook), "after": float(after.sum())}

"""Rank functions for gefen-dcp's FSDP2/gloo tests (imported by spawned GlooWorld ranks)."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_dcp import GefenDCPState, GefenFileSystemReader, GefenFileSystemWriter, GefenLoadPlanner, GefenSavePlanner
from gefen_dcp.testing import Int8MomentumSGD
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

VOCAB = 64
WIDTH = 32
BATCH = 24
SEQ = 6
LR = 0.2
MOMENTUM = 0.9

warnings.filterwarnings("ignore", message=".*overwriting.*")
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.*")


class TinyDecoder(torch.nn.Module):
    """Embedding, a residual MLP block and a (larger) output head: decoder-shaped, small."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(torch.nn.functional.gelu(self.up(hidden)))
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def build(world_size: int) -> tuple[torch.nn.Module, Int8MomentumSGD]:
    torch.manual_seed(0)
    model = TinyDecoder()
    if dist.is_initialized() and world_size > 1:
        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    elif dist.is_initialized():
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = Int8MomentumSGD(list(model.named_parameters()), lr=LR, momentum=MOMENTUM, weight_decay=0.01)
    return model, optimizer


def train(model: torch.nn.Module, optimizer: Int8MomentumSGD, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        inputs, targets = batch(step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def full_momentum(optimizer: Int8MomentumSGD) -> dict[str, torch.Tensor]:
    """Every state tensor (``<parameter number>.<name>``), gathered to full tensors (collective)."""
    out = {}
    for number, entry in sorted(optimizer.state_dict()["state"].items()):
        for name, value in sorted(entry.items()):
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"{number}.{name}"] = full.detach().clone()
    return out


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, parameter in model.named_parameters():
        out[name] = (
            parameter.full_tensor().detach().clone()
            if hasattr(parameter, "full_tensor")
            else parameter.detach().clone()
        )
    return out


class FaultingSavePlanner(GefenSavePlanner):
    """A ``GefenSavePlanner`` that injects a fault through the planner, the writer's public
    seam: the writer resolves each item's data through it just before writing the item, so
    ``fault(written)`` runs with the number of items this save has written so far (from the
    second item on)."""

    def __init__(self, fault: Callable[[int], None]) -> None:
        super().__init__()
        self._fault = fault
        self._resolved = 0
        self._count = threading.Lock()

    def resolve_data(self, write_item: Any) -> Any:
        with self._count:
            written = self._resolved
            self._resolved += 1
        if written:
            self._fault(written)
        return super().resolve_data(write_item)


def save(
    model: torch.nn.Module,
    optimizer: Int8MomentumSGD,
    path: str,
    fault: Callable[[int], None] | None = None,
    **writer: Any,
) -> None:
    """``dcp.save`` of the model and ``GefenDCPState`` (``writer``: the writer's options;
    ``fault`` as :class:`FaultingSavePlanner`'s)."""
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    planner = GefenSavePlanner() if fault is None else FaultingSavePlanner(fault)
    dcp.save(state, storage_writer=GefenFileSystemWriter(path, **writer), planner=planner)


def load(model: torch.nn.Module, optimizer: Int8MomentumSGD | None, path: str) -> None:
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = GefenDCPState(optimizer)
    dcp.load(state, storage_reader=GefenFileSystemReader(path), planner=GefenLoadPlanner())


# -- N -> M continuation ----------------------------------------------------------------


def train_save_continue(rank: int, world_size: int, path: str, before: int, after: int) -> list[float]:
    model, optimizer = build(world_size)
    train(model, optimizer, 0, before)
    save(model, optimizer, path, thread_count=2)
    return train(model, optimizer, before, after)


def load_continue(rank: int, world_size: int, path: str, before: int, after: int, keep_state: bool) -> list[float]:
    model, optimizer = build(world_size)
    load(model, optimizer if keep_state else None, path)
    return train(model, optimizer, before, after)


def momentum_after_load(rank: int, world_size: int, path: str) -> dict[str, torch.Tensor]:
    model, optimizer = build(world_size)
    load(model, optimizer, path)
    return full_momentum(optimizer)


def momentum_after_training(rank: int, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    model, optimizer = build(world_size)
    train(model, optimizer, 0, steps)
    return full_momentum(optimizer)


# -- async save ---------------------------------------------------------------------------


def async_save_then_train(rank: int, world_size: int, path: str, before: int, during: int) -> dict[str, Any]:
    model, optimizer = build(world_size)
    train(model, optimizer, 0, before)
    expected_momentum = full_momentum(optimizer)
    expected_params = full_parameters(model)
    async_group = dist.new_group(backend="gloo")
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    future = dcp.async_save(
        state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner(), process_group=async_group
    )
    train(model, optimizer, before, during)
    result = future.result() if hasattr(future, "result") else future.upload_completion.result()
    del result
    moved = not all(torch.equal(a, b) for a, b in zip(full_momentum(optimizer).values(), expected_momentum.values()))
    dist.destroy_process_group(async_group)
    fresh_model, fresh = build(world_size)
    load(fresh_model, fresh, path)
    loaded_momentum = full_momentum(fresh)
    loaded_params = full_parameters(fresh_model)
    return {
        "moved_during_save": moved,
        "momentum_equal": all(torch.equal(loaded_momentum[k], v) for k, v in expected_momentum.items()),
        "params_equal": all(torch.equal(loaded_params[k], v) for k, v in expected_params.items()),
    }


# -- one-rank failure and crash safety ------------------------------------------------------


def flip_chunk_byte(path: str, key: str, offsets: tuple[int, ...], elements: torch.Tensor) -> None:
    """Flip one bit inside the stored elements of the chunk of ``key`` at ``offsets``."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(path).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == key and tuple(k.offset) == offsets]
    target = os.path.join(path, info.relative_path)
    with open(target, "r+b") as handle:
        handle.seek(info.offset)
        region = handle.read(info.length)
        position = region.find(elements.contiguous().reshape(-1)[:16].numpy().tobytes())
        if position < 0:
            raise AssertionError(f"the elements of {key} at {offsets} are not in {info.relative_path}")
        handle.seek(info.offset + position + 1)
        handle.write(bytes([region[position + 1] ^ 0x01]))


def corrupt_own_chunk_then_load(rank: int, world_size: int, path: str, victim: int) -> dict[str, Any]:
    """``victim`` flips a bit of its own chunk of ``head.weight``; every rank then loads."""
    model, optimizer = build(world_size)
    train(model, optimizer, 0, 2)
    if rank == victim:
        number = [name for name, _ in model.named_parameters()].index("head.weight")
        codes = optimizer.state_dict()["state"][number]["momentum_int8"]
        offsets = tuple(int(o) for o in codes.__create_chunk_list__()[0].offsets)
        key = f"optim.tensors.like_parameter.state/{number}/momentum_int8"
        flip_chunk_byte(path, key, offsets, codes.to_local())
    dist.barrier()
    before = deep_snapshot(optimizer)
    try:
        load(model, optimizer, path)
    except Exception as exc:
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "cause": type(cause).__name__ if cause is not None else None,
            "unchanged": not snapshot_diff(before, optimizer),
        }
    return {"error": None, "cause": None, "unchanged": not snapshot_diff(before, optimizer)}


def mixed_saves_then_load(rank: int, world_size: int, first: str, second: str, swap: str) -> dict[str, Any]:
    """Two saves of one run with DCP's stock writer (the same file names); then, with ``swap``
    ``"saves"``, rank 0's data file of the second replaces the first's, with ``"ranks"`` the
    first save's rank 0 and rank 1 data files trade places; every rank then loads the first."""
    from torch.distributed.checkpoint import FileSystemWriter

    model, optimizer = build(world_size)
    train(model, optimizer, 0, 2)
    for path, steps in ((first, 1), (second, 0)):
        state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
        dcp.save(state, storage_writer=FileSystemWriter(path), planner=GefenSavePlanner())
        train(model, optimizer, 2, steps)
    dist.barrier()
    sizes = (0, 0)
    if rank == 0 and swap == "saves":
        name = "__0_0.distcp"
        sizes = (os.path.getsize(os.path.join(first, name)), os.path.getsize(os.path.join(second, name)))
        shutil.copyfile(os.path.join(second, name), os.path.join(first, name))
    elif rank == 0:
        zero, one = os.path.join(first, "__0_0.distcp"), os.path.join(first, "__1_0.distcp")
        os.replace(zero, zero + ".swap")
        os.replace(one, zero)
        os.replace(zero + ".swap", one)
    dist.barrier()
    fresh_model, fresh = build(world_size)

    def options() -> list[dict[str, Any]]:  # DCP loads the model's tensors in place: not compared
        return [{k: v for k, v in g.items() if k != "params"} for g in fresh.param_groups]

    before, groups = deep_snapshot(fresh.state), options()
    outcome: dict[str, Any] = {"error": None, "message": "", "sizes": sizes}
    try:
        load(fresh_model, fresh, first)
    except BaseException as exc:
        outcome.update(error=type(exc).__name__, message=str(exc))
    outcome["unchanged"] = not snapshot_diff(before, fresh.state) and options() == groups
    return outcome


def _kill_self(written: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def save_then_crash(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Save checkpoint A, train on, start overwriting it with B; rank 1 dies mid-write."""
    model, optimizer = build(world_size)
    train(model, optimizer, 0, 3)
    save(model, optimizer, path)
    reference = {"momentum": full_momentum(optimizer), "params": full_parameters(model)}
    torch.save(reference, os.path.join(path, f"reference_{rank}.pt"))
    train(model, optimizer, 3, 2)
    dist.barrier()
    started = time.monotonic()
    try:
        save(model, optimizer, path, fault=_kill_self if rank == 1 else None)
    except Exception as exc:
        return {"failed": True, "error": type(exc).__name__, "seconds": time.monotonic() - started}
    return {"failed": False}


def load_after_crash(rank: int, world_size: int, path: str) -> bool:
    reference = torch.load(os.path.join(path, f"reference_{rank}.pt"), weights_only=True)
    model, optimizer = build(world_size)
    load(model, optimizer, path)
    momentum = full_momentum(optimizer)
    params = full_parameters(model)
    return all(torch.equal(momentum[k], v) for k, v in reference["momentum"].items()) and all(
        torch.equal(params[k], v) for k, v in reference["params"].items()
    )


def replica_divergence_found(rank: int, world_size: int) -> list[str]:
    """A stand-in optimizer whose replicated state is equal, rank-local or sharded on purpose:
    only the replicated entries that differ are reported."""
    from types import SimpleNamespace

    from gefen_dcp.conformance_ranks import replica_divergence
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {
        "same_plain": torch.arange(3.0),
        "own_plain": torch.full((3,), float(rank)),  # DCP would keep one rank's copy
        "same_replicated": distribute_tensor(torch.ones(3), mesh, [Replicate()]),
        "rows": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]),  # sharded: not compared
        "counter": 3,
    }
    local_column = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
    local_column.to_local().fill_(rank)  # a column statistic reduced over this rank's rows only
    state["local_column"] = local_column
    optimizer = SimpleNamespace(state_dict=lambda: {"state": {0: state}, "param_groups": [{"params": [0]}]})
    return replica_divergence(optimizer)

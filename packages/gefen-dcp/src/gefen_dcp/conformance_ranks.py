"""Helpers and spawned-rank functions of gefen-dcp's conformance checks.

Rank functions take ``(rank, world_size, spec, ...)`` and rebuild the target from its
importable ``MODULE:FACTORY`` spec; models are sharded with FSDP2 ``fully_shard`` on a
CPU device mesh over the whole gloo world.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import torch
from gefen_contracts.testing import deep_snapshot, load_target, snapshot_diff
from torch.distributed.checkpoint.api import CheckpointException

from .metadata_reader import GefenFileSystemReader, read_dcp_metadata
from .planners import GefenLoadPlanner, GefenSavePlanner
from .state import GefenDCPState
from .writer import GefenFileSystemWriter

__all__ = [
    "CORRUPTIONS",
    "LOAD_ERRORS",
    "corrupt",
    "load_sharded",
    "load_state",
    "refuse_corrupted",
    "replica_divergence",
    "save_sharded",
    "save_state",
]

#: What a refused ``dcp.load`` raises (DCP's ``CheckpointException`` is a ``BaseException``).
LOAD_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)

CORRUPTIONS = ("flipped_chunk_byte", "edited_envelope", "edited_digest_table", "truncated_data_file")


def save_state(model: torch.nn.Module, optimizer: Any, path: Path) -> None:
    """``dcp.save`` of the model and the optimizer's state through :class:`GefenDCPState`."""
    from torch.distributed.checkpoint.state_dict_saver import save

    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    save(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner())


def load_state(model: torch.nn.Module, optimizer: Any, path: Path, *, with_model: bool) -> None:
    """``dcp.load`` of the optimizer (and, with ``with_model``, the model) from ``path``."""
    from torch.distributed.checkpoint.state_dict_loader import load

    state: dict[str, Any] = {"optim": GefenDCPState(optimizer)}
    if with_model:
        state["model"] = model.state_dict()
    load(state, storage_reader=GefenFileSystemReader(path), planner=GefenLoadPlanner())


def _storage(path: Path, key: str) -> list[Any]:
    metadata = read_dcp_metadata(path / ".metadata")
    return [info for index, info in metadata.storage_data.items() if index.fqn == key]


def _patch(path: Path, info: Any, position: int, value: int) -> None:
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    data[info.offset + position] = value
    target.write_bytes(bytes(data))


def corrupt(path: Path, corruption: str, optimizer: Any) -> None:
    """Apply one corruption class from :data:`CORRUPTIONS` to a single-process checkpoint."""
    if corruption == "flipped_chunk_byte":
        metadata = read_dcp_metadata(path / ".metadata")
        tensors = sorted(
            (info.length, index.fqn, info)
            for index, info in metadata.storage_data.items()
            if index.fqn.startswith("optim.tensors.")
        )
        if not tensors:
            raise AssertionError("the checkpoint holds no optimizer state tensor to corrupt")
        length, _, info = tensors[-1]
        region = (path / info.relative_path).read_bytes()[info.offset : info.offset + length]
        stored = torch.load(io.BytesIO(region), weights_only=True)
        raw = stored.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        position = region.find(raw) if raw else -1
        if position < 0:
            raise AssertionError("could not locate the stored tensor's bytes to corrupt")
        middle = position + len(raw) // 2
        _patch(path, info, middle, region[middle] ^ 0x10)
        return
    if corruption in ("edited_envelope", "edited_digest_table"):
        key = "optim.envelope" if corruption == "edited_envelope" else "optim.digests.writer_00000"
        (info,) = _storage(path, key)
        region = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        position = region.find(b'"format"')
        _patch(path, info, position + 2, ord("F"))
        return
    if corruption == "truncated_data_file":
        data_files = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
        target = max(data_files, key=lambda p: p.stat().st_size)
        with open(target, "r+b") as handle:
            handle.truncate(target.stat().st_size // 2)
        return
    raise ValueError(f"unknown corruption {corruption!r}")


# -- spawned ranks --------------------------------------------------------------------------------


def _build(spec: str, world_size: int) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    target = load_target(spec)
    torch.manual_seed(0)
    model = target.model_builder(0)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = target.factory([(name, p) for name, p in model.named_parameters() if p.requires_grad])
    return target, model, optimizer


def _train(target: Any, model: Any, optimizer: Any, start: int, steps: int) -> list[float]:
    losses = []
    for index in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        loss = target.loss_fn(model, index)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def replica_divergence(optimizer: Any) -> list[str]:
    """The tensors of ``optimizer.state_dict()`` that DCP keeps one copy of (plain tensors, and
    DTensors replicated on every mesh dimension) and that differ between ranks: a reshard keeps
    one rank's copy and drops the rest, and a loss comparison may not see it (a column
    statistic reduced over this rank's rows only). Every rank must call it (object
    collectives over the default group)."""
    import hashlib

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    digests: dict[str, str] = {}

    def visit(value: object, path: str) -> None:
        if isinstance(value, DTensor):
            if all(isinstance(p, Replicate) for p in value.placements):
                visit(value.to_local(), path)
        elif isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            digests[path] = hashlib.sha256(data).hexdigest()
        elif isinstance(value, dict):
            for key in sorted(value, key=repr):
                visit(value[key], f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(item, f"{path}[{index}]")

    visit(optimizer.state_dict(), "state_dict()")
    gathered: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, digests)
    names = sorted(set().union(*gathered))
    return [f"{name} (replicated) differs between ranks" for name in names if len({d.get(name) for d in gathered}) > 1]


def save_sharded(rank: int, world_size: int, spec: str, path: str, steps: int) -> dict[str, list[Any]]:
    """Train ``steps``, save model + optimizer, train the next ``steps``: their losses
    (uninterrupted) and the replicated state that differs between ranks."""
    target, model, optimizer = _build(spec, world_size)
    _train(target, model, optimizer, 0, steps)
    save_state(model, optimizer, Path(path))
    losses = _train(target, model, optimizer, steps, steps)
    return {"losses": losses, "replicas": replica_divergence(optimizer)}


def load_sharded(rank: int, world_size: int, spec: str, path: str, steps: int) -> dict[str, list[Any]]:
    """Load model + optimizer into a fresh sharded run: its next ``steps`` losses and the
    replicated state that differs between ranks."""
    target, model, optimizer = _build(spec, world_size)
    load_state(model, optimizer, Path(path), with_model=True)
    losses = _train(target, model, optimizer, steps, steps)
    return {"losses": losses, "replicas": replica_divergence(optimizer)}


def refuse_corrupted(rank: int, world_size: int, spec: str, path: str, steps: int) -> str:
    """Every rank loads a copy of ``path`` whose envelope rank 0 edited; all must refuse unchanged."""
    import torch.distributed as dist

    target, model, optimizer = _build(spec, world_size)
    _train(target, model, optimizer, 0, steps)
    copy = Path(f"{path}-corrupted")
    if rank == 0:
        shutil.copytree(path, copy)
        corrupt(copy, "edited_envelope", optimizer)
    dist.barrier()
    before = deep_snapshot(optimizer)
    try:
        load_state(model, optimizer, copy, with_model=False)
    except LOAD_ERRORS as exc:
        diffs = snapshot_diff(before, optimizer)
        return "refused unchanged" if not diffs else f"refused ({type(exc).__name__}) but changed: {diffs[:2]}"
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(copy, ignore_errors=True)
    return "accepted a corrupted checkpoint"

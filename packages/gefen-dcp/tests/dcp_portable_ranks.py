"""Rank functions for the portable DCP gloo tests (imported by spawned GlooWorld ranks)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from dcp_portable_adopter import PieceSGD, cuts, group, manifest, reference_momentum
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_dcp import GefenFileSystemWriter, async_save_portable_dcp, load_portable_dcp, save_portable_dcp
from torch.distributed.checkpoint import FileSystemReader

LIMITS = PortableStateLimits(chunk_bytes=24)  # small chunks: fragments span several


def binding(rank: int, world_size: int) -> CheckpointProcessGroupBinding:
    handle = dist.group.WORLD if world_size > 1 else None  # a one-member scope never communicates
    return CheckpointProcessGroupBinding(group(world_size), f"rank:{rank}", handle, "cpu")


class RecordingReader(FileSystemReader):
    """A FileSystemReader that records which stored items it read."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.read_keys: set[str] = set()

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.read_keys.update(item.storage_index.fqn for item in plan.items)
        return super().read_data(plan, planner)


def save(rank: int, world_size: int, path: str, kind: str, steps: int) -> None:
    optimizer = PieceSGD(manifest(kind, world_size, uneven=True), f"rank:{rank}")
    optimizer.train(0, steps)
    save_portable_dcp(
        optimizer,
        checkpoint_process_group=binding(rank, world_size),
        storage_writer=GefenFileSystemWriter(path),
        transaction_id="save",
        limits=LIMITS,
    )


def load(rank: int, world_size: int, path: str, kind: str) -> dict[str, Any]:
    optimizer = PieceSGD(manifest(kind, world_size), f"rank:{rank}")
    reader = RecordingReader(path)
    load_portable_dcp(
        optimizer,
        checkpoint_process_group=binding(rank, world_size),
        storage_reader=reader,
        transaction_id="load",
        limits=LIMITS,
    )
    fragments_read = sorted(k for k in reader.read_keys if ".fragments." in k)
    return {"momentum": optimizer.momentum(), "shards": optimizer.shards, "fragments_read": fragments_read}


def storage_mismatch(rank: int, world_size: int, path: str) -> dict[str, Any]:
    optimizer = PieceSGD(manifest("flat", world_size), f"rank:{rank}")
    optimizer.train(0, 2)
    before = deep_snapshot(optimizer)
    target = path if rank == 0 else f"{path}-elsewhere"
    try:
        save_portable_dcp(
            optimizer,
            checkpoint_process_group=binding(rank, world_size),
            storage_writer=GefenFileSystemWriter(target),
            transaction_id="save",
            limits=LIMITS,
        )
    except Exception as exc:
        written = os.path.exists(os.path.join(target, ".metadata"))
        return {"error": type(exc).__name__, "written": written, "unchanged": not snapshot_diff(before, optimizer)}
    return {"error": None}


def _resign_chunk(root: str, before: bytes, after: bytes) -> None:
    """Replace the SHA-256 of the chunk ``before`` by that of ``after`` wherever a chunk table
    stores it (ASCII hex, the same length, so in place)."""
    import hashlib

    old, new = (hashlib.sha256(data).hexdigest().encode() for data in (before, after))
    found = 0
    for name in os.listdir(root):
        target = os.path.join(root, name)
        with open(target, "rb") as handle:
            data = handle.read()
        if old in data:
            found += data.count(old)
            with open(target, "wb") as handle:
                handle.write(data.replace(old, new))
    assert found == 1


def corrupt_needed_by_one(
    rank: int, world_size: int, path: str, saved_on: int, steps: int, resign: bool = False
) -> dict[str, Any]:
    """Rank 0 copies the checkpoint (saved flat and uneven on ``saved_on`` members) and flips a
    bit in the first chunk of the last fragment of ``embed.weight``, which only the last rank
    of an even flat layout needs; with ``resign``, writes a NaN there instead and re-signs the
    chunk table's digest of that chunk, so the chunks verify and only that rank refuses the
    fragment (its values must be finite)."""
    copy = f"{path}-corrupted"
    if rank == 0:
        shutil.copytree(path, copy)
        numel = 12 * 4
        first = cuts(numel, saved_on, True)[saved_on - 1]
        elements = reference_momentum(steps)["embed.weight"].reshape(-1)[first : first + 4].numpy().tobytes()
        metadata = FileSystemReader(copy).read_metadata()
        key = f"optimizer.fragments.embed.weight.{saved_on - 1}.momentum"
        (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == key and tuple(k.offset) == (0,)]
        target = os.path.join(copy, info.relative_path)
        with open(target, "r+b") as handle:
            handle.seek(info.offset)
            position = handle.read(info.length).find(elements)
            assert position >= 0
            if resign:  # a NaN where a momentum was, its chunk digest re-signed
                chunk = reference_momentum(steps)["embed.weight"].reshape(-1)[first : first + LIMITS.chunk_bytes // 4]
                nan = torch.tensor([float("nan")]).numpy().tobytes()
                handle.seek(info.offset + position)
                handle.write(nan)
                before = chunk.numpy().tobytes()
                _resign_chunk(copy, before, nan + before[len(nan) :])
            else:
                handle.seek(info.offset + position + 1)
                byte = handle.read(1)
                handle.seek(info.offset + position + 1)
                handle.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    optimizer = PieceSGD(manifest("flat", world_size), f"rank:{rank}")
    optimizer.train(0, 1)
    before = deep_snapshot(optimizer)
    try:
        load_portable_dcp(
            optimizer,
            checkpoint_process_group=binding(rank, world_size),
            storage_reader=FileSystemReader(copy),
            transaction_id="load",
            limits=LIMITS,
        )
    except Exception as exc:  # DCP's own CheckpointException (a BaseException) never leaves load_portable_dcp
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "cause": type(cause).__name__ if cause is not None else None,
            "unchanged": not snapshot_diff(before, optimizer),
        }
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(copy, ignore_errors=True)
    return {"error": None, "unchanged": not snapshot_diff(before, optimizer)}


def async_save_then_train(rank: int, world_size: int, path: str) -> dict[str, Any]:
    optimizer = PieceSGD(manifest("region", world_size), f"rank:{rank}")
    optimizer.train(0, 3)
    expected = optimizer.momentum()
    async_group = dist.new_group(backend="gloo")
    future = async_save_portable_dcp(
        optimizer,
        checkpoint_process_group=binding(rank, world_size),
        storage_writer=GefenFileSystemWriter(path),
        transaction_id="async",
        limits=LIMITS,
        async_process_group=async_group,
    )
    optimizer.train(3, 2)
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    dist.destroy_process_group(async_group)
    fresh = PieceSGD(manifest("region", world_size), f"rank:{rank}")
    load_portable_dcp(
        fresh,
        checkpoint_process_group=binding(rank, world_size),
        storage_reader=FileSystemReader(path),
        transaction_id="l",
        limits=LIMITS,
    )
    loaded = fresh.momentum()
    return {"equal": all(torch.equal(loaded[k], v) for k, v in expected.items() if v is not None)}


def composite_save(rank: int, world_size: int, path: str, steps: int) -> None:
    from dcp_portable_adopter import PieceComposite

    composite = PieceComposite("flat", world_size, f"rank:{rank}", uneven=True)
    composite.train(0, steps)
    save_portable_dcp(
        composite,
        checkpoint_process_group=binding(rank, world_size),
        storage_writer=GefenFileSystemWriter(path),
        transaction_id="save",
        limits=LIMITS,
    )


def composite_load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from dcp_portable_adopter import PieceComposite

    composite = PieceComposite("region", world_size, f"rank:{rank}")
    load_portable_dcp(
        composite,
        checkpoint_process_group=binding(rank, world_size),
        storage_reader=FileSystemReader(path),
        transaction_id="l",
        limits=LIMITS,
    )
    shards = {fqn: s for child in composite.children.values() for fqn, s in child.shards.items()}
    return {"momentum": composite.momentum(), "shards": shards}

"""Rank functions for the contracts' gloo tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist
from gefen_contracts import CollectiveFailureError, ContractError
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.torch_support import (
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    CollectiveCounter,
    agree,
    agree_digest,
    failure_vote,
    failure_vote_on_group,
)


def world_binding(rank: int, world_size: int, members: tuple[str, ...] | None = None) -> CodebookProcessGroupBinding:
    members = members or tuple(f"rank:{r}" for r in range(world_size))
    return CodebookProcessGroupBinding(ProcessGroupIdentity("world", members), members[rank], dist.group.WORLD, "cpu")


def echo(rank: int, world_size: int, value: int) -> tuple[int, int, int]:
    return rank, world_size, value * 10


def raise_on(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        raise ValueError(f"boom on {rank}")
    return rank


def unpicklable_on(rank: int, world_size: int, bad_rank: int) -> object:
    return (lambda: rank) if rank == bad_rank else rank


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def die(rank: int, world_size: int, bad_rank: int) -> int:
    if rank == bad_rank:
        os._exit(3)
    return rank


def abort_after_saying(rank: int, world_size: int, bad_rank: int, words: str) -> int:
    """The bad rank writes ``words`` to file descriptor 2 (as C code would) and aborts."""
    if rank == bad_rank:
        os.write(2, words.encode() + b"\n")
        os.abort()
    return rank


def leave_badly(rank: int, world_size: int, bad_rank: int, how: str) -> int:
    """The bad rank answers, then, once its case is over, exits with code 7 (``"exit"``) or
    never exits (``"hang"``): a thread the interpreter waits for at shutdown does it."""
    if rank == bad_rank:
        work = (lambda: (time.sleep(0.2), os._exit(7))) if how == "exit" else (lambda: time.sleep(3600))
        threading.Thread(target=work, daemon=False).start()
    return rank


def validate_bindings(rank: int, world_size: int) -> list[str]:
    outcomes = []
    world_binding(rank, world_size).validate_runtime()
    outcomes.append("ok")
    reversed_members = tuple(f"rank:{r}" for r in reversed(range(world_size)))
    try:
        CodebookProcessGroupBinding(
            ProcessGroupIdentity("world", reversed_members), f"rank:{rank}", dist.group.WORLD, "cpu"
        ).validate_runtime()
    except RuntimeError as exc:
        outcomes.append("order:" + ("local_member" in str(exc)) * "named")
    try:
        members = tuple(f"rank:{r}" for r in range(world_size + 1))
        CheckpointProcessGroupBinding(
            ProcessGroupIdentity("w", members), members[rank], dist.group.WORLD, "cpu"
        ).validate_runtime()
    except RuntimeError as exc:
        outcomes.append("size:" + ("ranks" in str(exc)) * "named")
    try:
        CodebookProcessGroupBinding(ProcessGroupIdentity("w", ("a", "b")), "a", None, "cpu")
    except TypeError:
        outcomes.append("handle")
    return outcomes


def vote_with_fault(rank: int, world_size: int, bad_rank: int, phase: str) -> str:
    binding = world_binding(rank, world_size)
    error = RuntimeError("closure boom") if rank == bad_rank else None
    try:
        failure_vote(binding, phase, error)
    except CollectiveFailureError as exc:
        return f"{exc.local}|{exc}"
    return "no error"


def vote_on_group_with_fault(rank: int, world_size: int, bad_rank: int) -> str:
    error = KeyError("missing") if rank == bad_rank else None
    try:
        failure_vote_on_group(None, "cpu", "preflight", error, member=f"rank:{rank}")
    except CollectiveFailureError as exc:
        return f"{exc.local}|{exc}"
    return "no error"


def agreement(rank: int, world_size: int, diverge: bool) -> str:
    binding = world_binding(rank, world_size)
    values = [1, 2, 3 + (rank if diverge else 0)]
    counter = CollectiveCounter()
    try:
        with counter.patched():
            agree(binding, values, what="the step header")
            agree_digest(binding, "ab" * 32, what="the digest")
    except ContractError as exc:
        return f"error|{exc}|{counter.total}"
    return f"ok|{counter.total}"


def plain_all_reduce(rank: int, world_size: int) -> int:
    tensor = torch.tensor([rank + 1])
    dist.all_reduce(tensor)
    return int(tensor.item())


def dtensor_parameter_facts(rank: int, world_size: int) -> dict[str, object]:
    """What the freshness token and the digest make of an FSDP2-style parameter (a DTensor
    marked as a parameter): whether each in-place write through the DTensor changes the token,
    and the digest's error type."""
    from gefen_contracts.torch_support import state_version_token, tensor_digest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    optimizer.step()

    def copy_into_parameter() -> None:
        with torch.no_grad():  # what model.load_state_dict does
            param.copy_(distribute_tensor(torch.full((4, 2), 5.0), mesh, [Shard(0)]))

    writes = {
        "step": optimizer.step,
        "state": lambda: optimizer.state[param]["momentum_buffer"].mul_(0),
        "copy_": copy_into_parameter,
    }
    changed = {}
    for name, write in writes.items():
        before = state_version_token(optimizer.param_groups, optimizer.state)
        write()
        changed[name] = state_version_token(optimizer.param_groups, optimizer.state) != before
    try:
        tensor_digest(param)
        digest_error = "none"
    except Exception as exc:  # the type is the fact under test
        digest_error = type(exc).__name__
    return {"changed": changed, "digest_error": digest_error}


def dtensor_from_local_facts(rank: int, world_size: int) -> list[str]:
    """Where ``dtensor_from_local`` and ``DTensor.from_local`` differ, for shards of a few global
    shapes (uneven and empty trailing shards, a replicated piece, a piece that needs grad)."""
    from gefen_contracts.torch_support import dtensor_from_local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    differences = []
    for shape, placement, grad in (((5, 3), Shard(0), False), ((1, 4), Shard(0), True), ((3, 0), Replicate(), False)):
        rows = -(-shape[0] // world_size)
        start = min(rank * rows, shape[0])
        local_rows = shape[0] if placement.is_replicate() else min(rows, shape[0] - start)
        local = torch.arange(local_rows * shape[1], dtype=torch.float32).reshape(local_rows, shape[1])
        local.requires_grad_(grad)
        fast = dtensor_from_local(local, mesh, (placement,), shape)
        stride = torch.empty(shape, device="meta").stride()
        slow = DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape), stride=stride)
        for fact in ("shape", "placements", "requires_grad", "dtype"):
            if getattr(fast, fact) != getattr(slow, fact):
                differences.append(f"{shape} {fact}: {getattr(fast, fact)} != {getattr(slow, fact)}")
        if fast.stride() != slow.stride() or fast.device_mesh != slow.device_mesh:
            differences.append(f"{shape} stride or mesh")
        if fast.to_local().data_ptr() != local.data_ptr() or not torch.equal(fast.full_tensor(), slow.full_tensor()):
            differences.append(f"{shape}: not the same storage, or another full tensor")
    return differences


def environment_of(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


def parent_pid(rank: int, world_size: int) -> int:
    return os.getppid()

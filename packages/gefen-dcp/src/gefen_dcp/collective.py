"""The process group a ``GefenDCPState`` checkpoint votes and agrees over.

gefen-dcp reuses the convention's primitives (:func:`gefen_contracts.torch_support.failure_vote`,
:func:`~gefen_contracts.torch_support.agree_digest`) over a
:class:`~gefen_contracts.torch_support.CheckpointProcessGroupBinding` built from the group
DCP saves or loads with. A world of one (or no initialised distributed runtime) has no
binding and runs no collective.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from gefen_contracts import ContractError
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, agree_digest

from .errors import CheckpointLayoutError

__all__ = ["GROUP_NAME", "agree_layout", "checkpoint_binding", "member_coordinate", "shared_save_id"]

GROUP_NAME = "gefen_dcp.checkpoint"


def checkpoint_binding(process_group: Any) -> CheckpointProcessGroupBinding | None:
    """A binding over ``process_group`` (``None``: the default world), or ``None`` when the
    group has one member or ``torch.distributed`` is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialized")
        return None
    group = dist.group.WORLD if process_group is None else process_group
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the checkpoint process group")
    if size == 1:
        return None
    members = tuple(f"member{index}" for index in range(size))
    backend = str(dist.get_backend(group)).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    binding = CheckpointProcessGroupBinding(ProcessGroupIdentity(GROUP_NAME, members), members[rank], group, device)
    binding.validate_runtime()
    return binding


def member_coordinate(binding: CheckpointProcessGroupBinding | None) -> int:
    return 0 if binding is None else binding.coordinate


def agree_layout(binding: CheckpointProcessGroupBinding | None, digest: str) -> None:
    """Every member must hold the same envelope digest (``CheckpointLayoutError`` on every member)."""
    try:
        agree_digest(
            binding, digest, what="the DCP state envelope (state-dict skeleton, tensor dtypes, shapes and placements)"
        )
    except ContractError as exc:
        raise CheckpointLayoutError(str(exc)) from None


def shared_save_id(binding: CheckpointProcessGroupBinding | None) -> str:
    """One fresh random 128-bit save identity (32 hex digits), member 0's, on every member
    (one ``broadcast`` of two int64 on the binding's group and device)."""
    raw = os.urandom(16)
    if binding is None:
        return raw.hex()
    import torch.distributed as dist

    words = torch.tensor(
        [int.from_bytes(raw[:8], "big", signed=True), int.from_bytes(raw[8:], "big", signed=True)],
        dtype=torch.int64,
        device=binding.collective_device,
    )
    dist.broadcast(words, group=binding.process_group, group_src=0)
    return b"".join(int(w).to_bytes(8, "big", signed=True) for w in words.cpu().tolist()).hex()

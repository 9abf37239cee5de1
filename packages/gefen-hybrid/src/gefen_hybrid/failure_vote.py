"""Voting a one-rank failure over every process group the composite's children use.

Before any child mutates, the composite collects a local error (from its step pre-hooks,
the closure, or a child's preflight) and votes it over:

1. every DTensor mesh of its parameters, de-duplicated by content and visited in sorted
   order, each mesh's groups in dimension order (groups of one member are skipped);
2. then every child's ``collective_scope()`` binding that communicates, sorted by
   ``sort_key``, unless its process group was already visited.

The vote carries the accumulated flag from group to group, so in one pass a failure on any
member of a mesh reaches every member of that mesh (dimension by dimension), and a binding
over a super-group reaches every member of the binding. Every rank visits its groups in a
rank-invariant order, so the pass cannot deadlock. Each vote is one int32 ``all_reduce``
(``gefen_contracts.torch_support.failure_vote_on_group``); a single-process run with no
groups re-raises the local error unchanged and runs no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import CollectiveFailureError
from gefen_contracts.protocols import CollectiveScoped
from gefen_contracts.torch_support import ProcessGroupBinding, failure_vote_on_group

from .tensor_checks import is_dtensor

__all__ = ["VoteGroup", "step_vote_groups", "vote_failure"]


@dataclass(frozen=True, slots=True, eq=False)
class VoteGroup:
    """One process group to vote on and the device its control tensor lives on."""

    process_group: Any
    device: torch.device


class _PeerFailure(RuntimeError):
    """Stands for "a peer already failed" while the accumulated flag travels on."""


def _distributed_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _device_for(process_group: Any) -> torch.device:
    import torch.distributed as dist

    if str(dist.get_backend(process_group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh_key(mesh: Any) -> tuple[object, ...]:
    return (
        str(mesh.device_type),
        tuple(mesh.mesh.shape),
        tuple(int(r) for r in mesh.mesh.flatten().tolist()),
        tuple(mesh.mesh_dim_names or ()),
    )


def step_vote_groups(children: Sequence[torch.optim.Optimizer]) -> tuple[VoteGroup, ...]:
    """The process groups a step's failure vote runs over, in rank-invariant order."""
    if not _distributed_ready():
        return ()
    import torch.distributed as dist

    meshes: dict[tuple[object, ...], Any] = {}
    seen_mesh_ids: set[int] = set()
    for child in children:
        for group in child.param_groups:
            for parameter in group["params"]:
                if not is_dtensor(parameter):
                    continue
                mesh = parameter.device_mesh
                if id(mesh) in seen_mesh_ids:
                    continue
                seen_mesh_ids.add(id(mesh))
                meshes.setdefault(_mesh_key(mesh), mesh)
    ordered: list[Any] = []
    for key in sorted(meshes):
        mesh = meshes[key]
        for dim in range(mesh.ndim):
            ordered.append(mesh.get_group(dim))
    bindings = [
        scope
        for child in children
        if isinstance(child, CollectiveScoped)
        and isinstance(scope := child.collective_scope(), ProcessGroupBinding)
        and scope.communicates
    ]
    votes: list[VoteGroup] = []
    visited: list[Any] = []
    for process_group in ordered:
        if any(process_group is v for v in visited) or dist.get_world_size(process_group) <= 1:
            continue
        visited.append(process_group)
        votes.append(VoteGroup(process_group, _device_for(process_group)))
    for binding in sorted(bindings, key=lambda b: b.sort_key):
        if any(binding.process_group is v for v in visited):
            continue
        visited.append(binding.process_group)
        votes.append(VoteGroup(binding.process_group, binding.collective_device))
    return tuple(votes)


def vote_failure(groups: Sequence[VoteGroup], phase: str, error: BaseException | None) -> None:
    """Raise on every member if ``phase`` failed on any member of any of ``groups``.

    Without groups the local ``error`` is re-raised unchanged. Otherwise every group is
    voted on (even after a failure is known, so no peer is left waiting), then the failing
    member raises :class:`~gefen_contracts.CollectiveFailureError` (``local=True``, chained
    to its error) and the others raise it with ``local=False``.
    """
    if not groups:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    member = f"rank {dist.get_rank()}"
    peer_failed = False
    for group in groups:
        flag = error if error is not None else (_PeerFailure(phase) if peer_failed else None)
        try:
            failure_vote_on_group(group.process_group, group.device, phase, flag, member=member)
        except CollectiveFailureError:
            peer_failed = True
    if error is not None:
        raise CollectiveFailureError(
            f"{phase} failed on local member {member!r}: {type(error).__name__}: {error}", phase=phase, local=True
        ) from error
    if peer_failed:
        raise CollectiveFailureError(f"{phase} failed on another process-group member", phase=phase, local=False)

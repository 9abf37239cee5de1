"""DTensor (FSDP2) handling: local shards, supported placements, the factored collective.

Gefen steps the local shard of a DTensor parameter. Supported layouts are DTensors on a
1-D device mesh with placement ``Shard(0)`` (what FSDP2's ``fully_shard`` produces) or
``Replicate()``; anything else is refused when the parameter is registered.

Representation per layout (the default constructor works everywhere):

* block second moment, momentum and periods are rank-local, periods chosen from the
  global shape (:func:`gefen_core.periods.shape_period`) so every rank cuts the same blocks;
* the codebook is the mesh's: the 4096-bin gradient histogram (int64, exact and order free)
  is summed over the mesh with one ``all_reduce`` when a codebook is learned (the first
  step, refreshes), so every rank holds the same codebook and a checkpoint's codes mean
  the same on any number of ranks;
* the factored second moment of a row-sharded (``Shard(0)``) 2-D parameter keeps its local
  rows of ``v_row`` and a replicated ``v_col``; the float64 column sums of ``g^2`` are summed
  over the mesh with one ``all_reduce`` per mesh per step (every factored row-sharded
  parameter of the step travels in the same packet). Every rank of the mesh must therefore
  step the same row-sharded 2-D parameters (true under FSDP2, where every rank gets every
  gradient);
* so before a step's first collective the members agree (:func:`agree_step`, one
  ``all_gather`` of two int64 per step): a member whose step failed (a non-finite first
  gradient, say) makes every member raise, instead of leaving the others waiting in the next
  collective, and members stepping different DTensor parameters raise together instead of
  summing one parameter's statistics into another's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from gefen_contracts import CollectiveFailureError
from gefen_contracts.torch_support import is_dtensor, local_tensor

from .errors import ShardAgreementError

__all__ = [
    "STEP_PHASE",
    "agree_step",
    "all_reduce_sums",
    "check_parameter_layout",
    "counted_once_per_mesh",
    "is_dtensor",
    "is_row_sharded",
    "learning_mesh",
    "local_tensor",
    "shard_rows",
    "sum_over_mesh",
    "topology_record",
]


def _placement_kind(tensor: Any) -> str:
    from torch.distributed.tensor import Replicate, Shard

    placement = tensor.placements[0]
    if isinstance(placement, Shard) and placement.dim == 0:
        return "shard0"
    if isinstance(placement, Replicate):
        return "replicate"
    return type(placement).__name__


def check_parameter_layout(param: torch.Tensor, where: str) -> None:
    """Refuse DTensor layouts Gefen does not support (``ParameterError`` naming ``where``)."""
    if not is_dtensor(param):
        return
    from .errors import ParameterError

    mesh = param.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1:
        raise ParameterError(f"{where}: DTensor parameters must live on a 1-D device mesh, got {mesh.ndim}-D")
    kind = _placement_kind(param)
    if kind not in ("shard0", "replicate"):
        raise ParameterError(
            f"{where}: DTensor placement {param.placements[0]} is not supported (use Shard(0), as "  # type: ignore[attr-defined]
            f"fully_shard does, or Replicate())"
        )


def is_row_sharded(param: torch.Tensor) -> bool:
    """True for a ``Shard(0)`` DTensor (whose rows are split across the mesh)."""
    return is_dtensor(param) and _placement_kind(param) == "shard0"


def topology_record(param: torch.Tensor) -> dict[str, object] | None:
    """What a rank-local checkpoint of ``param`` depends on (``None`` for plain tensors):
    mesh size, this rank's mesh coordinate, placement, global and local shapes."""
    if not is_dtensor(param):
        return None
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return {
        "mesh_size": int(mesh.size()),
        "coordinate": int(mesh.get_local_rank()),
        "placement": _placement_kind(param),
        "global_shape": [int(d) for d in param.shape],
        "local_shape": [int(d) for d in local_tensor(param).shape],
    }


def all_reduce_sums(entries: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Sum float64 vectors over each parameter's mesh, in place (column sums of ``g^2``, the
    clipping statistic of :func:`gefen_core.second_moment.preconditioned_sumsq`).

    ``entries`` are ``(row-sharded parameter, sums)`` pairs in the step's parameter
    order; parameters sharing a mesh travel in one packet (one ``all_reduce`` per mesh).
    """
    import torch.distributed as dist

    by_mesh: dict[int, list[tuple[Any, torch.Tensor]]] = {}
    meshes: dict[int, Any] = {}
    for param, sums in entries:
        mesh = param.device_mesh  # type: ignore[attr-defined]
        by_mesh.setdefault(id(mesh), []).append((param, sums))
        meshes[id(mesh)] = mesh
    for key, items in by_mesh.items():
        packet = torch.cat([sums.reshape(-1) for _, sums in items])
        dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=meshes[key].get_group())
        offset = 0
        for _, sums in items:
            sums.copy_(packet[offset : offset + sums.numel()].view_as(sums))
            offset += sums.numel()


def learning_mesh(params: Iterable[torch.Tensor]) -> Any:
    """The device mesh (two or more members) the DTensor ``params`` live on, or ``None``.

    Raises :class:`~gefen_core.errors.ParameterError` when they span meshes over different
    ranks: one codebook cannot be agreed over two groups.
    """
    found: Any = None
    for param in params:
        if not is_dtensor(param):
            continue
        mesh = param.device_mesh  # type: ignore[attr-defined]
        if mesh.size() < 2:
            continue
        if found is None:
            found = mesh
        elif found is not mesh and found.mesh.tolist() != mesh.mesh.tolist():
            from .errors import ParameterError

            raise ParameterError(
                f"DTensor parameters live on meshes over ranks {found.mesh.tolist()} and {mesh.mesh.tolist()}; "
                "Gefen agrees one codebook over one mesh (give each mesh its own optimizer)"
            )
    return found


def counted_once_per_mesh(param: torch.Tensor) -> bool:
    """False on the non-zero coordinates of a ``Replicate()`` DTensor (its gradient is on every rank)."""
    return not is_dtensor(param) or is_row_sharded(param) or int(param.device_mesh.get_local_rank()) == 0  # type: ignore[attr-defined]


def shard_rows(rows: int, world: int, coordinate: int) -> tuple[int, int]:
    """``(start, length)`` of member ``coordinate``'s rows under ``Shard(0)`` (``torch.chunk``'s rule)."""
    chunk = -(-rows // world) if world else 0
    start = min(chunk * coordinate, rows)
    return start, max(0, min(rows, start + chunk) - start)


#: The phase a failure voted by :func:`agree_step` names.
STEP_PHASE = "step"


def agree_step(
    mesh: Any, error: BaseException | None, stepping: Sequence[int], slot_names: Callable[[], Sequence[str]]
) -> None:
    """Agree, over ``mesh``, that every member planned its step and steps the same DTensor
    parameters (``stepping``: their slots, the optimizer's parameter positions). One
    ``all_gather`` of ``[failed, digest of stepping]``; every member sees every row, so all
    raise together: :class:`~gefen_contracts.CollectiveFailureError` when one failed (the
    failing member's carries ``error``, also as its cause), else
    :class:`~gefen_core.errors.ShardAgreementError` when the slots differ (one more
    ``all_reduce`` names the parameters and how many members step them)."""
    import torch.distributed as dist

    group = mesh.get_group()
    digest = int.from_bytes(hashlib.sha256(",".join(map(str, stepping)).encode()).digest()[:8], "big", signed=True)
    header = torch.tensor([int(error is not None), digest], dtype=torch.int64, device=mesh.device_type)
    gathered = [torch.empty_like(header) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, header, group=group)
    rows = [row.tolist() for row in gathered]
    if error is not None:
        raise CollectiveFailureError(
            f"Gefen's step failed on this member of the mesh: {type(error).__name__}: {error}",
            phase=STEP_PHASE,
            local=True,
        ) from error
    if any(row[0] for row in rows):
        raise CollectiveFailureError("Gefen's step failed on another member of the mesh", phase=STEP_PHASE, local=False)
    if any(row[1] != rows[0][1] for row in rows):
        names = slot_names()
        bits = torch.zeros(len(names), dtype=torch.int64, device=mesh.device_type)
        bits[list(stepping)] = 1
        dist.all_reduce(bits, op=dist.ReduceOp.SUM, group=group)
        world = len(rows)
        uneven = [f"{names[slot]} ({n}/{world} members)" for slot, n in enumerate(bits.tolist()) if 0 < n < world]
        raise ShardAgreementError(
            f"Gefen: the members of the mesh step different DTensor parameters (gradient presence differs: "
            f"{', '.join(uneven)}); every member must step the same sharded parameters, as FSDP2 gives each one "
            "every gradient"
        )


def sum_over_mesh(counts: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``counts`` summed over ``mesh`` (one ``all_reduce`` on the mesh's device), on the CPU."""
    import torch.distributed as dist

    packet = counts.to(mesh.device_type)
    dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return packet.cpu()

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
  gradient).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from gefen_contracts.torch_support import is_dtensor, local_tensor

__all__ = [
    "all_reduce_sums",
    "check_parameter_layout",
    "counted_once_per_mesh",
    "is_dtensor",
    "is_row_sharded",
    "learning_mesh",
    "local_tensor",
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


def sum_over_mesh(counts: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``counts`` summed over ``mesh`` (one ``all_reduce`` on the mesh's device), on the CPU."""
    import torch.distributed as dist

    packet = counts.to(mesh.device_type)
    dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return packet.cpu()

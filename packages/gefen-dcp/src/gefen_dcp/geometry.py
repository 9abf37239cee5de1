"""Where a tensor's local shard sits in its global tensor (a box: offsets and sizes).

A state tensor is saved as DCP items at its local shard's global offsets, so DCP can
reshard it onto any later layout; on load, a tensor placed like its parameter gets the box
the parameter's mesh and placements give its global shape on this rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from gefen_contracts.torch_support import is_dtensor, local_tensor

from .errors import CheckpointLayoutError

__all__ = ["ShardGeometry", "is_dtensor", "local_box", "local_tensor", "shard_geometry"]


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    """A local shard: the global shape, the shard's global ``offsets`` and its ``sizes``."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        rank = len(self.global_shape)
        if len(self.offsets) != rank or len(self.sizes) != rank:
            raise CheckpointLayoutError(
                f"shard geometry rank mismatch: global {self.global_shape}, offsets {self.offsets}, sizes {self.sizes}"
            )
        for axis, (offset, size, dim) in enumerate(zip(self.offsets, self.sizes, self.global_shape)):
            if offset < 0 or size < 0 or offset + size > dim:
                raise CheckpointLayoutError(
                    f"shard geometry axis {axis}: [{offset}, {offset + size}) is outside dimension {dim}"
                )

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def overlap(
        self, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The intersection of a global box with this shard, as (global offsets, sizes), or ``None``."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, offsets))
        ends = tuple(min(a + la, b + lb) for a, la, b, lb in zip(self.offsets, self.sizes, offsets, sizes))
        if not starts:
            return (), ()
        if any(end <= start for start, end in zip(starts, ends)):
            return None
        return starts, tuple(end - start for start, end in zip(starts, ends))


def shard_geometry(parameter: object, *, where: str) -> ShardGeometry:
    """The geometry of ``parameter``'s local shard (a plain tensor is its own full shard)."""
    if is_dtensor(parameter):
        mesh = parameter.device_mesh  # type: ignore[attr-defined]
        if mesh.get_coordinate() is None:
            raise CheckpointLayoutError(f"{where}: this process is not in the parameter's device mesh")
        global_shape = tuple(int(d) for d in parameter.shape)  # type: ignore[attr-defined]
        geometry = _placed_box(global_shape, mesh, tuple(parameter.placements))  # type: ignore[attr-defined]
        local_shape = tuple(int(d) for d in local_tensor(parameter).shape)  # type: ignore[arg-type]
        if local_shape != geometry.sizes:
            raise CheckpointLayoutError(
                f"{where}: the DTensor's local tensor has shape {local_shape} but its chunk is {geometry.sizes}"
            )
        return geometry
    if isinstance(parameter, torch.Tensor):
        shape = tuple(int(d) for d in parameter.shape)
        return ShardGeometry(shape, (0,) * len(shape), shape)
    raise CheckpointLayoutError(
        f"{where}: the parameter must be a torch.Tensor or DTensor, got {type(parameter).__name__}"
    )


def local_box(global_shape: tuple[int, ...], parameter: object, *, where: str) -> ShardGeometry:
    """This rank's box of a tensor of ``global_shape`` placed like ``parameter`` (a DTensor
    parameter's mesh and placements), or the whole tensor when ``parameter`` is ``None`` or
    a plain tensor."""
    if parameter is None or not is_dtensor(parameter):
        return ShardGeometry(global_shape, (0,) * len(global_shape), global_shape)
    mesh = parameter.device_mesh  # type: ignore[attr-defined]
    if mesh.get_coordinate() is None:
        raise CheckpointLayoutError(f"{where}: this process is not in the parameter's device mesh")
    return _placed_box(global_shape, mesh, tuple(parameter.placements))  # type: ignore[attr-defined]


@lru_cache(maxsize=1024)
def _placed_box(global_shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> ShardGeometry:
    # memoised: torch's computation costs tens of microseconds a call, and a load asks it for
    # every state tensor while a model has only a few distinct (shape, placement) pairs
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(torch.Size(global_shape), mesh, placements)
    return ShardGeometry(global_shape, tuple(int(o) for o in offsets), tuple(int(n) for n in sizes))

"""Local, collective-free checks and copies of plain tensors and DTensor local shards.

Validation must never run a collective (a one-rank failure would strand its peers), so
every check here looks only at a DTensor's local shard. ``torch.distributed.tensor`` is
imported only if something already imported it: no DTensor can exist before that.
"""

from __future__ import annotations

from typing import Any

import torch
from gefen_contracts.torch_support import is_dtensor, local_tensor

__all__ = ["is_dtensor", "local_tensor", "same_placement", "tensor_kind"]


def same_placement(value: torch.Tensor, reference: torch.Tensor) -> bool:
    """True when both are plain tensors, or both are DTensors on the same mesh and placements."""
    if is_dtensor(value) != is_dtensor(reference):
        return False
    if not is_dtensor(value):
        return True
    a: Any = value
    b: Any = reference
    return bool(a.device_mesh == b.device_mesh and tuple(a.placements) == tuple(b.placements))


def tensor_kind(value: torch.Tensor) -> str:
    """``"DTensor"`` or ``"tensor"``, for error messages."""
    return "DTensor" if is_dtensor(value) else "tensor"

"""Row packs: a parameter's small per-row state fields saved as one DCP item.

DCP frames every item it writes and lists it in ``.metadata``; on a model of a few hundred
tensors that per-item cost (bytes on disk, save and load time) is of the order of the state
itself. So a parameter's fields of one dtype whose declared geometry is per row or per block
(``StateGeometry.ROW`` / ``BLOCK``: Gefen's block scales ``m_magnitude`` with ``v_row`` or
``vmean``) are saved side by side as the columns of one ``[rows, width]`` tensor, placed like
the parameter: each field occupies a run of columns, flattened past its first dimension. The
rows shard as the parameter's do, so DCP reshards the pack as it would each field. Only
parameters sharded along their first dimension (or not at all) are packed; per-element and
per-column fields never are (they are large, or replicated). The envelope records each pack's
members (:class:`Member`, in column order), and a load cuts the fields back out before the
optimizer sees them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gefen_contracts import StateGeometry
from gefen_contracts.torch_support import dtensor_from_local

from .envelope import LIKE_PARAMETER
from .geometry import is_dtensor, local_tensor
from .skeleton import parameter_index

__all__ = ["PACKED_GEOMETRIES", "Member", "pack_rows", "unpacked"]

#: The declared geometries whose fields are packed.
PACKED_GEOMETRIES = frozenset({StateGeometry.ROW.value, StateGeometry.BLOCK.value})


@dataclass(frozen=True, slots=True)
class Member:
    """One field of a pack: its tensor key and its shape past the first dimension."""

    key: str
    trailing: tuple[int, ...]

    @property
    def width(self) -> int:
        return math.prod(self.trailing)


def _packable(tensor: torch.Tensor) -> bool:
    if tensor.dim() < 1:
        return False
    if not is_dtensor(tensor):
        return True
    # the pack's rows shard as the parameter's only when nothing shards another dimension
    return all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in tensor.placements)  # type: ignore[attr-defined]


def _pack(members: list[str], tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    first = tensors[members[0]]
    rows = local_tensor(first).shape[0]
    # explicit widths: a rank may hold no rows of a small parameter (FSDP2 gives trailing ranks
    # empty shards), and a reshape of zero elements to [0, -1] has no width to infer
    pieces = [local_tensor(tensors[key]).reshape(rows, math.prod(tensors[key].shape[1:])) for key in members]
    packed = torch.cat(pieces, dim=1)
    if not is_dtensor(first):
        return packed
    return dtensor_from_local(packed, first.device_mesh, first.placements, (first.shape[0], packed.shape[1]))  # type: ignore[attr-defined]


def pack_rows(
    tensors: Mapping[str, torch.Tensor], placements: Mapping[str, str], geometry: Mapping[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[Member, ...]]]:
    """The tensors to save (each pack in place of its members) and each pack's members.

    ``placements`` is every key's placement class, ``geometry`` a field name's declared
    geometry (an undeclared field is never packed). A pack holds two or more fields of one
    parameter with one dtype, one first dimension and a packed geometry, sorted by key; its
    key is ``state/<i>/<a>+<b>...``.
    """
    groups: dict[tuple[int, torch.dtype, int], list[str]] = {}
    for key, tensor in tensors.items():
        index = parameter_index(key)
        field = key.rsplit("/", 1)[-1]
        if index is None or placements[key] != LIKE_PARAMETER or geometry.get(field) not in PACKED_GEOMETRIES:
            continue
        if _packable(tensor):
            groups.setdefault((index, tensor.dtype, int(tensor.shape[0])), []).append(key)
    stored = dict(tensors)
    packs: dict[str, tuple[Member, ...]] = {}
    for (index, _, _), keys in sorted(groups.items(), key=lambda item: (item[0][0], str(item[0][1]))):
        members = sorted(keys)
        name = f"state/{index}/" + "+".join(key.split("/", 2)[2] for key in members)
        if len(members) < 2 or name in tensors:
            continue
        packed = _pack(members, tensors)
        for key in members:
            del stored[key]
        stored[name] = packed
        packs[name] = tuple(Member(key, tuple(int(d) for d in tensors[key].shape[1:])) for key in members)
    return stored, packs


def unpacked(local: torch.Tensor, members: tuple[Member, ...]) -> dict[str, torch.Tensor]:
    """Each member's local tensor, cut from a pack's local ``[rows, width]`` tensor (owned copies)."""
    rows = local.shape[0]
    out: dict[str, torch.Tensor] = {}
    start = 0
    for member in members:
        out[member.key] = local[:, start : start + member.width].reshape((rows, *member.trailing)).clone()
        start += member.width
    return out

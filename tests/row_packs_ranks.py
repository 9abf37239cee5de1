"""Rank functions for tests/test_dcp_row_packs.py: gefen-dcp's row packs on DTensors of a real
gloo mesh (run inside GlooWorld ranks)."""

from __future__ import annotations

from typing import Any

import torch
from gefen_dcp.row_packs import Member, pack_rows, unpacked
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

GEOMETRY = {"m_magnitude": "block", "v_row": "row", "codes": "parameter"}


def pack_by_placement(rank: int, world_size: int) -> dict[str, Any]:
    """Pack a parameter's per-row fields sharded along dim 0 (packed, rows intact) and along
    dim 1 (left alone); report what happened on this rank."""
    del rank
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    scales, v_row, wide = torch.randn(7, 2), torch.randn(7), torch.randn(7, 4)
    rows = {
        "state/0/m_magnitude": distribute_tensor(scales, mesh, [Shard(0)]),
        "state/0/v_row": distribute_tensor(v_row, mesh, [Shard(0)]),
        "state/0/codes": distribute_tensor(torch.zeros(7, 4, dtype=torch.uint8), mesh, [Shard(0)]),
    }
    columns = {
        "state/0/m_magnitude": distribute_tensor(scales.repeat(1, 2), mesh, [Shard(1)]),
        "state/0/v_row": distribute_tensor(wide, mesh, [Shard(1)]),
    }
    placements = dict.fromkeys(rows, "like_parameter")
    stored, packs = pack_rows(rows, placements, GEOMETRY)
    (name,) = packs
    pack = stored[name]
    cut = unpacked(pack.to_local(), packs[name])  # type: ignore[attr-defined]
    column_stored, column_packs = pack_rows(columns, dict.fromkeys(columns, "like_parameter"), GEOMETRY)
    return {
        "name": name,
        "members": [(m.key, m.trailing) for m in packs[name]],
        "stored": sorted(stored),
        "global_shape": tuple(pack.shape),
        "placed_like_members": tuple(pack.placements) == (Shard(0),),  # type: ignore[attr-defined]
        "rows_intact": torch.equal(cut["state/0/m_magnitude"], rows["state/0/m_magnitude"].to_local())
        and torch.equal(cut["state/0/v_row"], rows["state/0/v_row"].to_local()),
        "column_packs": sorted(column_packs),
        "column_stored": sorted(column_stored),
        "member_type": isinstance(packs[name][0], Member),
    }


def pack_empty_shard(rank: int, world_size: int) -> dict[str, Any]:
    """Pack a one-row parameter's fields sharded along dim 0: every rank but the first holds no
    rows (as FSDP2 shards a ``[1, d]`` head or a one-element bias)."""
    mesh = init_device_mesh("cpu", (world_size,))
    scales, v_row = torch.arange(3.0).reshape(1, 3), torch.ones(1)
    fields = {
        "state/0/m_magnitude": distribute_tensor(scales, mesh, [Shard(0)]),
        "state/0/v_row": distribute_tensor(v_row, mesh, [Shard(0)]),
    }
    stored, packs = pack_rows(fields, dict.fromkeys(fields, "like_parameter"), GEOMETRY)
    (name,) = packs
    local = stored[name].to_local()  # type: ignore[attr-defined]
    cut = unpacked(local, packs[name])
    return {
        "rank": rank,
        "global_shape": tuple(stored[name].shape),
        "local_rows": int(local.shape[0]),
        "cut_shapes": {key: tuple(value.shape) for key, value in cut.items()},
        "full": stored[name].full_tensor().tolist(),  # type: ignore[attr-defined]
    }

"""Gefen's small per-row fields travel through ``GefenDCPState`` as row packs (gefen-dcp's
``row_packs``): one DCP item per parameter for the block scales and ``v_row`` / ``vmean``,
cut back out on load, bit for bit. Per-element fields (codes, a narrow matrix's ``v``) and
replicated ones (``v_col``) stay items of their own."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import row_packs_ranks
import torch
import torch.distributed.checkpoint as dcp
from gefen_contracts.testing import GlooWorld
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_core import Gefen
from gefen_dcp import GefenDCPState, GefenFileSystemReader, GefenFileSystemWriter, GefenLoadPlanner, GefenSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # a factored matrix (both sides >= 128), its bias (block), a narrow matrix (element v)
    return torch.nn.Sequential(torch.nn.Linear(128, 160), torch.nn.Linear(160, 8, bias=False))


def _trained(steps: int) -> tuple[torch.nn.Module, Gefen]:
    model = _model()
    optimizer = Gefen(model.named_parameters(), lr=1e-2)
    for step in range(steps):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 128)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_row_fields_are_packed_and_come_back_bit_for_bit(tmp_path: Path) -> None:
    model, optimizer = _trained(3)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"optim": GefenDCPState(optimizer)},
            storage_writer=GefenFileSystemWriter(tmp_path),
            planner=GefenSavePlanner(),
        )
        tensors = {
            key.removeprefix("optim.tensors."): value
            for key, value in GefenFileSystemReader(tmp_path).read_metadata().state_dict_metadata.items()
            if key.startswith("optim.tensors.") and isinstance(value, TensorStorageMetadata)
        }
        assert {
            "like_parameter.state/0/m_magnitude+v_row",  # factored: scales [160, 1] beside v_row [160]
            "like_parameter.state/1/m_magnitude+vmean",  # block
            "like_parameter.state/2/m_magnitude",  # element: its v is per element, never packed
            "like_parameter.state/2/v",
            "replicated.state/0/v_col",
        } <= set(tensors)
        assert tuple(tensors["like_parameter.state/0/m_magnitude+v_row"].size) == (160, 2)
        assert not any(key.endswith(("/v_row", "/vmean")) for key in tensors)
        twin_model, twin = _trained(0)
        dcp.load(
            {"optim": GefenDCPState(twin)}, storage_reader=GefenFileSystemReader(tmp_path), planner=GefenLoadPlanner()
        )
    assert_trees_equal(twin.state_dict(), optimizer.state_dict())
    twin_model.load_state_dict(model.state_dict())
    for a, b in zip(_step(model, optimizer), _step(twin_model, twin), strict=True):
        assert torch.equal(a, b)


def _step(model: torch.nn.Module, optimizer: Gefen) -> list[torch.Tensor]:
    torch.manual_seed(7)
    model(torch.randn(4, 128)).square().mean().backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.distributed
def test_packs_follow_row_sharded_dtensors_and_leave_others_alone(world2: GlooWorld) -> None:
    """On a 2-rank mesh: fields sharded along dim 0 pack into one DTensor placed like them whose
    local rows are the fields' local rows; fields sharded along dim 1 are not packed."""
    for report in world2.run(row_packs_ranks.pack_by_placement):
        assert report["name"] == "state/0/m_magnitude+v_row"
        assert report["members"] == [("state/0/m_magnitude", (2,)), ("state/0/v_row", ())]
        assert report["stored"] == ["state/0/codes", "state/0/m_magnitude+v_row"]  # codes: per element
        assert report["global_shape"] == (7, 3) and report["placed_like_members"]
        assert report["rows_intact"] and report["member_type"]
        assert report["column_packs"] == [] and report["column_stored"] == ["state/0/m_magnitude", "state/0/v_row"]


@pytest.mark.distributed
def test_a_rank_without_rows_packs_an_empty_piece(world2: GlooWorld) -> None:
    """A one-row parameter on 2 ranks: the second holds no rows, and packs (and cuts) an empty
    ``[0, width]`` piece; the pack's full tensor is the fields side by side."""
    for report in world2.run(row_packs_ranks.pack_empty_shard):
        assert report["global_shape"] == (1, 4)
        rows = 1 if report["rank"] == 0 else 0
        assert report["local_rows"] == rows
        assert report["cut_shapes"] == {"state/0/m_magnitude": (rows, 3), "state/0/v_row": (rows,)}
        assert report["full"] == [[0.0, 1.0, 2.0, 1.0]]

"""``tools/dcp_layout_sim.py``: the packed-layout stand-in holds exactly that layout and goes
through torch's checkpoint recipe, so ``gefen bench dcp`` measures the layout and nothing else."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.model import kit_loss, make_kit_model
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import dcp_layout_sim

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _stepped(seed: int) -> tuple[torch.nn.Module, dcp_layout_sim.PackedLayoutSim]:
    model = make_kit_model(seed)
    optimizer = dcp_layout_sim.factory(list(model.named_parameters()))
    kit_loss(model, 0).backward()
    optimizer.step()
    return model, optimizer


def test_each_parameter_holds_the_packed_layout_and_nothing_else() -> None:
    model, optimizer = _stepped(0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()  # a second step creates nothing and updates nothing
    matrices = 0
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        assert state["counters"].dtype == torch.int64 and state["counters"].shape == (2,), name
        assert state["packed"].dtype == torch.uint8, name
        if param.dim() == 2:
            matrices += 1
            rows, cols = param.shape
            assert set(state) == {"packed", "v_col", "counters"}, name
            assert state["packed"].shape == (rows, cols + dcp_layout_sim.ROW_TAIL), name
            assert state["v_col"].dtype == torch.float32 and state["v_col"].shape == (cols,), name
        else:
            assert set(state) == {"packed", "counters"}, name
            assert state["packed"].shape == param.shape, name
        assert torch.equal(param.detach(), before[name]), name
    assert matrices  # the kit model has both kinds


def test_torch_s_recipe_round_trips_it_with_one_item_per_state_tensor(tmp_path: Path) -> None:
    model, optimizer = _stepped(0)
    for state in optimizer.state.values():  # values a load must carry, not zeros it would also find
        for tensor in state.values():
            tensor.copy_(torch.arange(tensor.numel()).reshape(tensor.shape))
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=str(tmp_path))
    fresh_model = make_kit_model(0)
    fresh = dcp_layout_sim.factory(list(fresh_model.named_parameters()))
    template = get_optimizer_state_dict(fresh_model, fresh)  # torch's zero-gradient step creates the state
    dcp.load(template, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(fresh_model, fresh, template)
    assert_trees_equal(optimizer.state_dict(), fresh.state_dict(), "the packed layout after torch's recipe")
    _, direct = _stepped(1)  # its own load keeps the dtypes (torch's would cast the codes to fp32)
    direct.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert_trees_equal(optimizer.state_dict(), direct.state_dict(), "the packed layout after load_state_dict")
    tensors = [
        key
        for key, entry in FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    ]
    params = list(model.parameters())
    assert len(tensors) == 2 * len(params) + sum(p.dim() == 2 for p in params)

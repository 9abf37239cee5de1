"""Rank functions for tests/test_gefen_dcp_state_resharding.py: ``Gefen`` (its defaults, factored v
included) and ``GefenMuon`` on FSDP2 ``fully_shard`` models, saved and loaded through
``GefenDCPState`` (run inside GlooWorld ranks, and in-process for one-rank loads).

Every rank trains on the same batch, so the losses are identical on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gefen import GefenMuonHybrid
from gefen_core import Gefen, GefenMuon
from gefen_dcp import GefenDCPState, GefenFileSystemWriter, GefenLoadPlanner, GefenSavePlanner
from torch import nn

BEFORE = 6
AFTER = 20


class Net(nn.Module):
    """Embedding, two matrices with biases, a norm and a head (Gefen)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(24, 16)
        self.hidden = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.hidden(self.embed(tokens)))))  # type: ignore[no-any-return]


class Matrices(nn.Module):
    """Matrices only (GefenMuon)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(24, 16) * 0.5)
        self.hidden = nn.Linear(16, 24, bias=False)
        self.head = nn.Linear(24, 6, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed[tokens])))  # type: ignore[no-any-return]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, 24, (6, 5), generator=generator)
    target = torch.randn(6, 5, 6, generator=generator)
    return nn.functional.mse_loss(model(tokens), target)


def build(kind: str, world_size: int | None) -> tuple[nn.Module, Any]:
    """A model sharded with ``fully_shard`` over the world (``None``: plain) and its optimizer."""
    torch.manual_seed(0)
    model: nn.Module = Matrices() if kind == "muon" else Net()
    if world_size is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    if kind == "muon":
        return model, GefenMuon(model.named_parameters(), lr=2e-2)
    if kind == "hybrid":  # GefenMuon (exact mode) on the hidden matrix, AdamW on the rest
        return model, GefenMuonHybrid(model, lr=1e-2, backup_optimizer="adamw")
    # FSDP2 keeps one block per element of a sharded 1-D parameter; a single process with the
    # same rule holds the same state shapes, so its checkpoint reshards onto FSDP2 exactly.
    return model, Gefen(model.named_parameters(), lr=1e-2, force_1d_period_one=world_size is None)


def train(model: nn.Module, optimizer: Any, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, step)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def train_save_continue(rank: int, world_size: int | None, kind: str, path: str) -> list[float]:
    """Train, save model + optimizer through GefenDCPState, return the uninterrupted losses."""
    model, optimizer = build(kind, world_size)
    train(model, optimizer, 0, BEFORE)
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner())
    return train(model, optimizer, BEFORE, AFTER)


def _load(model: nn.Module, optimizer: Any, path: str | Path, keep_state: bool = True) -> None:
    state: dict[str, Any] = {"model": model.state_dict()}
    if keep_state:
        state["optim"] = GefenDCPState(optimizer)
    dcp.load(state, checkpoint_id=Path(path), planner=GefenLoadPlanner())
    model.load_state_dict(state["model"])


def load_continue(rank: int, world_size: int | None, kind: str, path: str, keep_state: bool) -> list[float]:
    """Load the model (and, with ``keep_state``, the optimizer) and return the next losses.

    ``world_size=None`` loads a plain model in this process (DCP's single-process mode).
    """
    model, optimizer = build(kind, world_size)
    _load(model, optimizer, path, keep_state)
    return train(model, optimizer, BEFORE, AFTER)


def loaded_state(rank: int, world_size: int | None, kind: str, path: str) -> dict[tuple[str, str], torch.Tensor]:
    """Load the checkpoint and return the optimizer's state gathered to whole tensors
    (a DTensor's ``full_tensor()``, a collective every rank calls in the same order)."""
    model, optimizer = build(kind, world_size)
    _load(model, optimizer, path)
    return {
        (str(number), name): (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
        for number, entry in optimizer.state_dict()["state"].items()
        for name, value in entry.items()
        if isinstance(value, torch.Tensor)
    }


def _dense_state(optimizer: Any) -> dict[tuple[str, str], torch.Tensor]:
    """Every local state tensor (a DTensor's local shard), cloned."""
    return {
        (str(number), name): (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        for number, entry in optimizer.state_dict()["state"].items()
        for name, value in entry.items()
        if isinstance(value, torch.Tensor)
    }


def async_save_then_train(rank: int, world_size: int, kind: str, path: str) -> dict[str, Any]:
    """A synchronous save and an async one at the same point, then more training while the
    async write runs: both load into equal optimizers (the async checkpoint holds the state at
    the call, not the state the training reached)."""
    model, optimizer = build(kind, world_size)
    train(model, optimizer, 0, 3)
    at_call = _dense_state(optimizer)
    sync_path, async_path = f"{path}-sync", f"{path}-async"
    dcp.save(
        {"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
        storage_writer=GefenFileSystemWriter(sync_path),
        planner=GefenSavePlanner(),
    )
    async_group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        {"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
        storage_writer=GefenFileSystemWriter(async_path),
        planner=GefenSavePlanner(),
        process_group=async_group,
    )
    train(model, optimizer, 3, 2)
    future.result()
    dist.destroy_process_group(async_group)
    moved = any(not torch.equal(v, at_call[k]) for k, v in _dense_state(optimizer).items())
    loaded = []
    for where in (sync_path, async_path):
        fresh_model, fresh = build(kind, world_size)
        _load(fresh_model, fresh, where)
        loaded.append((fresh.global_step, _dense_state(fresh), fresh_model.state_dict()))
    (step_a, dense_a, model_a), (step_b, dense_b, model_b) = loaded
    return {
        "moved_during_save": moved,
        "steps": (step_a, step_b),
        "optimizer_equal": dense_a.keys() == dense_b.keys()
        and all(torch.equal(v, dense_b[k]) for k, v in dense_a.items()),
        "model_equal": all(torch.equal(v.full_tensor(), model_b[k].full_tensor()) for k, v in model_a.items()),
    }

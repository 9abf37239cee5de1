"""GefenMuonHybrid (each backup) through torch's documented optimizer-checkpoint recipe, in one process.

``get_optimizer_state_dict`` -> ``dcp.save`` -> a fresh model and optimizer ->
``get_optimizer_state_dict`` (the template: one zero-gradient, ``lr=0`` step) -> ``dcp.load`` ->
``set_optimizer_state_dict``. The composite's state dict is one flat torch optimizer state dict
(``gefen.composite_native_state`` v2), so torch's helpers re-key and flatten it like any
optimizer's; the restored hybrid equals the saved one and keeps training bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gefen import GefenMuonHybrid
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.hidden = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 50, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.hidden(self.embed(tokens)))))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 9), generator=generator)
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, 50), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _hybrid(model: nn.Module, backup: str) -> GefenMuonHybrid:
    return GefenMuonHybrid(model.named_parameters(), lr=1e-2, backup_optimizer=backup, fused=False)


def _same(a: object, b: object, where: str = "state_dict") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_the_torch_recipe_round_trips_the_hybrid_bit_exactly(tmp_path: Path, backup: str, flatten: bool) -> None:
    torch.manual_seed(0)
    model = _Model()
    optimizer = _hybrid(model, backup)
    _train(model, optimizer, 3, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    dcp.save(get_optimizer_state_dict(model, optimizer, options=options), checkpoint_id=str(tmp_path))

    restored_model = _Model()
    restored_model.load_state_dict(model.state_dict())
    restored = _hybrid(restored_model, backup)
    weights = [p.detach().clone() for p in restored_model.parameters()]
    template = get_optimizer_state_dict(restored_model, restored, options=options)
    assert all(torch.equal(p, w) for p, w in zip(restored_model.parameters(), weights)), "the template step moved"
    dcp.load(template, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(restored_model, restored, template, options=options)

    _same(optimizer.state_dict(), restored.state_dict())
    _train(model, optimizer, 2, seed=2)
    _train(restored_model, restored, 2, seed=2)
    for (name, a), b in zip(model.named_parameters(), restored_model.parameters()):
        assert torch.equal(a, b), f"{name} diverged after the restore"

"""torch's documented optimizer-checkpoint recipe, end to end, in one process.

``get_optimizer_state_dict`` -> ``dcp.save`` -> a fresh model and optimizer ->
``get_optimizer_state_dict`` (the template: torch runs one zero-gradient, ``lr=0`` step so the
state exists) -> ``dcp.load`` into it -> ``set_optimizer_state_dict``. The template step must
make the saved state's shapes and change no parameter; the restored optimizer must equal the
saved one bit for bit and keep training bit-identically.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gefen_core import Gefen, GefenMuon
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.hidden = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.out = nn.Linear(64, 50, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.hidden(self.embed(tokens)))))


Factory = Callable[[nn.Module], torch.optim.Optimizer]


def _gefen(model: nn.Module) -> torch.optim.Optimizer:
    return Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1, fused=False)


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return GefenMuon([(n, p) for n, p in model.named_parameters() if p.ndim == 2], lr=1e-2, fused=False)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 9), generator=generator)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _assert_same(a: Any, b: Any, where: str = "state_dict") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("factory", [_gefen, _muon], ids=["gefen", "gefen_muon"])
def test_the_torch_recipe_round_trips_bit_exactly(tmp_path: Path, factory: Factory, flatten: bool) -> None:
    torch.manual_seed(0)
    model = _Model()
    optimizer = factory(model)
    _train(model, optimizer, 3, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    dcp.save(get_optimizer_state_dict(model, optimizer, options=options), checkpoint_id=str(tmp_path))

    restored_model = _Model()
    restored_model.load_state_dict(model.state_dict())
    restored = factory(restored_model)
    weights = {name: p.detach().clone() for name, p in restored_model.named_parameters()}
    template = get_optimizer_state_dict(restored_model, restored, options=options)
    for name, p in restored_model.named_parameters():
        assert torch.equal(p, weights[name]), f"the template step moved {name}"
    dcp.load(template, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(restored_model, restored, template, options=options)

    _assert_same(optimizer.state_dict(), restored.state_dict())
    _train(model, optimizer, 2, seed=2)
    _train(restored_model, restored, 2, seed=2)
    for (name, a), b in zip(model.named_parameters(), restored_model.parameters()):
        assert torch.equal(a, b), f"{name} diverged after the restore"


@pytest.mark.parametrize("factory", [_gefen, _muon], ids=["gefen", "gefen_muon"])
def test_a_zero_gradient_step_makes_state_but_learns_no_codebook(factory: Factory) -> None:
    torch.manual_seed(0)
    model = _Model()
    optimizer = factory(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    sd = optimizer.state_dict()
    assert len(sd["state"]) == sum(len(g["params"]) for g in sd["param_groups"])
    assert sd["gefen_codebook_learned"] is False
    assert sd["gefen_codebook"].shape == (256,)
    optimizer.zero_grad(set_to_none=True)
    _train(model, optimizer, 1, seed=3)
    assert optimizer.state_dict()["gefen_codebook_learned"] is True


def test_an_older_native_format_is_refused_naming_both_versions() -> None:
    from gefen_contracts import StateValidationError

    model = _Model()
    optimizer = _gefen(model)
    _train(model, optimizer, 1, seed=4)
    sd = optimizer.state_dict()
    sd["gefen_format_version"] = 1
    with pytest.raises(StateValidationError, match=r"version 1.*reads version 2"):
        optimizer.load_state_dict(sd)

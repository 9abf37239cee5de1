"""ContractedAdamW through torch's documented optimizer-checkpoint recipe, in one process.

``get_optimizer_state_dict`` -> ``dcp.save`` -> a fresh model and optimizer ->
``get_optimizer_state_dict`` (the template) -> ``dcp.load`` -> ``set_optimizer_state_dict``.
torch's helpers key parameters by FQN string, so the staged load accepts str ids as well as
ints; the restored optimizer equals the saved one and keeps training bit for bit.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gefen_contracts import StateValidationError
from gefen_hybrid import ContractedAdamW
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
        self.embed = nn.Embedding(50, 16)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 50, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.embed(tokens))))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, 50, (4, 9), generator=generator)
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, 50), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_the_torch_recipe_round_trips_bit_exactly(tmp_path: Path, flatten: bool) -> None:
    torch.manual_seed(0)
    model = _Model()
    optimizer = ContractedAdamW(model.named_parameters(), lr=1e-2)
    _train(model, optimizer, 3, seed=1)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    dcp.save(get_optimizer_state_dict(model, optimizer, options=options), checkpoint_id=str(tmp_path))

    restored_model = _Model()
    restored_model.load_state_dict(model.state_dict())
    restored = ContractedAdamW(restored_model.named_parameters(), lr=1e-2)
    template = get_optimizer_state_dict(restored_model, restored, options=options)
    dcp.load(template, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(restored_model, restored, template, options=options)

    for p, q in zip(model.parameters(), restored_model.parameters()):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, restored.state[q][key]), key
    _train(model, optimizer, 2, seed=2)
    _train(restored_model, restored, 2, seed=2)
    for (name, a), b in zip(model.named_parameters(), restored_model.parameters()):
        assert torch.equal(a, b), f"{name} diverged after the restore"


def test_parameter_ids_may_be_fqns_but_not_bools() -> None:
    model = _Model()
    optimizer = ContractedAdamW(model.named_parameters(), lr=1e-2)
    _train(model, optimizer, 1, seed=3)
    sd = optimizer.state_dict()
    names = sd["param_groups"][0]["param_names"]
    by_name = {
        "state": {names[pid]: entry for pid, entry in sd["state"].items()},
        "param_groups": [{**sd["param_groups"][0], "params": list(names)}],
    }
    optimizer.load_state_dict(by_name)
    bools = {"state": {}, "param_groups": [{**sd["param_groups"][0], "params": [True] * len(names)}]}
    with pytest.raises(StateValidationError, match="int or str parameter ids"):
        optimizer.load_state_dict(bools)

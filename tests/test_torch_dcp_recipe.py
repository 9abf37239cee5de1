"""torch's documented optimizer-checkpoint recipe for every optimizer the project ships, in one process.

``get_optimizer_state_dict`` -> ``dcp.save`` -> a fresh model and optimizer ->
``get_optimizer_state_dict`` (the template: one zero-gradient, ``lr=0`` step so the state
exists) -> ``dcp.load`` -> ``set_optimizer_state_dict``. The template step must change no
parameter; the restored optimizer must equal the saved one bit for bit and keep training
bit-identically. torch's helpers key parameters by FQN and flatten (or not) the state dict,
so every native format must be one torch optimizer state dict (the composite's is since
``gefen.composite_native_state`` v2).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen_contracts import StateValidationError
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.model import kit_loss, make_kit_model
from gefen_hybrid import ContractedAdamW
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

Factory = Callable[[nn.Module], torch.optim.Optimizer]

FACTORIES: dict[str, Factory] = {
    "gefen": lambda m: Gefen(m.named_parameters(), lr=1e-2, weight_decay=0.1, fused=False),
    "gefen_muon": lambda m: GefenMuon([(n, p) for n, p in m.named_parameters() if p.ndim == 2], lr=1e-2, fused=False),
    "contracted_adamw": lambda m: ContractedAdamW(m.named_parameters(), lr=1e-2),
    "hybrid_gefen": lambda m: GefenMuonHybrid(m.named_parameters(), lr=1e-2, fused=False),
    "hybrid_adamw": lambda m: GefenMuonHybrid(m.named_parameters(), lr=1e-2, backup_optimizer="adamw", fused=False),
}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        kit_loss(model, step).backward()
        optimizer.step()


class _Reversed:
    """A model's parameters listed in reverse (what a factory reads through ``named_parameters``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.model.named_parameters())[::-1]


@pytest.mark.parametrize("reverse", [False, True], ids=["same-order", "reversed"])
@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_torch_recipe_round_trips_bit_exactly(tmp_path: Path, name: str, flatten: bool, reverse: bool) -> None:
    """``reverse``: the restoring optimizer lists its parameters in reverse. torch's recipe keys
    the state by name and lists a group's ``params`` in the live order, but passes the
    checkpoint's ``param_names`` in the saved order; the loads checked names and the digest in
    the live order and refused what torch's AdamW loads. The state now lands on its parameter
    by name; a native state dict, matched by position, is still refused."""
    factory = FACTORIES[name]
    model = make_kit_model(0)
    optimizer = factory(model)
    _train(model, optimizer, 3, start=0)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    dcp.save(get_optimizer_state_dict(model, optimizer, options=options), checkpoint_id=str(tmp_path))

    restored_model = make_kit_model(1)
    restored_model.load_state_dict(model.state_dict())
    restored = factory(_Reversed(restored_model) if reverse else restored_model)  # type: ignore[arg-type]
    if reverse:
        with pytest.raises(StateValidationError, match="another order"):
            restored.load_state_dict(optimizer.state_dict())
    weights = {n: p.detach().clone() for n, p in restored_model.named_parameters()}
    template = get_optimizer_state_dict(restored_model, restored, options=options)
    for n, p in restored_model.named_parameters():
        assert torch.equal(p, weights[n]), f"the template step moved {n}"
    dcp.load(template, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(restored_model, restored, template, options=options)

    if reverse:
        twins = dict(restored_model.named_parameters())
        for n, p in model.named_parameters():
            assert_trees_equal(dict(optimizer.state.get(p, {})), dict(restored.state.get(twins[n], {})), n)
    else:
        assert_trees_equal(optimizer.state_dict(), restored.state_dict())
    _train(model, optimizer, 2, start=3)
    _train(restored_model, restored, 2, start=3)
    for (n, a), b in zip(model.named_parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(a, b), f"{n} diverged after the restore"

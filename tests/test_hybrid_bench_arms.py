"""The benchmark registry's hybrid arms: what they build on the demo decoder, and that the
memory benchmark's state counter sees a composite's state exactly once."""

from __future__ import annotations

import pytest
import torch
from gefen import GefenMuonHybrid
from gefen.bench.optimizers import build_optimizer, optimizer_names
from gefen.demo.model import TinyDecoder, preset
from gefen_contracts.torch_support import count_state_bytes

ARMS = {"gefen-muon-hybrid": "gefen", "gefen-muon-hybrid-adamw": "adamw"}


def _decoder() -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(preset("tiny").with_vocab(40))


def _step(model: TinyDecoder, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    optimizer.zero_grad()
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_a_hybrid_arm_gives_muon_the_hidden_matrices_and_the_backup_everything_else(arm: str) -> None:
    assert arm in optimizer_names()
    model = _decoder()
    named = list(model.named_parameters())
    optimizer = build_optimizer(arm, named, lr=1e-3, weight_decay=0.01)
    assert isinstance(optimizer, GefenMuonHybrid) and optimizer.backup_optimizer == ARMS[arm]
    assert optimizer.muon is not None and optimizer.backup is not None
    ids = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    in_muon = sorted(name for name, p in named if id(p) in ids)
    assert in_muon == ["blocks.0.fc.weight", "blocks.0.out.weight", "blocks.0.proj.weight", "blocks.0.qkv.weight"]
    assert optimizer.param_groups[0]["weight_decay"] == 0.01


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_the_state_counter_counts_a_composite_as_the_sum_of_its_children(arm: str) -> None:
    model = _decoder()
    optimizer = build_optimizer(arm, list(model.named_parameters()), lr=1e-3, weight_decay=0.01)
    _step(model, optimizer)
    assert isinstance(optimizer, GefenMuonHybrid)
    children = [count_state_bytes(child) for child in optimizer.child_optimizers().values()]
    whole = count_state_bytes(optimizer)
    assert whole.parameters == sum(p.numel() for p in model.parameters())
    assert whole.total == sum(child.total for child in children) > 0

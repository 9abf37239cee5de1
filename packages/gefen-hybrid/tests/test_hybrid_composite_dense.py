"""The composite's DenseShardCodec by delegation, called directly (role-tagged records, loads
partitioned by the live routing, every child prepared before any commits, refusals that leave
both children untouched), and its portable_state claim served through its children."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gefen_contracts import (
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    CheckpointTransport,
    DenseShardCodec,
    DenseShardLoad,
    PortableAdapter,
    StaleTransactionError,
    StateValidationError,
)
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_hybrid import DENSE_SHARD_SUPPORT, PORTABLE_SUPPORT, CompositeOptimizer, ContractedAdamW, RoutingRules
from hybrid_toys import sign_factory, single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.hidden = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.hidden(self.embed(tokens))))  # type: ignore[no-any-return]


def _composite(seed: int = 0, rules: RoutingRules | None = None) -> tuple[nn.Module, CompositeOptimizer]:
    torch.manual_seed(seed)
    model = _Net()
    optimizer = CompositeOptimizer.from_factories(
        model,
        {
            "muon": lambda named: ContractedAdamW(named, lr=2e-2, weight_decay=0.0),
            "backup": lambda named: ContractedAdamW(named, lr=1e-2),
        },
        rules=rules,
    )
    return model, optimizer


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad()
        tokens = torch.randint(0, 10, (3, 2), generator=torch.Generator().manual_seed(step))
        model(tokens).pow(2).mean().backward()
        optimizer.step()


def _trained(steps: int = 2, seed: int = 0, rules: RoutingRules | None = None) -> tuple[nn.Module, CompositeOptimizer]:
    model, optimizer = _composite(seed, rules)
    _train(model, optimizer, steps)
    return model, optimizer


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_the_composite_claims_what_both_children_claim() -> None:
    _, optimizer = _composite()
    assert not isinstance(optimizer, PortableAdapter)  # portable state is served child by child
    assert isinstance(optimizer, DenseShardCodec)
    capabilities = optimizer.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_PORTABLE_STATE) and capabilities.supports(FEATURE_PARAMETER_SHAPED_STATE)
    entries = {e.transport: e for e in capabilities.checkpoints}
    assert entries[CheckpointTransport.CANONICAL_GLOBAL] == PORTABLE_SUPPORT
    assert entries[CheckpointTransport.PARAMETER_SHAPED] == DENSE_SHARD_SUPPORT
    model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 2))
    mixed = CompositeOptimizer.from_factories(model, {"muon": sign_factory, "backup": ContractedAdamW})
    status = mixed.optimizer_contract().capabilities.feature(FEATURE_PORTABLE_STATE)
    assert status.reasons == ("child 'muon' (gefen_tests.SignMomentum): toy optimizer: no portable adapter",)


# -- dense-shard records -------------------------------------------------------------------------


def _loads(optimizer: CompositeOptimizer) -> dict[str, DenseShardLoad]:
    return {
        slot.fqn: DenseShardLoad(
            slot.fqn,
            slot.options,
            slot.variant,
            slot.counters,
            {field: optimizer.materialize_dense_field(slot.fqn, field) for field in slot.fields},
        )
        for slot in optimizer.dense_shard_slots()
    }


def test_dense_records_are_the_union_of_the_children_and_round_trip() -> None:
    model, optimizer = _trained()
    slots = optimizer.dense_shard_slots()
    assert {(s.fqn, s.variant) for s in slots} == {
        ("hidden.weight", "muon.adamw"),
        ("embed.weight", "backup.adamw"),
        ("hidden.bias", "backup.adamw"),
        ("norm.weight", "backup.adamw"),
        ("norm.bias", "backup.adamw"),
    }
    common = optimizer.dense_shard_common()
    assert common == {
        "composite_format_version": 1,
        "child_implementations": {"muon": "gefen.ContractedAdamW", "backup": "gefen.ContractedAdamW"},
        "children": {"muon": {}, "backup": {}},
    }
    twin_model, twin = _composite(seed=1)
    twin_model.load_state_dict(model.state_dict())
    twin.commit_dense_shard_load(twin.prepare_dense_shard_load(common, _loads(optimizer)))
    _train(model, optimizer, 2, start=2)
    _train(twin_model, twin, 2, start=2)
    assert _same(model, twin_model)


def test_dense_refusals_leave_both_children_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    _, source = _trained()
    common, loads = source.dense_shard_common(), _loads(source)
    _, moved = _trained(rules=RoutingRules(overrides={"hidden.weight": "backup", "norm.weight": "muon"}))
    model, target = _trained(3, seed=1)
    before = deep_snapshot(target, model)
    with pytest.raises(StateValidationError, match=r"routes to '(muon|backup)' here"):
        target.prepare_dense_shard_load(common, _loads(moved))
    with pytest.raises(StateValidationError, match="differ from this composite's"):
        target.prepare_dense_shard_load({**common, "child_implementations": {"muon": "x", "backup": "y"}}, loads)
    with pytest.raises(StateValidationError, match="missing"):
        target.prepare_dense_shard_load(common, {k: v for k, v in loads.items() if k != "norm.bias"})

    def refuse(common: Any, slots: Any) -> Any:
        raise StateValidationError("backup refuses")

    monkeypatch.setattr(target.child_optimizers()["backup"], "prepare_dense_shard_load", refuse)
    with pytest.raises(StateValidationError, match="backup refuses"):
        target.prepare_dense_shard_load(common, loads)
    monkeypatch.undo()
    assert not snapshot_diff(before, target, model)


def test_a_staged_composite_load_is_single_use_and_goes_stale_when_a_child_steps() -> None:
    model, optimizer = _trained()
    staged = optimizer.prepare_dense_shard_load(optimizer.dense_shard_common(), _loads(optimizer))
    _train(model, optimizer.child_optimizers()["backup"], 1, start=7)  # the child alone
    after = deep_snapshot(optimizer)
    with pytest.raises(StaleTransactionError):
        optimizer.commit_dense_shard_load(staged)
    assert not snapshot_diff(after, optimizer)
    fresh = optimizer.prepare_dense_shard_load(optimizer.dense_shard_common(), _loads(optimizer))
    optimizer.commit_dense_shard_load(fresh)
    with pytest.raises(StaleTransactionError, match="consumed"):
        optimizer.commit_dense_shard_load(fresh)

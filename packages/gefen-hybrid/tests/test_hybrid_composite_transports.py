"""The composite's transport claims: parameter-shaped state (its flat native state dict, when
both children keep parameter-shaped state) and portable state served through its children."""

from __future__ import annotations

import torch
from gefen_contracts import FEATURE_PARAMETER_SHAPED_STATE, FEATURE_PORTABLE_STATE
from gefen_contracts.enums import CheckpointTransport
from gefen_contracts.protocols import ParameterShapedState, PortableAdapter
from gefen_hybrid import PARAMETER_SHAPED_SUPPORT, PORTABLE_SUPPORT, CompositeOptimizer, ContractedAdamW, RoutingRules
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
    assert isinstance(optimizer, ParameterShapedState)
    capabilities = optimizer.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_PORTABLE_STATE) and capabilities.supports(FEATURE_PARAMETER_SHAPED_STATE)
    entries = {e.transport: e for e in capabilities.checkpoints}
    assert entries[CheckpointTransport.CANONICAL_GLOBAL] == PORTABLE_SUPPORT
    assert entries[CheckpointTransport.PARAMETER_SHAPED] == PARAMETER_SHAPED_SUPPORT
    model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 2))
    mixed = CompositeOptimizer.from_factories(model, {"muon": sign_factory, "backup": ContractedAdamW})
    status = mixed.optimizer_contract().capabilities.feature(FEATURE_PORTABLE_STATE)
    assert status.reasons == ("child 'muon' (gefen_tests.SignMomentum): toy optimizer: no portable adapter",)

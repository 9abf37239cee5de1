"""The kit's default model and deterministic training batches."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["KitModel", "kit_loss", "make_kit_model"]


class KitModel(nn.Module):
    """A small model with an embedding, matrices with and without bias, and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens).mean(dim=1)
        hidden = torch.nn.functional.gelu(self.proj(hidden))
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def make_kit_model(seed: int = 0) -> nn.Module:
    """A freshly initialised :class:`KitModel` (identical for equal seeds)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return KitModel()
    finally:
        torch.random.set_rng_state(generator_state)


def kit_loss(model: nn.Module, step: int) -> torch.Tensor:
    """A deterministic regression loss for ``step`` that works for any model whose
    parameters are all reachable from a scalar of their sum when the model is not a KitModel."""
    generator = torch.Generator().manual_seed(1000 + step)
    if isinstance(model, KitModel):
        tokens = torch.randint(0, 16, (6, 5), generator=generator)
        target = torch.randn(6, 4, generator=generator)
        return torch.nn.functional.mse_loss(model(tokens).float(), target)  # any parameter dtype
    total = torch.zeros(())
    for _, parameter in sorted(model.named_parameters()):
        weights = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
        total = total + ((parameter.float() - weights) ** 2).mean() + (parameter.float() * weights).sum().sin()
    return total

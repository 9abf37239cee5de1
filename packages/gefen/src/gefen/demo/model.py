"""A small decoder-only transformer (GPT-style, pre-norm) and named size presets.

Its tensor kinds are those of real decoders, which is what matters to an optimizer that
treats tensors by shape: token and position embeddings, fused QKV and output projections,
a 4x GELU MLP, LayerNorm weights and biases, and an untied output head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MODEL_PRESETS", "DecoderConfig", "TinyDecoder", "preset"]


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shape of a :class:`TinyDecoder`; ``vocab_size`` comes from the data unless a preset fixes it."""

    d_model: int
    n_layers: int
    n_heads: int
    context: int
    vocab_size: int = 0
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "context", "mlp_ratio"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if type(self.vocab_size) is not int or self.vocab_size < 0:
            raise ValueError(f"DecoderConfig.vocab_size must be a non-negative int, got {self.vocab_size!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"DecoderConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    def with_vocab(self, vocab_size: int) -> DecoderConfig:
        """This shape for a given vocabulary (a preset's own non-zero vocabulary wins)."""
        return self if self.vocab_size else replace(self, vocab_size=vocab_size)

    def parameter_count(self) -> int:
        """Number of parameters of the model this config builds (``vocab_size`` must be set)."""
        d, v, f = self.d_model, self.vocab_size, self.mlp_ratio * self.d_model
        per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return v * d + self.context * d + self.n_layers * per_layer + 2 * d + v * d


#: Named shapes: ``tiny`` for tests, ``mini``, ``small``, ``bytes-small`` (the real-text task,
#: about 0.47M parameters at vocabulary 256) and ``medium`` for the quality tasks, ``small``
#: for the demo, ``decoder-50m`` for the memory benchmark (a fixed
#: 8192-token vocabulary, about 52.7M parameters).
MODEL_PRESETS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(d_model=32, n_layers=1, n_heads=2, context=32),
    "mini": DecoderConfig(d_model=64, n_layers=2, n_heads=2, context=64),
    "small": DecoderConfig(d_model=128, n_layers=4, n_heads=4, context=64),
    "medium": DecoderConfig(d_model=256, n_layers=6, n_heads=8, context=128),
    "bytes-small": DecoderConfig(d_model=128, n_layers=2, n_heads=4, context=128),
    "decoder-50m": DecoderConfig(d_model=512, n_layers=14, n_heads=8, context=256, vocab_size=8192),
}


def preset(name: str) -> DecoderConfig:
    """The preset called ``name`` (``ValueError`` lists the known ones)."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; known: {', '.join(MODEL_PRESETS)}") from None


class _Block(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, config.mlp_ratio * d)
        self.out = nn.Linear(config.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        shape = (batch, length, self.n_heads, d // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.norm2(x))))
        return out


class TinyDecoder(nn.Module):
    """Causal language model: ``forward(ids [B, T]) -> logits [B, T, vocab]`` with ``T <= context``."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if config.vocab_size <= 0:
            raise ValueError("TinyDecoder needs a DecoderConfig with vocab_size set (use config.with_vocab(n))")
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, parameter in self.named_parameters():
            if parameter.ndim == 1:
                continue  # LayerNorm and Linear defaults: ones / zeros below
            std = residual_std if name.endswith(("proj.weight", "out.weight")) else 0.02
            nn.init.normal_(parameter, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.config.context:
            raise ValueError(f"input length {length} exceeds the model context {self.config.context}")
        positions = torch.arange(length, device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats."""
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

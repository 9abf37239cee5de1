"""Small real module trees for the GefenMuonHybrid tests (a Llama-like decoder with tied
embeddings, a CNN) and a deterministic training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, width))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = Attention(width, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class TinyLlama(nn.Module):
    """Llama's module tree (names as in transformers' ``LlamaForCausalLM``), tied LM head."""

    def __init__(self, vocab: int = 32, width: int = 16, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, width)
        nn.init.normal_(self.model.embed_tokens.weight, std=0.1)
        self.model.layers = nn.ModuleList(DecoderLayer(width, heads, kv_heads, 2 * width) for _ in range(layers))
        self.model.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))  # type: ignore[no-any-return]

    def loss(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(500 + step % 2)  # two batches, learnable
        tokens = torch.randint(0, self.vocab, (3, 9), generator=generator)
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class TiedHeadFirst(nn.Module):
    """A tied output projection registered *before* its embedding, under an unrelated name."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 20, bias=False)
        self.shared = nn.Embedding(20, 8)
        self.decoder.weight = self.shared.weight
        self.hidden = nn.Linear(8, 8)


class SmallCNN(nn.Module):
    """Convolutions (4-D), batch norm, a hidden matrix and a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.classifier = nn.Linear(16, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(images))), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.classifier(torch.relu(self.fc1(x.flatten(1))))  # type: ignore[no-any-return]

    def loss(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(700 + step % 2)
        images = torch.randn(4, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 5, (4,), generator=generator)
        return nn.functional.cross_entropy(self(images), labels)


def seeded(cls: type[nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return cls()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        loss = model.loss(step)  # type: ignore[operator]
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def tiny_llama() -> nn.Module:
    """A seeded :class:`TinyLlama` (a ``MODULE:FUNCTION`` target for ``gefen routing``)."""
    return seeded(TinyLlama)


#: Gefen, GefenMuon and the hybrid with each backup, at one rate (integration tests share them).
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "gefen": lambda model: Gefen(model.named_parameters(), lr=1e-3),
    "gefen-muon": lambda model: GefenMuon(
        [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n], lr=1e-3
    ),
    "hybrid": lambda model: GefenMuonHybrid(model, lr=1e-3),
    "hybrid-adamw": lambda model: GefenMuonHybrid(model, lr=1e-3, backup_optimizer="adamw"),
}


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    """One torch thread for a module's tests (import it there: the bit-exact comparisons of
    these modules do not depend on it, their run time on 2 cores does)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def build_hybrid(model: nn.Module, backup: str = "gefen") -> GefenMuonHybrid:
    """The hybrid these integration tests step: AdamW-scale rates, the given backup."""
    return GefenMuonHybrid(model, lr=1e-3, backup_lr=2.5e-4, backup_optimizer=backup)

"""Tokenised tinylang splits and batch sampling for the demo and the quality benchmark.

Three disjoint splits are generated from independent seeds: ``train`` for updates,
``valid`` for choosing hyperparameters (the learning rate) and ``test`` for the reported,
held-out loss. Two tokenisations give tasks of different shape: ``char`` (about 40
symbols) and ``word`` (a few hundred words, numbers and punctuation marks).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

import torch

from .language import TINYLANG_VERSION, generate_text

__all__ = ["SPLITS", "TokenSplits", "Tokenizer", "eval_windows", "load_tinylang", "sample_batch"]

SPLITS = ("train", "valid", "test")
Tokenization = Literal["char", "word"]
_WORD_RE = re.compile(r"[a-z]+|[0-9]+|\n|[^\sa-z0-9]")


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """A closed vocabulary over characters or words; ``encode`` raises ``KeyError`` on unknown symbols."""

    kind: Tokenization
    vocab: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("char", "word"):
            raise ValueError(f"tokenizer kind must be 'char' or 'word', got {self.kind!r}")
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError("tokenizer vocab has duplicate entries")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def split(self, text: str) -> list[str]:
        return list(text) if self.kind == "char" else _WORD_RE.findall(text)

    def encode(self, text: str) -> list[int]:
        index = _index(self)
        return [index[symbol] for symbol in self.split(text)]

    def decode(self, ids: list[int]) -> str:
        symbols = [self.vocab[i] for i in ids]
        if self.kind == "char":
            return "".join(symbols)
        out: list[str] = []
        for symbol in symbols:
            if out and symbol != "\n" and out[-1] != "\n" and symbol not in ".,?":
                out.append(" ")
            out.append(symbol)
        return "".join(out)


@functools.lru_cache(maxsize=8)
def _index(tokenizer: Tokenizer) -> dict[str, int]:
    return {symbol: i for i, symbol in enumerate(tokenizer.vocab)}


@dataclass(frozen=True, slots=True)
class TokenSplits:
    """Token ids (int64, 1-D) of the three splits and the tokenizer that made them."""

    name: str
    tokenizer: Tokenizer
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor

    def split(self, name: str) -> torch.Tensor:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {name!r}")
        tensor: torch.Tensor = getattr(self, name)
        return tensor


@functools.lru_cache(maxsize=4)
def load_tinylang(
    tokenization: Tokenization = "char", *, train_chars: int = 2_000_000, eval_chars: int = 200_000, seed: int = 0
) -> TokenSplits:
    """Generate and tokenise tinylang (cached per arguments; about a second for the defaults)."""
    texts = {
        split: generate_text(train_chars if split == "train" else eval_chars, seed=3 * seed + i)
        for i, split in enumerate(SPLITS)
    }
    probe = Tokenizer(tokenization, ())
    vocab = sorted({symbol for text in texts.values() for symbol in probe.split(text)})
    tokenizer = Tokenizer(tokenization, tuple(vocab))
    tensors = {split: torch.tensor(tokenizer.encode(text), dtype=torch.int64) for split, text in texts.items()}
    return TokenSplits(
        f"tinylang-v{TINYLANG_VERSION}-{tokenization}", tokenizer, tensors["train"], tensors["valid"], tensors["test"]
    )


def sample_batch(
    tokens: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs ``[B, context]`` and next-token targets ``[B, context]``."""
    limit = tokens.numel() - context - 1
    if limit <= 0:
        raise ValueError(f"a split of {tokens.numel()} tokens is too short for context {context}")
    starts = torch.randint(0, limit + 1, (batch_size,), generator=generator)
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets[None, :]]
    return windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: torch.Tensor, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` evenly spaced windows (the same for every run): inputs and targets ``[count, context]``."""
    limit = tokens.numel() - context - 1
    if limit <= 0:
        raise ValueError(f"a split of {tokens.numel()} tokens is too short for context {context}")
    starts = torch.linspace(0, limit, count).round().to(torch.int64)
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets[None, :]]
    return windows[:, :-1], windows[:, 1:]

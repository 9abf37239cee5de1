"""Tokenised corpora and batch sampling for the demo and the quality benchmark.

Every corpus has three disjoint splits: ``train`` for updates, ``valid`` for choosing
hyperparameters (the learning rate) and ``test`` for the reported, held-out loss.

* ``tinylang-char`` / ``tinylang-word``: the generated language of
  :mod:`gefen.demo.language` (splits from independent seeds), tokenised by character (about
  40 symbols) or by word (a few hundred words, numbers and punctuation marks).
* ``pydoc-bytes``: real English text that ships with every CPython, the interpreter's own
  help topics (``pydoc_data.topics``, about 465 KB in 3.11), as UTF-8 bytes (vocabulary
  256). Whole topics go to one split, chosen by a CRC of the topic's name (one bucket in ten to
  ``valid``, one to ``test``: about 393 / 43 / 31 KB), so no passage is seen in two splits. The text
  differs slightly between Python versions; :func:`corpus_digest` names what was used.
"""

from __future__ import annotations

import functools
import hashlib
import re
import zlib
from dataclasses import dataclass
from typing import Literal

import torch

from .language import TINYLANG_VERSION, generate_text

__all__ = [
    "CORPORA",
    "SPLITS",
    "TokenSplits",
    "Tokenizer",
    "corpus_digest",
    "eval_windows",
    "load_corpus",
    "load_pydoc_bytes",
    "load_tinylang",
    "sample_batch",
]

SPLITS = ("train", "valid", "test")
Tokenization = Literal["char", "word", "byte"]
#: The corpora :func:`load_corpus` knows.
CORPORA = ("tinylang-char", "tinylang-word", "pydoc-bytes")
_BYTE_VOCAB = tuple(chr(i) for i in range(256))
_WORD_RE = re.compile(r"[a-z]+|[0-9]+|\n|[^\sa-z0-9]")


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """A closed vocabulary over characters, words or UTF-8 bytes; ``encode`` raises
    ``KeyError`` on unknown symbols (``byte`` encodes any text: its vocabulary is the 256
    byte values, each held as the character of the same code point)."""

    kind: Tokenization
    vocab: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in ("char", "word", "byte"):
            raise ValueError(f"tokenizer kind must be 'char', 'word' or 'byte', got {self.kind!r}")
        if self.kind == "byte" and self.vocab != _BYTE_VOCAB:
            raise ValueError("a byte tokenizer's vocab is the 256 byte values (Tokenizer.bytes())")
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError("tokenizer vocab has duplicate entries")

    @classmethod
    def bytes(cls) -> Tokenizer:
        """The byte-level tokenizer (vocabulary 256)."""
        return cls("byte", _BYTE_VOCAB)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def split(self, text: str) -> list[str]:
        if self.kind == "byte":
            return list(text.encode("utf-8").decode("latin-1"))
        return list(text) if self.kind == "char" else _WORD_RE.findall(text)

    def encode(self, text: str) -> list[int]:
        index = _index(self)
        return [index[symbol] for symbol in self.split(text)]

    def decode(self, ids: list[int]) -> str:
        symbols = [self.vocab[i] for i in ids]
        if self.kind == "byte":
            return "".join(symbols).encode("latin-1").decode("utf-8", errors="replace")
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


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return dict(topics)


def _split_of(name: str) -> str:
    bucket = zlib.crc32(name.encode("utf-8")) % 10
    return "valid" if bucket == 0 else "test" if bucket == 1 else "train"


@functools.lru_cache(maxsize=1)
def load_pydoc_bytes() -> TokenSplits:
    """CPython's help topics as UTF-8 bytes, split by topic (module docstring)."""
    texts: dict[str, list[str]] = {split: [] for split in SPLITS}
    for name, text in sorted(_pydoc_topics().items()):
        texts[_split_of(name)].append(text if text.endswith("\n") else text + "\n")
    tokenizer = Tokenizer.bytes()
    tensors = {
        split: torch.frombuffer(bytearray("".join(parts).encode("utf-8")), dtype=torch.uint8).to(torch.int64)
        for split, parts in texts.items()
    }
    return TokenSplits("pydoc-bytes", tokenizer, tensors["train"], tensors["valid"], tensors["test"])


def load_corpus(name: str) -> TokenSplits:
    """The corpus called ``name`` (one of :data:`CORPORA`), tokenised and split."""
    if name == "pydoc-bytes":
        return load_pydoc_bytes()
    if name in ("tinylang-char", "tinylang-word"):
        return load_tinylang("char" if name == "tinylang-char" else "word")
    raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")


def corpus_digest(data: TokenSplits) -> str:
    """SHA-256 (first 16 hex digits) over the three splits' token ids: which text a run saw."""
    digest = hashlib.sha256()
    for split in SPLITS:
        digest.update(data.split(split).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def sample_batch(
    tokens: torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows: inputs ``[B, context]`` and next-token targets ``[B, context]``."""
    limit = tokens.numel() - context - 1  # the last window starts here (context + 1 tokens fit one)
    if limit < 0:
        raise ValueError(f"a split of {tokens.numel()} tokens is too short for context {context}")
    starts = torch.randint(0, limit + 1, (batch_size,), generator=generator)
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets[None, :]]
    return windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: torch.Tensor, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` evenly spaced windows (the same for every run): inputs and targets ``[count, context]``."""
    limit = tokens.numel() - context - 1  # the last window starts here (context + 1 tokens fit one)
    if limit < 0:
        raise ValueError(f"a split of {tokens.numel()} tokens is too short for context {context}")
    starts = torch.linspace(0, limit, count).round().to(torch.int64)
    offsets = torch.arange(context + 1)
    windows = tokens[starts[:, None] + offsets[None, :]]
    return windows[:, :-1], windows[:, 1:]

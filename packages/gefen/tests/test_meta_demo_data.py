"""Tinylang generation (golden), tokenisation and batch sampling."""

from __future__ import annotations

import hashlib

import pytest
import torch
from gefen.demo.data import CORPORA, Tokenizer, corpus_digest, eval_windows, load_corpus, load_tinylang, sample_batch
from gefen.demo.language import TINYLANG_VERSION, generate_text

# Golden vector: changes only when the language changes (then bump TINYLANG_VERSION).
GOLDEN_SHA256 = "1c8e3ad1fad728a68d9e4f885cf8410a216906da09c9543ebd4ee12f5d0d4270"


def test_generation_is_deterministic_and_matches_the_golden_digest() -> None:
    text = generate_text(5000, seed=0)
    assert TINYLANG_VERSION == 1
    assert hashlib.sha256(text.encode()).hexdigest() == GOLDEN_SHA256
    assert generate_text(5000, seed=0) == text
    assert generate_text(5000, seed=1) != text
    assert len(text) >= 5000 and text.endswith("\n")


def test_language_has_the_structure_it_promises() -> None:
    text = generate_text(50_000, seed=3)
    for line in text.splitlines():
        for sentence in line.split(". "):
            if " + " in sentence and " = " in sentence:
                left, right = sentence.rstrip(".").split(" = ")
                a, b = left.split(" + ")
                assert int(a) + int(b) == int(right)
            if sentence.startswith("reverse "):
                word, reversed_word = sentence.removeprefix("reverse ").rstrip(".").split(" is ")
                assert reversed_word == word[::-1]
    assert "who owns the" in text and "count " in text


def test_generate_text_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_chars"):
        generate_text(0, seed=0)


@pytest.mark.parametrize("kind", ["char", "word"])
def test_tokenizers_round_trip(kind: str) -> None:
    data = load_tinylang(kind, train_chars=20_000, eval_chars=5_000)  # type: ignore[arg-type]
    text = generate_text(2_000, seed=0)
    ids = data.tokenizer.encode(text)
    assert max(ids) < data.tokenizer.vocab_size
    assert data.tokenizer.decode(ids) == text  # words: spacing is implied by the language's punctuation
    for split in ("train", "valid", "test"):
        tokens = data.split(split)
        assert tokens.dtype == torch.int64 and tokens.ndim == 1
    assert not torch.equal(data.valid[:1000], data.test[:1000])  # independent seeds


def test_tokenizer_rejects_unknown_symbols_and_bad_kinds() -> None:
    tokenizer = Tokenizer("char", ("a", "b"))
    with pytest.raises(KeyError):
        tokenizer.encode("abc")
    with pytest.raises(ValueError, match="kind"):
        Tokenizer("bits", ())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="256 byte values"):
        Tokenizer("byte", ("a",))


def test_batches_are_next_token_windows() -> None:
    tokens = torch.arange(1000)
    x, y = sample_batch(tokens, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y, x + 1)
    a, _ = eval_windows(tokens, 8, 16)
    b, _ = eval_windows(tokens, 8, 16)
    assert torch.equal(a, b) and a[0, 0] == 0 and a[-1, -1] == 1000 - 2
    with pytest.raises(ValueError, match="too short"):
        sample_batch(torch.arange(10), 1, 16, torch.Generator())
    exact = torch.arange(17)  # context + 1 tokens: exactly one window fits
    x, y = sample_batch(exact, 2, 16, torch.Generator())
    assert torch.equal(x[0], exact[:16]) and torch.equal(y[1], exact[1:])
    assert torch.equal(eval_windows(exact, 3, 16)[0], exact[:16].expand(3, 16))
    with pytest.raises(ValueError, match="too short"):
        eval_windows(torch.arange(16), 1, 16)


def test_pydoc_bytes_is_real_text_split_by_topic() -> None:
    data = load_corpus("pydoc-bytes")
    assert data.tokenizer.vocab_size == 256
    sizes = {split: data.split(split).numel() for split in ("train", "valid", "test")}
    assert sizes["train"] > 300_000 and sizes["valid"] > 20_000 and sizes["test"] > 20_000
    text = data.tokenizer.decode(data.test[:2000].tolist())
    assert text.count(" the ") > 5  # English prose
    train_text = data.tokenizer.decode(data.train.tolist())
    # Whole topics go to one split: a long passage of the test split never occurs in train.
    assert text[200:400] not in train_text
    assert data.tokenizer.encode("héllo") == list("héllo".encode())
    assert data.tokenizer.decode(data.tokenizer.encode("héllo")) == "héllo"
    assert corpus_digest(data) == corpus_digest(load_corpus("pydoc-bytes"))
    assert corpus_digest(data) != corpus_digest(load_corpus("tinylang-char"))


def test_every_corpus_loads_and_unknown_ones_are_refused() -> None:
    for name in CORPORA:
        assert load_corpus(name).train.numel() > 0
    with pytest.raises(ValueError, match="unknown corpus 'wiki'"):
        load_corpus("wiki")

"""The demo's decoder: shapes, parameter counts, causality."""

from __future__ import annotations

import pytest
import torch
from gefen.demo.model import MODEL_PRESETS, DecoderConfig, TinyDecoder, preset


@pytest.mark.parametrize("name", ["tiny", "mini", "small"])
def test_parameter_count_formula_matches_the_model(name: str) -> None:
    config = preset(name).with_vocab(42)
    model = TinyDecoder(config)
    assert sum(p.numel() for p in model.parameters()) == config.parameter_count()


def test_memory_benchmark_model_has_at_least_50m_parameters() -> None:
    config = MODEL_PRESETS["decoder-50m"]
    assert config.vocab_size == 8192 and config.with_vocab(42) is config
    assert config.parameter_count() >= 50_000_000


def test_the_model_is_causal() -> None:
    torch.manual_seed(0)
    model = TinyDecoder(preset("tiny").with_vocab(10)).eval()
    ids = torch.randint(0, 10, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 10
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.allclose(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_configs_are_validated() -> None:
    with pytest.raises(ValueError, match="divisible"):
        DecoderConfig(d_model=30, n_layers=1, n_heads=4, context=8)
    with pytest.raises(ValueError, match="n_layers"):
        DecoderConfig(d_model=32, n_layers=0, n_heads=2, context=8)
    with pytest.raises(ValueError, match="vocab_size set"):
        TinyDecoder(preset("tiny"))
    with pytest.raises(ValueError, match="unknown model size"):
        preset("huge")
    model = TinyDecoder(preset("tiny").with_vocab(5))
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, 33, dtype=torch.int64))

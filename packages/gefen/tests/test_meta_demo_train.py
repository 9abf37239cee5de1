"""Training runs: the loss falls for every comparable optimizer; divergence is reported."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
import torch
from gefen.bench.optimizers import (
    UnknownOptimizerError,
    build_optimizer,
    get_optimizer,
    optimizer_names,
    unavailable_reason,
)
from gefen.demo.data import load_tinylang
from gefen.demo.model import preset
from gefen.demo.train import TrainConfig, train


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Training runs use one thread (fast and steady on a shared 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def data():  # type: ignore[no-untyped-def]
    return load_tinylang("char", train_chars=100_000, eval_chars=20_000)


@pytest.mark.parametrize("optimizer", ["adamw", "gefen", "gefen-block"])
def test_loss_falls_far(data, optimizer: str) -> None:  # type: ignore[no-untyped-def]
    initial = math.log(data.tokenizer.vocab_size)
    result = train(
        preset("tiny"), data, TrainConfig(optimizer, 1e-2, 60, batch_size=16, eval_every=30, eval_windows=16)
    )
    assert not result.diverged
    assert result.final_loss["test"] < initial - 0.8
    assert [step for step, _ in result.eval_curve] == [30, 60]
    assert result.tokens_per_s > 0 and result.optimizer_step_s > 0
    if optimizer == "adamw":
        assert 8.0 <= result.state_bytes_per_param < 8.01
    elif optimizer == "gefen":  # tiny's matrices (d = 32) are narrower than 128: Adam's v per element
        assert 5.0 < result.state_bytes_per_param < 5.2 and result.state_bytes_by_kind["v"] > 0
    else:
        assert result.state_bytes_per_param < 1.6  # tiny tensors: blocks are short, scales weigh more


def test_gefen_holds_about_one_byte_per_parameter_from_d_model_128() -> None:
    """A d = 128 decoder with a 512-token vocabulary: only the 64 x 128 position embedding is narrower than
    ``min_dim_size_to_factor`` and keeps a per-element v (0.035 B/param of this model); the
    d = 128 matrices' factored statistics and 128-element blocks weigh about 0.07 more."""
    from gefen.demo.model import TinyDecoder

    torch.manual_seed(0)
    model = TinyDecoder(preset("small").with_vocab(512))
    optimizer = build_optimizer("gefen", list(model.named_parameters()), lr=1e-3, weight_decay=0.0)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    narrow = [p for p in model.parameters() if "v" in optimizer.state[p]]
    assert [tuple(p.shape) for p in narrow] == [(64, 128)]
    count = sum(p.numel() for p in model.parameters())
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert state / count < 1.11


def test_same_seed_same_run_and_seeds_differ(data) -> None:  # type: ignore[no-untyped-def]
    config = TrainConfig("adamw", 3e-3, 5, batch_size=4, eval_windows=4)
    first = train(preset("tiny"), data, config)
    again = train(preset("tiny"), data, config)
    other = train(preset("tiny"), data, TrainConfig("adamw", 3e-3, 5, batch_size=4, eval_windows=4, seed=1))
    assert first.train_curve == again.train_curve
    assert first.train_curve != other.train_curve


def test_a_diverging_run_stops_and_is_marked(data) -> None:  # type: ignore[no-untyped-def]
    result = train(preset("tiny"), data, TrainConfig("adamw", 1e9, 40, batch_size=4, eval_windows=4, grad_clip=1e30))
    assert result.diverged
    assert len(result.train_curve) < 40
    assert result.final_loss == {"valid": math.inf, "test": math.inf}


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    config = TrainConfig("adamw", 1e-3, 100)
    factors = [config.lr_factor(step) for step in range(100)]
    assert factors[0] == pytest.approx(0.2) and factors[4] == pytest.approx(1.0)
    assert factors[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    with pytest.raises(ValueError, match="lr"):
        TrainConfig("adamw", 0.0, 10)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        TrainConfig("adamw", 1e-3, 10, device="tpu")


def test_registry_names_and_errors() -> None:
    assert {"adamw", "gefen", "gefen-block", "adamw-4bit"} <= set(optimizer_names())
    with pytest.raises(UnknownOptimizerError, match="known: adamw"):
        get_optimizer("sgd")
    assert unavailable_reason("gefen") is None


def test_gefen_block_disables_the_factored_second_moment() -> None:
    weight = torch.nn.Parameter(torch.randn(128, 160))
    for name, expected in (("gefen", True), ("gefen-block", False)):
        optimizer = build_optimizer(name, [("w", weight)], lr=1e-3, weight_decay=0.0)
        weight.grad = torch.randn(128, 160)
        optimizer.step()
        keys = set(optimizer.state[weight])
        assert ("v_row" in keys) is expected and ("vmean" in keys) is not expected


def test_missing_torchao_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    reason = unavailable_reason("adamw-4bit")
    assert reason is not None and "gefen[bench]" in reason
    with pytest.raises(RuntimeError, match="not available here"):
        build_optimizer("adamw-4bit", [], lr=1e-3, weight_decay=0.0)


def test_gefen_with_every_compression_off_trains_like_laprop_ordered_adamw(data) -> None:  # type: ignore[no-untyped-def]
    """The ablation baseline: per-element v and exact momentum make Gefen AdamW with the momentum
    taken after the preconditioning (the ladder's ``laprop`` rung; 9 B/param)."""
    laprop = train(preset("tiny"), data, TrainConfig("ladder-laprop", 1e-2, 20, batch_size=8, eval_windows=8))
    dense = train(preset("tiny"), data, TrainConfig("gefen-p1", 1e-2, 20, batch_size=8, eval_windows=8))
    assert max(abs(a - b) for (_, a), (_, b) in zip(laprop.train_curve, dense.train_curve)) < 1e-5
    assert dense.final_loss["test"] == pytest.approx(laprop.final_loss["test"], abs=1e-5)
    assert dense.state_bytes_per_param > 9.0

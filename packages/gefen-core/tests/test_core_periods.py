"""Period search: the pinned examples of spec/core.md §5.2 and the chosen variant's behaviour."""

from __future__ import annotations

import pytest
import torch
from gefen_core.periods import (
    PeriodPolicy,
    divisors,
    largest_divisor_at_most,
    memory_safe_fallback,
    search_period,
    select_period,
    within_block_spread,
)
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def test_divisors_are_the_proper_divisors_ascending() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6]
    assert divisors(13) == [1]
    assert divisors(1) == []
    assert divisors(16) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="positive int"):
        divisors(0)


def test_within_block_spread_measures_variance_of_squares() -> None:
    g = torch.tensor([1.0, 1.0, 2.0, 2.0])  # g^2 = [1, 1, 4, 4]
    assert within_block_spread(g, 2) == 0.0
    assert within_block_spread(g, 4) == pytest.approx(1.5)  # Var_pop([1,1,4,4]) = 2.25
    with pytest.raises(ValueError, match="does not divide"):
        within_block_spread(g, 3)


@pytest.mark.parametrize("period", [2, 3, 8, 30, 32, 64, 96])
def test_short_and_long_blocks_agree_with_the_population_variance(period: int) -> None:
    """Short blocks take a two-pass variance instead of ``Tensor.var``; both give the
    definition's value (to float64 summation order), and a float64 gradient is not touched."""
    gradient = torch.randn(96 * 40, dtype=torch.float64, generator=torch.Generator().manual_seed(period)) * 3
    before = gradient.clone()
    squares = gradient.square().view(-1, period)
    expected = squares.var(dim=1, unbiased=False).mean().sqrt().item()
    assert within_block_spread(gradient, period) == pytest.approx(expected, rel=1e-12)
    assert torch.equal(gradient, before)


def test_select_period_pinned_examples() -> None:
    assert select_period([(1, 10.0), (8, 4.0), (16, 1.0), (32, 0.9)]) == 8
    assert select_period([(1, 10.0), (2, 0.5), (4, 0.4)]) == 1  # winner 2 < 8 means no structure
    with pytest.raises(ValueError, match="no candidate"):
        select_period([])


def test_select_period_ties_go_to_the_smaller_candidate() -> None:
    assert select_period([(1, 4.0), (8, 2.0), (16, 3.0), (32, 1.0)]) == 8


def test_small_drops_do_not_count_as_structure() -> None:
    assert select_period([(1, 10.0), (8, 8.0), (16, 7.0)]) == 1  # 20% and 12.5% drops
    assert select_period([(1, 10.0), (8, 7.0)]) == 8  # a 30% drop
    assert select_period([(1, 10.0), (8, 8.0)], min_relative_drop=0.1) == 8


def test_memory_safe_fallback_pinned_examples() -> None:
    assert memory_safe_fallback(4, (4,)) == 1
    assert memory_safe_fallback(6400, (100, 64)) == 1600
    assert memory_safe_fallback(6144, (3, 2048)) == 2048
    assert memory_safe_fallback(104729, None) == 1  # prime above the cap
    assert memory_safe_fallback(2**20, None) == 2048
    assert memory_safe_fallback(96, (32, 3)) == 96  # small tensors become one block
    assert largest_divisor_at_most(6400, 2048) == 1600


def test_search_finds_real_block_structure() -> None:
    # g^2 constant on blocks of 8 (and of 12): the raw search detects the block length.
    g8 = torch.repeat_interleave(torch.tensor([1.0, 3.0, 2.0]), 8).sqrt()
    assert search_period(g8) == 8
    g12 = torch.repeat_interleave(torch.tensor([1.0, 5.0, 2.0, 7.0, 3.0, 4.0]), 12).sqrt()
    assert search_period(g12) == 12


def test_noise_is_not_block_structure() -> None:
    torch.manual_seed(0)
    g = torch.randn(192, 256)
    scored = [(d, within_block_spread(g, d)) for d in divisors(g.numel())]
    assert select_period(scored, min_relative_drop=0.0) == 16384  # the reference's rule: a third of the tensor
    assert select_period(scored) == 1
    assert search_period(g, g.shape) == 2048
    assert search_period(torch.randn(100, 300), (100, 300)) == 2000  # the reference's rule gives 250
    assert search_period(torch.randn(20, 3000), (20, 3000)) == 3000  # in_features beats the capped divisor 2000


def test_search_falls_back_to_a_shape_aligned_block_without_structure() -> None:
    torch.manual_seed(0)
    g = torch.randn(256, 512)
    period = search_period(g, g.shape)
    assert period == 2048 and g.numel() % period == 0
    assert search_period(torch.ones(1)) == 1
    assert search_period(torch.zeros(0)) == 1


def test_search_handles_blocks_larger_than_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    from gefen_core import periods

    g = torch.randn(64)
    expected = within_block_spread(g, 32)
    monkeypatch.setattr(periods, "_CHUNK_ELEMENTS", 8)
    assert within_block_spread(g, 32) == pytest.approx(expected, rel=1e-12)
    assert within_block_spread(g, 4) == pytest.approx(within_block_spread(g.clone(), 4))


def test_policy_overrides_come_first() -> None:
    g = torch.randn(64, 64)
    assert PeriodPolicy(force_2d_period_one=True).resolve("w", (64, 64), g) == 1
    assert PeriodPolicy(force_1d_period_one=True).resolve("w", (64, 64), g) == search_period(g, (64, 64)) > 1
    assert PeriodPolicy(force_1d_period_one=True).resolve("b", (64,), torch.randn(64)) == 1
    assert PeriodPolicy(period_one_substrings=("NORM",)).resolve("layer.norm.weight", (64, 64), g) == 1
    assert PeriodPolicy(period_one_substrings=("norm",)).resolve("layer.proj", (64, 64), g) == search_period(
        g, (64, 64)
    )
    assert PeriodPolicy().resolve(None, (1,), torch.ones(1)) == 1

"""Block periods: the shape rule, the fallback and the user's overrides."""

from __future__ import annotations

import pytest
from gefen_core.periods import (
    PeriodPolicy,
    largest_divisor_at_most,
    memory_safe_fallback,
    shape_period,
)
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def test_memory_safe_fallback_pinned_examples() -> None:
    assert memory_safe_fallback(4, (4,)) == 1
    assert memory_safe_fallback(6400, (100, 64)) == 1600
    assert memory_safe_fallback(6144, (3, 2048)) == 2048
    assert memory_safe_fallback(104729, None) == 2048  # prime above the cap: ragged blocks, not one per element
    assert memory_safe_fallback(16 * 5471, None) == 2048  # ragged, not blocks of 16 (5471 is prime)
    assert memory_safe_fallback(2**20, None) == 2048
    assert memory_safe_fallback(96, (32, 3)) == 96  # small tensors become one block
    assert largest_divisor_at_most(6400, 2048) == 1600


@pytest.mark.parametrize(
    ("shape", "period"),
    [
        ((231, 128), 128),  # a row up to the cap is one block
        ((512, 2048), 2048),
        ((64, 4096), 2048),  # a long row is cut into its largest divisor up to the cap
        ((8, 3093), 1031),  # 3093 = 3 x 1031
        ((4, 4099), 4099),  # a prime row has no divisor in [256, 2048]: one block per row
        ((16, 4, 8), 32),  # rows of a 3-D tensor: prod(shape[1:])
        ((3, 5), 5),
    ],
)
def test_the_period_follows_the_rows(shape: tuple[int, ...], period: int) -> None:
    numel = 1
    for d in shape:
        numel *= d
    assert shape_period(shape, numel) == period
    assert shape_period(shape, (numel // shape[0]) * 2) == period  # two rows (a row shard) keep it


def test_pieces_that_are_not_whole_rows_and_1d_tensors_take_the_fallback() -> None:
    assert shape_period((64, 128), 100) == memory_safe_fallback(100, None) == 100
    assert shape_period((4096,), 4096) == 2048
    assert shape_period((7,), 7) == 1
    assert shape_period((64, 128), 1) == 1
    assert shape_period((0, 128), 0) == 1


def test_policy_overrides_come_first() -> None:
    assert PeriodPolicy(force_2d_period_one=True).resolve("w", (64, 64), 4096) == 1
    assert PeriodPolicy(force_1d_period_one=True).resolve("w", (64, 64), 4096) == 64
    assert PeriodPolicy(force_1d_period_one=True).resolve("b", (64,), 64) == 1
    assert PeriodPolicy(period_one_substrings=("NORM",)).resolve("layer.norm.weight", (64, 64), 4096) == 1
    assert PeriodPolicy(period_one_substrings=("norm",)).resolve("layer.proj", (64, 64), 4096) == 64
    assert PeriodPolicy().resolve(None, (1,), 1) == 1

"""Paired loss ratios and their Student-t intervals."""

from __future__ import annotations

import math

import pytest
from gefen.bench.intervals import paired_ratio, student_t_95


def test_paired_ratio_pairs_by_seed_and_bounds_the_mean() -> None:
    values = {1: 1.01, 2: 1.02, 3: 0.99, 9: 5.0}
    baseline = {1: 1.0, 2: 1.0, 3: 1.0, 4: 7.0}
    ratio = paired_ratio(values, baseline)
    assert ratio.n == 3  # seeds 9 and 4 have no partner
    assert ratio.mean == pytest.approx(1.0066666666666666)
    sd = math.sqrt(((0.01 - 0.00666) ** 2 + (0.02 - 0.00666) ** 2 + (-0.01 - 0.00666) ** 2) / 2)
    assert ratio.half_width == pytest.approx(4.303 * sd / math.sqrt(3), rel=1e-3)
    assert ratio.low < 1.0 < ratio.high
    assert str(ratio).startswith("1.0067 [")


def test_a_single_seed_has_no_interval_and_divergence_is_infinite() -> None:
    single = paired_ratio({0: 2.0}, {0: 1.0})
    assert (single.mean, single.low, single.high, single.n) == (2.0, 2.0, 2.0, 1)
    assert str(single) == "2.0000"
    assert paired_ratio({0: math.inf, 1: 1.0}, {0: 1.0, 1: 1.0}).mean == math.inf
    with pytest.raises(ValueError, match="no seed"):
        paired_ratio({0: 1.0}, {1: 1.0})


def test_student_t_quantiles() -> None:
    assert student_t_95(1) == 12.706
    assert student_t_95(4) == 2.776
    assert student_t_95(30) == 2.042
    assert student_t_95(500) == 1.960
    with pytest.raises(ValueError, match="degrees of freedom"):
        student_t_95(0)


@pytest.mark.parametrize(
    ("gefen_losses", "verdict"),
    [
        ({0: 0.99, 1: 0.98, 2: 0.985}, "meets the <= 1.000 target"),
        ({0: 0.95, 1: 1.031, 2: 0.99}, "its mean is within the <= 1.000 target, but its 95 % interval is not"),
        ({0: 1.02, 1: 1.01, 2: 1.03}, "misses the <= 1.000 target"),
    ],
)
def test_the_quality_verdict_says_when_the_seeds_do_not_resolve_the_target(
    gefen_losses: dict[int, float], verdict: str
) -> None:
    """A paired ratio of 0.99 [0.949, 1.031] was reported as meeting the <= 1.000 target."""
    from types import SimpleNamespace

    from gefen.bench.quality import _add_verdicts
    from gefen.bench.schema import ReportBuilder

    builder = ReportBuilder("quality")
    adamw = SimpleNamespace(optimizer="adamw", test_by_seed={0: 1.0, 1: 1.0, 2: 1.0})
    gefen = SimpleNamespace(optimizer="gefen", test_by_seed=gefen_losses)
    _add_verdicts(builder, "char-tiny", {"adamw": adamw, "gefen": gefen}, adamw)  # type: ignore[dict-item, arg-type]
    (note,) = builder.build().notes
    assert note.startswith("char-tiny: gefen / adamw = ") and note.endswith(f"({verdict})"), note

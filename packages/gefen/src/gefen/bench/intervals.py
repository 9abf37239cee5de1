"""Paired ratios with a confidence interval: how the quality benchmarks compare two optimizers.

Runs of two optimizers with the same seed share the model initialisation and the batch
order, so their per-seed loss ratios are paired: the spread of the ratio is much smaller
than the spread of either loss, and a mean of ``n`` paired ratios with a Student-t interval
resolves differences of a few tenths of a percent with a handful of seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PairedRatio", "paired_ratio", "student_t_95"]

# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def student_t_95(degrees_of_freedom: int) -> float:
    """The two-sided 95 % quantile of Student's t (the normal 1.960 beyond 30 degrees)."""
    if type(degrees_of_freedom) is not int or degrees_of_freedom < 1:
        raise ValueError(f"degrees of freedom must be a positive int, got {degrees_of_freedom!r}")
    return _T95[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T95) else 1.960


@dataclass(frozen=True, slots=True)
class PairedRatio:
    """Mean of per-seed ratios ``value / baseline`` and its 95 % interval (``n == 1``: no interval)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        if self.n < 2:
            return f"{self.mean:.4f}"
        return f"{self.mean:.4f} [{self.low:.4f}, {self.high:.4f}]"


def paired_ratio(values: Mapping[int, float], baseline: Mapping[int, float]) -> PairedRatio:
    """The paired ratio over the seeds both mappings hold (``ValueError`` if they share none)."""
    seeds = sorted(set(values) & set(baseline))
    if not seeds:
        raise ValueError("no seed is shared by the two sets of runs")
    ratios = [values[seed] / baseline[seed] for seed in seeds]
    if not all(math.isfinite(ratio) for ratio in ratios):
        return PairedRatio(math.inf, math.inf, math.inf, len(ratios))
    mean = statistics.fmean(ratios)
    if len(ratios) == 1:
        return PairedRatio(mean, mean, mean, 1)
    half = student_t_95(len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return PairedRatio(mean, mean - half, mean + half, len(ratios))

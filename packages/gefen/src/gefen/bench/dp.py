"""``gefen bench dp``: time of gefen-core's exact codebook solve (pinned 1-D k-means, K = 256).

Cases are 4096-bin histograms like those Gefen learns its codebook from: block-normalised
Gaussian and heavy-tailed (Student-t) gradients, and the worst case where every bin is
occupied. The baseline is gefen-core's ``O(K N^2)`` brute-force oracle on a smaller
histogram, timed in the same run; both solvers must return the identical codebook, which
the report records. Each time is the median of several repeats.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np
import numpy.typing as npt
import torch
from gefen_core.exact_dp import (
    CodebookSolution,
    histogram_points,
    solve_pinned_codebook,
    solve_pinned_codebook_bruteforce,
)
from gefen_core.ops import CODEBOOK_SOLVE, Kernels, kernel_registered

from .plot import Panel, Series
from .schema import BenchmarkReport, ReportBuilder

__all__ = ["DpOptions", "dp_panels", "histogram_case", "run_dp"]

CODEBOOK_SIZE = 256
HISTOGRAM_BINS = 4096
_BLOCK = 256


@dataclass(frozen=True, slots=True)
class DpOptions:
    """``elements`` gradient values per synthetic histogram; ``bruteforce_bins`` for the oracle case."""

    repeats: int = 5
    elements: int = 1 << 22
    bruteforce_bins: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        if type(self.repeats) is not int or self.repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {self.repeats!r}")
        if type(self.elements) is not int or self.elements < _BLOCK:
            raise ValueError(f"elements must be an int >= {_BLOCK}, got {self.elements!r}")
        # (the full HISTOGRAM_BINS case is the fast rows' own: its oracle would take hours, and
        # its rows would share their names)
        if type(self.bruteforce_bins) is not int or not CODEBOOK_SIZE <= self.bruteforce_bins < HISTOGRAM_BINS:
            raise ValueError(
                f"bruteforce_bins must be in [{CODEBOOK_SIZE}, {HISTOGRAM_BINS}), got {self.bruteforce_bins!r}"
            )


def histogram_case(kind: str, bins: int, elements: int, seed: int) -> npt.NDArray[np.int64]:
    """A ``bins``-bin histogram on [-1, 1]: block-normalised gradients (``gaussian``, ``student-t``)
    or every bin occupied with random counts (``full``)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "full":
        return torch.randint(1, 1000, (bins,), generator=generator).numpy().astype(np.int64)
    if kind == "gaussian":
        values = torch.randn(elements // _BLOCK, _BLOCK, generator=generator)
    elif kind == "student-t":
        normal = torch.randn(elements // _BLOCK, _BLOCK, generator=generator)
        chi2 = torch.randn(3, elements // _BLOCK, _BLOCK, generator=generator).square().sum(0)
        values = normal / (chi2 / 3).sqrt()
    else:
        raise ValueError(f"unknown histogram kind {kind!r}; known: gaussian, student-t, full")
    normalised = values / values.abs().amax(dim=1, keepdim=True)
    index = ((normalised + 1) * (bins / 2)).floor().clamp_(0, bins - 1).to(torch.int64)
    return torch.bincount(index.flatten(), minlength=bins).numpy().astype(np.int64)


def _time(solve: Callable[[], object], repeats: int) -> tuple[float, list[float], object]:
    times = []
    result: object = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = solve()
        times.append(time.perf_counter() - started)
    return statistics.median(times), times, result


def run_dp(options: DpOptions, *, progress: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Time the fast solve on each case and the oracle on the smaller full histogram."""
    tick = progress or (lambda _label: None)
    builder = ReportBuilder("dp", config={**asdict(options), "clusters": CODEBOOK_SIZE, "bins": HISTOGRAM_BINS})

    small = histogram_case("full", options.bruteforce_bins, options.elements, options.seed)
    positions, weights, scale = histogram_points(small)
    brute_median, brute_times, brute = _time(
        lambda: solve_pinned_codebook_bruteforce(positions, weights, CODEBOOK_SIZE, scale=scale),
        max(1, options.repeats // 2),
    )
    tick("oracle")
    fast_median, fast_times, fast = _time(
        lambda: solve_pinned_codebook(positions, weights, CODEBOOK_SIZE, scale=scale), options.repeats
    )
    tick(f"full-{options.bruteforce_bins}")
    identical = bool(np.array_equal(getattr(brute, "codebook"), getattr(fast, "codebook")))  # noqa: B009
    oracle_name = f"full-{options.bruteforce_bins}/bruteforce"
    builder.add(oracle_name, "solve_s", brute_median, "s", detail={"points": int(positions.size), "times": brute_times})
    builder.add(
        f"full-{options.bruteforce_bins}/fast",
        "solve_s",
        fast_median,
        "s",
        baseline=oracle_name,
        detail={"points": int(positions.size), "times": fast_times, "identical_to_bruteforce": identical},
    )
    if not identical:
        builder.note("the fast solve and the brute-force oracle returned different codebooks")

    op = Kernels(None).op(CODEBOOK_SOLVE)  # what a step runs: gefen-kernels' C solve where registered
    kernel = kernel_registered(CODEBOOK_SOLVE, torch.device("cpu"))
    for kind in ("gaussian", "student-t", "full"):
        counts = histogram_case(kind, HISTOGRAM_BINS, options.elements, options.seed)
        positions, weights, scale = histogram_points(counts)
        solve = functools.partial(solve_pinned_codebook, positions, weights, CODEBOOK_SIZE, scale=scale)
        median, times, reference = _time(solve, options.repeats)
        name = f"{kind}-{HISTOGRAM_BINS}/fast"
        builder.add(name, "solve_s", median, "s", detail={"points": int(positions.size), "times": times})
        op_median, op_times, solved = _time(functools.partial(op, torch.from_numpy(counts)), options.repeats)
        same = torch.equal(torch.from_numpy(cast(CodebookSolution, reference).codebook), cast(torch.Tensor, solved))
        builder.add(
            f"{kind}-{HISTOGRAM_BINS}/op",
            "solve_s",
            op_median,
            "s",
            baseline=name,
            detail={"times": op_times, "c_kernel": kernel, "identical_to_fast": same},
        )
        if not same:
            builder.note(f"{kind}: the op and the numpy solve returned different codebooks")
        tick(kind)
    builder.note(
        "the /op rows run gefen::codebook_solve.v2 as a step does: "
        + ("gefen-kernels' C solve" if kernel else "the numpy reference (no kernel is registered)")
    )
    builder.note(
        "the reference solves the same problem with an O(K N^2) numba DP (about 2.1e9 inner iterations for a full "
        "4096-bin histogram); the oracle row is gefen-core's own O(K N^2) solver on a smaller histogram"
    )
    return builder.build()


def dp_panels(report: BenchmarkReport) -> list[Panel]:
    rows = [row for row in report.rows if row.metric == "solve_s"]
    series = tuple(Series(row.name, (0.0,), (row.value,)) for row in rows)
    return [Panel("codebook solve time (median, log scale)", "", "seconds", series, kind="bar", log_y=True)]

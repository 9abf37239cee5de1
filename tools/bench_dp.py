"""Time gefen-core's exact codebook solve (pinned 1-D k-means, K = 256, 4096-bin histograms).

Prints a table and writes JSON rows (name / metric / value / unit / baseline / ratio), the
row shape of ``gefen bench``. The baseline of the speed-up row is gefen-core's O(K N^2)
brute-force oracle on the same (smaller) histogram, timed in this run; both must return the
identical codebook.

    uv run python tools/bench_dp.py [--repeats 3] [--oracle-bins 512] [--json dp.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gefen_core.exact_dp import histogram_points, solve_pinned_codebook, solve_pinned_codebook_bruteforce

BINS = 4096
CODEBOOK = 256


def histogram(kind: str, bins: int, seed: int) -> np.ndarray:
    """Occupied-bin counts: ``full`` (every bin occupied) or ``gaussian`` (block-normalised N(0, 1))."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "full":
        return torch.randint(1, 1000, (bins,), generator=generator).numpy().astype(np.int64)
    values = torch.randn(1 << 14, 256, generator=generator)
    normalised = values / values.abs().amax(dim=1, keepdim=True)
    index = ((normalised + 1) * (bins / 2)).floor().clamp_(0, bins - 1).to(torch.int64)
    return torch.bincount(index.flatten(), minlength=bins).numpy().astype(np.int64)


def timed(solve: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = solve()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(repeats: int, oracle_bins: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for kind in ("full", "gaussian"):
        positions, weights, scale = histogram_points(histogram(kind, BINS, 0))
        seconds, _ = timed(functools.partial(solve_pinned_codebook, positions, weights, CODEBOOK, scale=scale), repeats)
        rows.append(
            {
                "name": f"dp/{kind}-{BINS}",
                "metric": "solve_time",
                "value": seconds,
                "unit": "s",
                "baseline": None,
                "ratio": None,
                "detail": {"occupied_bins": int(positions.size)},
            }
        )
    positions, weights, scale = histogram_points(histogram("full", oracle_bins, 1))
    oracle_seconds, oracle = timed(
        lambda: solve_pinned_codebook_bruteforce(positions, weights, CODEBOOK, scale=scale), 1
    )
    fast_seconds, fast = timed(lambda: solve_pinned_codebook(positions, weights, CODEBOOK, scale=scale), repeats)
    if not np.array_equal(fast.codebook, oracle.codebook):
        raise SystemExit("the divide-and-conquer solve differs from the brute-force oracle")
    oracle_name = f"dp/bruteforce-{oracle_bins}"
    rows.append(
        {
            "name": oracle_name,
            "metric": "solve_time",
            "value": oracle_seconds,
            "unit": "s",
            "baseline": None,
            "ratio": None,
            "detail": {"occupied_bins": oracle_bins},
        }
    )
    rows.append(
        {
            "name": f"dp/divide-and-conquer-{oracle_bins}",
            "metric": "solve_time",
            "value": fast_seconds,
            "unit": "s",
            "baseline": oracle_name,
            "ratio": fast_seconds / oracle_seconds,
            "detail": {"occupied_bins": oracle_bins, "identical_codebook": True},
        }
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--oracle-bins", type=int, default=512, help="histogram size for the O(K N^2) oracle")
    parser.add_argument("--json", type=Path, default=Path("bench_dp.json"))
    args = parser.parse_args(argv)
    rows = run(args.repeats, args.oracle_bins)
    print(f"{'name':<32} {'metric':<11} {'value':>10} {'unit':<4} {'ratio':>8}")
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.4f}"
        print(f"{row['name']:<32} {row['metric']:<11} {row['value']:>10.4f} {row['unit']:<4} {ratio:>8}")
    report = {
        "schema": "gefen.bench",
        "schema_version": 1,
        "benchmark": "dp",
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": sys.version.split()[0],
        },
        "libraries": {"torch": torch.__version__, "numpy": np.__version__},
        "config": {"repeats": args.repeats, "oracle_bins": args.oracle_bins, "codebook_size": CODEBOOK, "bins": BINS},
        "notes": "median wall time of the exact pinned k-means solve; ratio = divide-and-conquer / brute force",
        "rows": rows,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``gefen bench dp``: time of gefen-core's exact codebook solve against its brute-force oracle."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "dp",
        help="time of the exact codebook solve (K=256) on 4096-bin histograms vs the O(K N^2) oracle",
        description=(
            "Time gefen-core's exact pinned k-means codebook solve on histograms of block-normalised Gaussian and "
            "Student-t gradients and on a fully occupied histogram, and its brute-force O(K N^2) oracle on a smaller "
            "histogram in the same run (both must return the same codebook)."
        ),
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats per case; the median is reported (default 5)"
    )
    parser.add_argument("--elements", type=int, default=1 << 22, help="gradient values per synthetic histogram")
    parser.add_argument(
        "--bruteforce-bins", type=int, default=1024, help="bins of the oracle's histogram (default 1024)"
    )
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from ..bench.dp import DpOptions, dp_panels, run_dp
    from ..bench.output import emit

    try:
        options = DpOptions(repeats=args.repeats, elements=args.elements, bruteforce_bins=args.bruteforce_bins)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with tqdm(total=5, desc="dp", unit="case", file=sys.stderr) as bar:

        def advance(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        report = run_dp(options, progress=advance)
    emit(report, out=args.out, stem="dp", panels=dp_panels(report), plot_title="gefen bench dp", as_json=args.json)
    return 0

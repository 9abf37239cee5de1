"""``gefen bench muon``: GefenMuon's step against ``torch.optim.Muon`` (and the fp8 GPU check)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "muon",
        help="GefenMuon step, Newton-Schulz alone, state bytes and orthogonality vs torch.optim.Muon",
        description=(
            "Time GefenMuon's whole step (each Newton-Schulz schedule: standard, tuned3, tuned4; reference codec and, "
            "when registered, kernels) against torch.optim.Muon on the same matrices and gradients (default twelve "
            "1024x1024 and three 1024x4096), round-robin, medians after one warm-up round; Newton-Schulz alone per "
            "schedule against torch's NS5; state bytes per parameter; the orthogonality error of each schedule. "
            "--device-check runs the fp8_ns GPU check instead (needs CUDA capability >= 8.9; elsewhere it says so "
            "and exits 0)."
        ),
    )
    parser.add_argument("--tiny", action="store_true", help="three small matrices (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for every optimizer (default 2)")
    parser.add_argument(
        "--device-check", action="store_true", help="the fp8_ns check on a CUDA GPU (exit 1 when a bound fails)"
    )
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.muon import FULL_SHAPES, TINY_SHAPES, MuonOptions, muon_panels, run_fp8_device_check, run_muon
    from ..bench.output import emit
    from .progress import progress_bar

    if args.device_check:
        checked = run_fp8_device_check(max(args.repeats, 5))
        if checked is None:
            print("device check skipped: fp8_ns needs a CUDA GPU of compute capability >= 8.9", file=sys.stderr)
            return 0
        emit(checked, out=args.out, stem="muon-fp8", plot_title="gefen bench muon --device-check", as_json=args.json)
        return 1 if any(note.startswith("FAILED:") for note in checked.notes) else 0
    try:
        options = MuonOptions(
            shapes=TINY_SHAPES if args.tiny else FULL_SHAPES, repeats=args.repeats, threads=args.threads
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with progress_bar(options.repeats + 3, "muon", "phase") as advance:
        report = run_muon(options, progress=advance)
    emit(
        report, out=args.out, stem="muon", panels=muon_panels(report), plot_title="gefen bench muon", as_json=args.json
    )
    return 0

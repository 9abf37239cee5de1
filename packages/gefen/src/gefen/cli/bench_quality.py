"""``gefen bench quality``: held-out loss at each optimizer's own best learning rate."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.output import add_output_options
from .bench_memory import _names
from .errors import UsageError

__all__ = ["register"]


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated learning rates, got {text!r}") from None
    if not rates or any(not rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"expected positive learning rates, got {text!r}")
    return rates


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "quality",
        _add_arguments,
        help="held-out loss vs AdamW (and torchao 4-bit AdamW), each at its own best learning rate",
        description=(
            "For each task and optimizer: sweep the task's learning-rate grid (shared by every optimizer) at the sweep "
            "seeds and choose the rate with the lowest mean validation loss, then train the next N seeds at that rate "
            "and report the mean held-out test loss, the paired per-seed loss ratio to AdamW with its 95 % interval, "
            "and the best-LR ratio. 'ladder' in --optimizers adds every rung of the quality ladder. About 2.5 hours on 2 CPU cores "
            "with the defaults; word-medium (the long task) alone takes longer."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.quality import DEFAULT_OPTIMIZERS, DEFAULT_TASKS, QUALITY_TASKS

    parser.add_argument(
        "--tasks",
        type=_names,
        default=DEFAULT_TASKS,
        metavar="A,B",
        help=f"tasks (known: {', '.join(QUALITY_TASKS)}; default {','.join(DEFAULT_TASKS)})",
    )
    parser.add_argument(
        "--optimizers",
        type=_names,
        default=DEFAULT_OPTIMIZERS,
        metavar="A,B",
        help=f"optimizers, or 'ladder' for every ladder rung (default {','.join(DEFAULT_OPTIMIZERS)})",
    )
    parser.add_argument(
        "--lr-grid",
        type=_rates,
        default=None,
        metavar="LR,LR",
        help="one learning-rate grid for every task (default: each task's own grid)",
    )
    parser.add_argument("--seeds", type=int, default=5, help="reported seeds at the chosen learning rate (default 5)")
    parser.add_argument(
        "--sweep-seeds",
        type=int,
        default=1,
        help="seeds per learning rate in the sweep; the rate is chosen on their mean valid loss (default 1)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="override every task's step count (changes the token budget)"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="parallel single-threaded runs (default: up to 2, one per core)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the runs train (cuda: the workers share one GPU; compare runs of one device only)",
    )
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.optimizers import unavailable_reason
    from ..bench.output import emit
    from ..bench.quality import QualityOptions, quality_panels, run_quality
    from .progress import progress_bar

    pool = {"workers": args.workers} if args.workers is not None else {}
    try:
        options = QualityOptions(
            tasks=args.tasks,
            optimizers=args.optimizers,
            lr_grid=args.lr_grid,
            seeds=args.seeds,
            sweep_seeds=args.sweep_seeds,
            steps=args.steps,
            threads=args.threads,
            device=args.device,
            **pool,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    runnable = [name for name in options.optimizers if unavailable_reason(name) is None]
    total = sum(len(runnable) * options.runs_per_optimizer(task) for task in options.tasks)
    with progress_bar(total, "quality", "run") as advance:
        report, _ = run_quality(options, progress=advance)
    emit(
        report,
        out=args.out,
        stem="quality",
        panels=quality_panels(report),
        plot_title="gefen bench quality",
        as_json=args.json,
    )
    return 0

"""``gefen bench guard``: the sealed-layout guard's cost per step after ``post_sharding``."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "guard",
        _add_arguments,
        help="cost of the post_sharding layout guard: us per parameter tensor and %% of a step",
        description=(
            "After post_sharding every step verifies the optimizer's sealed layout. For many small parameter tensors "
            "this times one guard pass (us per parameter tensor) and its share of the bound step, against the same "
            "optimizer unbound and torch's AdamW measured in the same run: ContractedAdamW and a composite of two "
            "always, Gefen once its contract claims post_sharding. Once Gefen claims collective_scope, two gloo ranks "
            "count the collectives of a steady-state scoped step against its declared budget."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.guard import GuardOptions

    defaults = GuardOptions()
    parser.add_argument("--tensors", type=int, default=defaults.tensors, help="parameter tensors (default %(default)s)")
    parser.add_argument("--numel", type=int, default=defaults.numel, help="elements per tensor (default %(default)s)")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="steps per sample (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="samples (default %(default)s)")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (default %(default)s)")
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.guard import GuardOptions, guard_panels, run_guard
    from ..bench.output import emit
    from .progress import progress_bar

    try:
        options = GuardOptions(
            tensors=args.tensors, numel=args.numel, steps=args.steps, repeats=args.repeats, threads=args.threads
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with progress_bar(4, "guard", "arm") as advance:
        report = run_guard(options, progress=advance)
    emit(
        report,
        out=args.out,
        stem="guard",
        panels=guard_panels(report),
        plot_title="gefen bench guard",
        as_json=args.json,
    )
    return 0

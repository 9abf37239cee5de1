"""``gefen bench memory``: optimizer-state bytes per parameter and the step's transient peak."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names")
    return names


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "memory",
        _add_arguments,
        help="optimizer-state bytes/param and step transient peak vs AdamW",
        description=(
            "For each model preset and optimizer, in a fresh process: take real steps, count the unique tensor storages "
            "reachable from the optimizer (params and grads excluded) and measure the resident-memory peak of a "
            "steady-state step. Ratios are against AdamW on the same model. Optional optimizers that are not "
            "installed are listed as notes."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.memory import DEFAULT_MODELS, DEFAULT_OPTIMIZERS
    from ..demo.model import MODEL_PRESETS

    parser.add_argument(
        "--models",
        type=_names,
        default=DEFAULT_MODELS,
        metavar="A,B",
        help=f"model presets (known: {', '.join(MODEL_PRESETS)}; default {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--optimizers",
        type=_names,
        default=DEFAULT_OPTIMIZERS,
        metavar="A,B",
        help=f"optimizers (default {','.join(DEFAULT_OPTIMIZERS)})",
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per measurement, at least 2 (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per probe (default: torch's choice)")
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # type: ignore[import-untyped]

    from ..bench.memory import MemoryOptions, memory_panels, run_memory
    from ..bench.output import emit

    try:
        options = MemoryOptions(models=args.models, optimizers=args.optimizers, steps=args.steps, threads=args.threads)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with tqdm(total=len(options.models) * len(options.optimizers), desc="memory", unit="probe", file=sys.stderr) as bar:

        def advance(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        report = run_memory(options, progress=advance)
    emit(
        report,
        out=args.out,
        stem="memory",
        panels=memory_panels(report),
        plot_title="gefen bench memory",
        as_json=args.json,
    )
    return 0

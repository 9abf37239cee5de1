"""``gefen demo``: train a small decoder with Gefen and with torch AdamW, compare, plot."""

from __future__ import annotations

import argparse
import math
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def _learning_rate(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        lr = float(value)
    except ValueError:
        lr = float("nan")
    if not sep or not name or not 0 < lr < math.inf:
        raise argparse.ArgumentTypeError(f"expected NAME=LR with a positive finite LR, got {text!r}")
    return name, lr


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "demo",
        _add_arguments,
        help="train a small transformer with Gefen and with AdamW and compare them (about 2 minutes on CPU)",
        description=(
            "Train a small decoder-only transformer on tinylang, a synthetic language generated on the fly "
            "(nothing is downloaded), once per optimizer, each in a fresh process. Prints a table (held-out loss, "
            "tokens/s, optimizer-state bytes per parameter, peak memory) and writes demo.json, demo.txt and a "
            "loss plot demo.png to the output folder."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.optimizers import optimizer_names
    from ..demo.model import MODEL_PRESETS
    from ..demo.run import DemoOptions

    defaults = DemoOptions()
    parser.add_argument(
        "--steps", type=int, default=defaults.steps, help=f"training steps per optimizer (default {defaults.steps})"
    )
    parser.add_argument(
        "--model-size",
        choices=sorted(MODEL_PRESETS),
        default=defaults.model_size,
        help=f"model preset (default {defaults.model_size})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"seed of the initialisation and batch order (default {defaults.seed})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help=f"sequences per step (default {defaults.batch_size})",
    )
    parser.add_argument(
        "--tokenization", choices=("char", "word"), default=defaults.tokenization, help="character- or word-level task"
    )
    parser.add_argument(
        "--optimizers",
        default=",".join(defaults.optimizers),
        metavar="A,B",
        help=f"comma-separated optimizers to compare (known: {', '.join(optimizer_names())}; default %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=_learning_rate,
        action="append",
        default=[],
        metavar="NAME=LR",
        help="override one optimizer's peak learning rate (repeatable; default 4e-3 for each, the best of gefen bench quality's grid here)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per arm (default: torch's choice; 1 helps on a busy machine)",
    )
    parser.add_argument("--eval-every", type=int, default=0, help="validation interval in steps (default: steps/10)")
    add_output_options(parser, default_out="gefen-demo")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.output import emit
    from ..demo.report import demo_panels, demo_table
    from ..demo.run import DemoOptions, run_demo

    try:
        options = DemoOptions(
            optimizers=tuple(name.strip() for name in args.optimizers.split(",") if name.strip()),
            steps=args.steps,
            model_size=args.model_size,
            tokenization=args.tokenization,
            batch_size=args.batch_size,
            seed=args.seed,
            eval_every=args.eval_every,
            learning_rates=dict(args.lr),
            threads=args.threads,
        )
    except ValueError as exc:  # before any process starts: a usage error, not a traceback
        raise UsageError(str(exc)) from None
    outcome = run_demo(options)
    table = demo_table(outcome.report)
    if outcome.report.notes:
        table += "\n" + "\n".join(f"note: {note}" for note in outcome.report.notes)
    emit(
        outcome.report,
        out=args.out,
        stem="demo",
        panels=demo_panels(outcome.arms, outcome.spec),
        plot_title=f"gefen demo: {options.model_size} decoder on tinylang ({options.tokenization})",
        table=table,
        as_json=args.json,
    )
    return 0

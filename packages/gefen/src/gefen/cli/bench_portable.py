"""``gefen bench portable``: portable export/import cost vs torch's get/set_optimizer_state_dict."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.output import add_output_options
from .bench_dcp import _ranks
from .bench_memory import _names
from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "portable",
        _add_arguments,
        help="portable state export/import: per-rank peak memory and seconds vs torch's optimizer state-dict API",
        description=(
            "For each model size and world size, fresh processes (one per rank, gloo on 127.0.0.1) take one step, "
            "then measure an export and an import into a fresh optimizer, in memory (gefen_portable.export/"
            "import_portable_state) and through DCP storage (gefen_dcp.save/load_portable_dcp): seconds of the "
            "slowest rank and the worst rank's sampled peak resident growth per parameter it holds. The baseline is "
            "torch AdamW under FSDP2 through get_optimizer_state_dict/set_optimizer_state_dict (and dcp.save/load). "
            "Arms must claim portable_state (and post_sharding on more than one rank; they are bound to flattened "
            "slices); others are skipped with their contract's reason."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.portable import DEFAULT_ARMS, PortableOptions

    defaults = PortableOptions()
    parser.add_argument(
        "--models",
        type=_names,
        default=defaults.models,
        metavar="A,B",
        help=f"model sizes such as 10m or presets (default {','.join(defaults.models)})",
    )
    parser.add_argument(
        "--ranks", type=_ranks, default=defaults.ranks, metavar="N,N", help="world sizes (default 1,2,3)"
    )
    parser.add_argument(
        "--optimizers",
        type=_names,
        default=DEFAULT_ARMS,
        metavar="A,B",
        help=f"arms: registry names, contracted-adamw or MODULE:FACTORY (default {','.join(DEFAULT_ARMS)})",
    )
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per rank (default 1)")
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.output import emit
    from ..bench.portable import PortableOptions, portable_panels, run_portable
    from .progress import progress_bar

    try:
        options = PortableOptions(models=args.models, ranks=args.ranks, arms=args.optimizers, threads=args.threads)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    total = len(options.models) * len(options.ranks) * (len(options.arms) + 1)
    with progress_bar(total, "portable", "run") as advance:
        report = run_portable(options, progress=advance)
    emit(
        report,
        out=args.out,
        stem="portable",
        panels=portable_panels(report),
        plot_title="gefen bench portable",
        as_json=args.json,
    )
    return 0

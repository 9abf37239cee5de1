"""``gefen bench dcp``: DCP save/load seconds and per-rank peak memory against torch DCP of AdamW."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.output import add_output_options
from .bench_memory import _names
from .errors import UsageError

__all__ = ["register"]


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated world sizes, got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"expected positive world sizes, got {text!r}")
    return ranks


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "dcp",
        _add_arguments,
        help="DCP save / async save / load seconds and per-rank peak memory vs torch DCP of AdamW (FSDP2, 1-3 ranks)",
        description=(
            "For each world size and arm, fresh processes (one per rank, gloo on 127.0.0.1) train the decoder under "
            "FSDP2 for two steps, then time a dcp.save, a dcp.async_save and a dcp.load into a fresh optimizer, with "
            "the peak resident growth per parameter on the worst rank, and the checkpoint's bytes on disk per "
            "parameter. An arm recipe:NAME saves NAME's optimizer through torch's get_state_dict/set_state_dict and "
            "DCP's stock planner and writer, as the baseline torch.optim.AdamW does; other arms save through "
            "gefen_dcp.GefenDCPState and must claim parameter_shaped_state (others are skipped with their contract's reason)."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.dcp import DEFAULT_ARMS, DcpOptions

    defaults = DcpOptions()
    parser.add_argument(
        "--model", default=defaults.model, help="a model preset or a size such as 100m (default %(default)s)"
    )
    parser.add_argument(
        "--ranks", type=_ranks, default=defaults.ranks, metavar="N,N", help="world sizes (default 1,2,3)"
    )
    parser.add_argument(
        "--optimizers",
        type=_names,
        default=DEFAULT_ARMS,
        metavar="A,B",
        help=f"arms: registry names or MODULE:FACTORY, recipe:NAME for torch's recipe (default {','.join(DEFAULT_ARMS)})",
    )
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per rank (default 1)")
    parser.add_argument("--with-model", action="store_true", help="save the model beside the optimizer")
    parser.add_argument(
        "--flatten",
        action="store_true",
        help="recipe arms and the baseline use flatten_optimizer_state_dict=True (torchtitan's and OLMo-core's recipe)",
    )
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.dcp import DcpOptions, dcp_panels, run_dcp
    from ..bench.output import emit
    from .progress import progress_bar

    try:
        options = DcpOptions(
            model=args.model,
            ranks=args.ranks,
            arms=args.optimizers,
            threads=args.threads,
            with_model=args.with_model,
            flatten=args.flatten,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with progress_bar(len(options.ranks) * (len(options.arms) + 1), "dcp", "run") as advance:
        report = run_dcp(options, progress=advance)
    emit(report, out=args.out, stem="dcp", panels=dcp_panels(report), plot_title="gefen bench dcp", as_json=args.json)
    return 0

"""``gefen bench step``: the whole optimizer step of Gefen against torch's fused AdamW."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "step",
        _add_arguments,
        help="time of a whole optimizer step (Gefen reference and fused, GefenMuon momentum) vs fused AdamW",
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.step import StepOptions

    defaults = StepOptions()
    parser.description = (
        "Time one whole optimizer.step() per arm on the same fp32 parameters and gradients shaped like a decoder "
        f"(default {defaults.d_model}-wide, {defaults.layers} layers, a {defaults.vocab}-token embedding: 23.6M "
        "parameters). Arms are stepped round-robin; the median of the timed rounds after warm-up is reported, "
        "with ratios to torch.optim.AdamW(fused=True) measured in the same run. Arms: AdamW fused and default, "
        "a copy of the 14 bytes/param a Gefen step must move, Gefen reference and fused (factored and block v), "
        "GefenMuon's quantised-momentum op, and torchao/bitsandbytes 8-bit and 4-bit AdamW when installed."
    )
    parser.add_argument(
        "--model",
        choices=("decoder", "demo"),
        default="decoder",
        help="decoder: the shapes of --d-model/--layers/--vocab (default); demo: gefen demo's model (0.81M parameters)",
    )
    parser.add_argument("--d-model", type=int, default=defaults.d_model, help="model width (default %(default)s)")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="decoder layers (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="embedding rows (default %(default)s)")
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch threads (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed rounds (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="timed rounds (default %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live")
    parser.add_argument(
        "--arms",
        default="",
        help="comma-separated arms to run, e.g. gefen-fused,gefen-block-fused (the adamw-fused baseline always runs)",
    )
    add_output_options(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.output import emit
    from ..bench.step import StepOptions, run_step, step_panels, step_table
    from .progress import progress_bar

    try:
        options = StepOptions(
            d_model=args.d_model,
            layers=args.layers,
            vocab=args.vocab,
            threads=args.threads,
            warmup=args.warmup,
            repeats=args.repeats,
            device=args.device,
            arms=tuple(name.strip() for name in args.arms.split(",") if name.strip()),
            model="" if args.model == "decoder" else args.model,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with progress_bar(options.warmup + options.repeats, "step", "round") as advance:
        try:
            report = run_step(options, progress=advance)
        except ValueError as exc:  # an unknown arm name
            raise UsageError(str(exc)) from None
    emit(
        report,
        out=args.out,
        stem="step",
        panels=step_panels(report),
        plot_title="gefen bench step",
        table=step_table(report),
        as_json=args.json,
    )
    return 0

"""``gefen find-lr [MODULE:FUNCTION]``: a learning-rate range test on any model."""

from __future__ import annotations

import argparse
from typing import Any

from ..bench.output import add_output_options
from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    sub.add_lazy_parser(
        "find-lr",
        _add_arguments,
        help="learning-rate range test (exponential ramp, smoothed loss, a suggested rate) on any model",
        description=(
            "Take STEPS optimizer steps while the learning rate grows geometrically from --start-lr to --end-lr, "
            "smooth the loss (bias-corrected EMA), stop early when it is not finite or exceeds --diverge-factor times "
            "the best, and suggest the centre of the steepest descent of the smoothed loss against log(lr) (over a "
            "factor of 3, up to the minimum; else a tenth of the rate at the minimum). The model's weights are "
            "restored afterwards. TARGET is MODULE:FUNCTION; FUNCTION() returns (model, batches) or (model, batches, "
            "loss_fn), where loss_fn(model, batch) is a scalar loss (without it the model's output is the loss). "
            "Rough: use the suggestion to centre a sweep."
        ),
    )


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..bench.optimizers import optimizer_names
    from ..find_lr import DEFAULT_TARGET, RangeTestOptions

    defaults = RangeTestOptions()
    parser.add_argument(
        "target",
        nargs="?",
        default=DEFAULT_TARGET,
        metavar="MODULE:FUNCTION",
        help="what to test (default: the demo decoder on tinylang, %(default)s)",
    )
    parser.add_argument(
        "--optimizer",
        default="gefen",
        help=f"a registry name ({', '.join(optimizer_names())}) or MODULE:FACTORY taking named parameters "
        "(default %(default)s)",
    )
    parser.add_argument("--weight-decay", type=float, default=0.0, help="weight decay of registry optimizers")
    parser.add_argument("--start-lr", type=float, default=defaults.start_lr, help="first rate (default %(default)g)")
    parser.add_argument("--end-lr", type=float, default=defaults.end_lr, help="last rate (default %(default)g)")
    parser.add_argument("--steps", type=int, default=defaults.num_iter, help="steps of the ramp (default %(default)s)")
    parser.add_argument(
        "--smooth-beta", type=float, default=defaults.smooth_beta, help="loss EMA factor (default %(default)s)"
    )
    parser.add_argument(
        "--diverge-factor",
        type=float,
        default=defaults.diverge_factor,
        help="stop when the smoothed loss exceeds this times the best (default %(default)s)",
    )
    parser.add_argument("--no-restore", action="store_true", help="leave the model trained (no weight restore)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    add_output_options(parser, default_out="gefen-find-lr")
    parser.set_defaults(handler=run)


def _factory(name: str, weight_decay: float) -> Any:
    from gefen_contracts.testing import import_attribute

    from ..bench.optimizers import build_optimizer, get_optimizer, unavailable_reason

    if ":" in name:
        try:
            target: Any = import_attribute(name)
        except (ValueError, ImportError, AttributeError) as exc:
            raise UsageError(f"cannot load optimizer factory {name}: {exc}") from None
        return lambda named, lr: target(named)
    try:
        get_optimizer(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    missing = unavailable_reason(name)
    if missing is not None:
        raise UsageError(f"optimizer {name!r} is not available here: {missing}")
    return lambda named, lr: build_optimizer(name, named, lr=lr, weight_decay=weight_decay)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench.output import emit
    from ..find_lr import (
        NoFiniteLossError,
        RangeTestOptions,
        TargetError,
        load_target,
        lr_range_test,
        range_test_panels,
        range_test_report,
        range_test_table,
    )
    from .progress import progress_bar

    try:
        options = RangeTestOptions(
            start_lr=args.start_lr,
            end_lr=args.end_lr,
            num_iter=args.steps,
            smooth_beta=args.smooth_beta,
            diverge_factor=args.diverge_factor,
            restore=not args.no_restore,
        )
        target = load_target(args.target)
    except (ValueError, TargetError) as exc:
        raise UsageError(str(exc)) from None
    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    build = _factory(args.optimizer, args.weight_decay)
    try:  # one trial build: a bad option or factory is a usage error before any training
        trial = build(list(target.model.named_parameters()), options.start_lr)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot build the optimizer {args.optimizer!r}: {type(exc).__name__}: {exc}") from None
    if not isinstance(trial, torch.optim.Optimizer):
        raise UsageError(f"{args.optimizer} built a {type(trial).__name__}, not a torch.optim.Optimizer")
    del trial
    if args.threads:
        torch.set_num_threads(args.threads)
    with progress_bar(options.num_iter, "find-lr", "step") as advance:
        try:
            result = lr_range_test(target.model, target.batches, build, target.loss_fn, options, progress=advance)
        except (NoFiniteLossError, TargetError) as exc:  # a target's output is found wrong at its first step
            raise UsageError(str(exc)) from None
    config = {
        "target": target.name,
        "optimizer": args.optimizer,
        "weight_decay": args.weight_decay,
        "start_lr": options.start_lr,
        "end_lr": options.end_lr,
        "num_iter": options.num_iter,
        "smooth_beta": options.smooth_beta,
        "diverge_factor": options.diverge_factor,
        "restore": options.restore,
    }
    report = range_test_report(result, config=config)
    emit(
        report,
        out=args.out,
        stem="find-lr",
        panels=range_test_panels(result),
        plot_title=f"gefen find-lr: {args.optimizer} on {target.name}",
        table=range_test_table(result),
        as_json=args.json,
    )
    return 0

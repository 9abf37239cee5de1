"""The learning-rate range test: an exponential ramp, a smoothed loss and a suggested rate.

The optimizer takes ``num_iter`` steps while its learning rate grows geometrically from
``start_lr`` to ``end_lr`` (every param group keeps its ratio to the first group's rate, so a
composite's children keep theirs). The loss of each step is recorded before the step, at the
rate that step then uses, and smoothed by a bias-corrected exponential moving average
(``smooth_beta``). The test stops early when the loss is not finite or the smoothed loss
exceeds ``diverge_factor`` times the best seen so far (for a loss that can be negative: rises
above the best by ``diverge_factor - 1`` times the best's magnitude).

The suggestion is the centre of the steepest descent of the smoothed loss against
``log(lr)``, measured over windows spanning a factor of 3 in rate and searched only up to
the smoothed minimum; without a descending window it is a tenth of the rate at the minimum.
It is rough: use it to centre a sweep (``gefen bench quality``), not as the answer.

The model's parameters and buffers are snapshot before and restored after (unless
``restore=False``); the optimizer is built for the test and discarded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .target import TargetError

__all__ = ["NoFiniteLossError", "RangeTestOptions", "RangeTestResult", "lr_range_test", "ramp", "suggest_lr"]


class NoFiniteLossError(ValueError):
    """The range test ended before any finite loss (no batches, or a non-finite first loss)."""


OptimizerFactory = Callable[[list[tuple[str, torch.nn.Parameter]], float], torch.optim.Optimizer]
LossFunction = Callable[[torch.nn.Module, object], torch.Tensor]

#: Width of the slope window, as a ratio of learning rates.
WINDOW_RATIO = 3.0


@dataclass(frozen=True, slots=True)
class RangeTestOptions:
    """The ramp and the stopping rule (the reference implementation's defaults)."""

    start_lr: float = 1e-6
    end_lr: float = 1e-1
    num_iter: int = 100
    smooth_beta: float = 0.9
    diverge_factor: float = 5.0
    restore: bool = True

    def __post_init__(self) -> None:
        for name in ("start_lr", "end_lr", "diverge_factor"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RangeTestOptions.{name} must be a positive finite number, got {value!r}")
        if self.end_lr <= self.start_lr:
            raise ValueError(f"RangeTestOptions.end_lr ({self.end_lr}) must exceed start_lr ({self.start_lr})")
        if type(self.num_iter) is not int or self.num_iter < 2:
            raise ValueError(f"RangeTestOptions.num_iter must be an int >= 2, got {self.num_iter!r}")
        if type(self.smooth_beta) not in (int, float) or not 0 <= self.smooth_beta < 1:
            raise ValueError(f"RangeTestOptions.smooth_beta must be in [0, 1), got {self.smooth_beta!r}")
        if self.diverge_factor <= 1:
            raise ValueError(f"RangeTestOptions.diverge_factor must exceed 1, got {self.diverge_factor!r}")
        if type(self.restore) is not bool:
            raise ValueError(f"RangeTestOptions.restore must be a bool, got {self.restore!r}")


@dataclass(frozen=True, slots=True)
class RangeTestResult:
    """The recorded curve, why it stopped, and the suggestion.

    ``lrs[i]`` is the first group's rate of step ``i``, ``losses[i]`` the loss measured before
    that step (possibly not finite at the last step), ``smoothed[i]`` its smoothed value.
    ``stopped`` is ``"completed"``, ``"diverged"``, ``"non-finite loss"`` or ``"out of batches"``.
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    stopped: str
    suggested_lr: float
    min_loss_lr: float
    suggestion_rule: str


def ramp(options: RangeTestOptions) -> list[float]:
    """The ``num_iter`` geometric rates from ``start_lr`` to ``end_lr``."""
    ratio = options.end_lr / options.start_lr
    return [options.start_lr * ratio ** (i / (options.num_iter - 1)) for i in range(options.num_iter)]


def suggest_lr(lrs: Sequence[float], smoothed: Sequence[float]) -> tuple[float, float, str]:
    """``(suggested, rate at the smoothed minimum, rule used)`` for a recorded curve (module docstring)."""
    finite = [i for i, value in enumerate(smoothed) if math.isfinite(value)]
    if not finite:
        raise ValueError("the range test recorded no finite loss")
    minimum = min(finite, key=lambda i: smoothed[i])
    best_slope, centre = 0.0, None
    for i in range(minimum + 1):
        j = next((k for k in range(i + 1, minimum + 1) if lrs[k] >= WINDOW_RATIO * lrs[i]), None)
        if j is None:
            break
        slope = (smoothed[j] - smoothed[i]) / (math.log(lrs[j]) - math.log(lrs[i]))
        if slope < best_slope:
            best_slope, centre = slope, (i + j) // 2
    if centre is None:
        return lrs[minimum] / 10, lrs[minimum], "a tenth of the rate at the smoothed minimum (no descending window)"
    return lrs[centre], lrs[minimum], "the centre of the steepest descent of the smoothed loss over a factor of 3"


def lr_range_test(
    model: torch.nn.Module,
    batches: Iterable[object],
    build_optimizer: OptimizerFactory,
    loss_fn: LossFunction,
    options: RangeTestOptions,
    *,
    progress: Callable[[str], None] | None = None,
) -> RangeTestResult:
    """Run the test (module docstring); ``build_optimizer(named_parameters, lr)`` makes the optimizer."""
    tick = progress or (lambda _label: None)
    snapshot = {key: value.detach().clone() for key, value in model.state_dict().items()}
    rates = ramp(options)
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    stopped = "completed"
    try:
        optimizer = build_optimizer(list(model.named_parameters()), rates[0])
        base = [float(group["lr"]) for group in optimizer.param_groups]
        average, best = 0.0, math.inf
        iterator = iter(batches)
        model.train()
        for step, rate in enumerate(rates):
            try:
                batch = next(iterator)
            except StopIteration:
                stopped = "out of batches"
                break
            for group, group_base in zip(optimizer.param_groups, base):
                group["lr"] = group_base / base[0] * rate if base[0] > 0 else rate
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise TargetError(f"the loss function must return a one-element tensor, got {got}")
            value = float(loss.detach())
            lrs.append(rate)
            losses.append(value)
            if not math.isfinite(value):
                smoothed.append(math.nan)
                stopped = "non-finite loss"
                break
            average = options.smooth_beta * average + (1 - options.smooth_beta) * value
            current = average / (1 - options.smooth_beta ** (step + 1))
            smoothed.append(current)
            best = min(best, current)
            # current > factor * best for positive losses, and a sensible rise for negative ones
            if current - best > (options.diverge_factor - 1) * abs(best):
                stopped = "diverged"
                break
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            tick(f"lr {rate:.2e} loss {current:.4f}")
    finally:
        if options.restore:
            with torch.no_grad():
                model.load_state_dict(snapshot)
    if not any(math.isfinite(value) for value in smoothed):
        why = "the batches ran out before the first step" if not lrs else f"the first loss was {losses[0]}"
        raise NoFiniteLossError(f"the range test recorded no finite loss: {why}")
    suggested, at_minimum, rule = suggest_lr(lrs, smoothed)
    return RangeTestResult(tuple(lrs), tuple(losses), tuple(smoothed), stopped, suggested, at_minimum, rule)

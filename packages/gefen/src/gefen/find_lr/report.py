"""A range test as a ``gefen.bench`` report, a readable summary and a plot."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..bench.plot import Panel, Series
from ..bench.schema import BenchmarkReport, ReportBuilder
from .range_test import RangeTestResult

__all__ = ["range_test_panels", "range_test_report", "range_test_table"]


def range_test_report(result: RangeTestResult, *, config: Mapping[str, Any]) -> BenchmarkReport:
    """Rows: ``lr/suggested`` (with its ratio to ``lr/min-loss``) and one ``loss`` row per step."""
    builder = ReportBuilder("find-lr", config=config)
    builder.add("lr/min-loss", "learning_rate", result.min_loss_lr, "lr")
    builder.add(
        "lr/suggested",
        "learning_rate",
        result.suggested_lr,
        "lr",
        baseline="lr/min-loss",
        detail={"rule": result.suggestion_rule},
    )
    for index, (lr, loss, smooth) in enumerate(zip(result.lrs, result.losses, result.smoothed)):
        if not math.isfinite(loss):
            builder.note(f"step {index} at lr {lr:.3e}: the loss was {loss} and the test stopped")
            continue
        builder.add(f"step-{index:04d}", "loss", loss, "loss", detail={"lr": lr, "smoothed": smooth})
    builder.note(f"stopped: {result.stopped} after {len(result.lrs)} step(s)")
    builder.note(f"suggested lr {result.suggested_lr:.3e}: {result.suggestion_rule}; rough, use it to centre a sweep")
    return builder.build()


def range_test_table(result: RangeTestResult, *, every: int = 10) -> str:
    """The curve every ``every`` steps, the stop reason and the suggestion."""
    lines = [f"{'step':>5}  {'lr':>10}  {'loss':>10}  {'smoothed':>10}", "-" * 41]
    last = len(result.lrs) - 1
    for index, (lr, loss, smooth) in enumerate(zip(result.lrs, result.losses, result.smoothed)):
        if index % every == 0 or index == last:
            lines.append(f"{index:>5}  {lr:>10.3e}  {loss:>10.4f}  {smooth:>10.4f}")
    lines.append("")
    lines.append(f"stopped: {result.stopped} after {len(result.lrs)} step(s)")
    lines.append(f"smoothed loss is lowest at lr {result.min_loss_lr:.3e}")
    lines.append(f"suggested lr: {result.suggested_lr:.3e} ({result.suggestion_rule})")
    return "\n".join(lines)


def range_test_panels(result: RangeTestResult) -> list[Panel]:
    """Loss and smoothed loss against the learning rate (log x), with the suggestion marked."""
    finite = [i for i, loss in enumerate(result.losses) if math.isfinite(loss)]
    lrs = tuple(result.lrs[i] for i in finite)
    low = min((result.smoothed[i] for i in finite), default=0.0)
    high = max((result.smoothed[i] for i in finite), default=1.0)
    return [
        Panel(
            "learning-rate range test",
            "learning rate",
            "loss",
            (
                Series("loss", lrs, tuple(result.losses[i] for i in finite)),
                Series("smoothed", lrs, tuple(result.smoothed[i] for i in finite)),
                Series(f"suggested {result.suggested_lr:.2e}", (result.suggested_lr,) * 2, (low, high)),
            ),
            log_x=True,
        )
    ]

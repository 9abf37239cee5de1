"""The demo's report (shared benchmark schema), its table and its loss plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..bench.plot import Panel, Series
from ..bench.schema import BenchmarkReport, ReportBuilder, render_pivot
from .arm import ArmResult, ArmSpec

__all__ = ["DEMO_METRICS", "build_demo_report", "demo_panels", "demo_table"]

_MIB = 1024.0 * 1024.0

#: Metrics of the demo table, in column order.
DEMO_METRICS = ("test_loss", "tokens_per_s", "state_bytes_per_param", "peak_rss_over_start", "optimizer_step_ms")


def build_demo_report(
    arms: Sequence[ArmResult], *, baseline: str, config: Mapping[str, object], skipped: Mapping[str, str]
) -> BenchmarkReport:
    """Rows per optimizer, with ratios against ``baseline`` (AdamW) when it ran."""
    builder = ReportBuilder("demo", config=dict(config))
    ordered = sorted(arms, key=lambda arm: arm.optimizer != baseline)  # baseline rows first
    has_baseline = any(arm.optimizer == baseline for arm in arms)
    # a diverged arm's losses are inf: no loss row (the schema holds finite numbers), a note
    loss_baseline = any(arm.optimizer == baseline and not arm.diverged for arm in arms)
    for arm in ordered:
        base = baseline if has_baseline and arm.optimizer != baseline else None
        if arm.diverged:
            builder.note(f"{arm.optimizer} diverged at lr {arm.lr:g} (a non-finite loss): no test_loss row")
        else:
            detail = {"lr": arm.lr, "parameters": arm.parameters, "valid_loss": arm.valid_loss}
            loss_base = base if loss_baseline else None
            builder.add(arm.optimizer, "test_loss", arm.test_loss, "nats/token", baseline=loss_base, detail=detail)
        builder.add(arm.optimizer, "tokens_per_s", arm.tokens_per_s, "tokens/s", baseline=base)
        builder.add(
            arm.optimizer,
            "state_bytes_per_param",
            arm.state_bytes / arm.parameters,
            "B/param",
            baseline=base,
            detail={"state_bytes": arm.state_bytes, "by_kind": dict(arm.state_bytes_by_kind)},
        )
        builder.add(
            arm.optimizer,
            "peak_rss_over_start",
            (arm.peak_rss_bytes - arm.start_rss_bytes) / _MIB,
            "MiB",
            baseline=base,
            detail={"peak_rss_mib": arm.peak_rss_bytes / _MIB, "start_rss_mib": arm.start_rss_bytes / _MIB},
        )
        builder.add(arm.optimizer, "optimizer_step_ms", arm.optimizer_step_s * 1e3, "ms", baseline=base)
        builder.add(arm.optimizer, "wall_s", arm.wall_s, "s")
    for name, reason in skipped.items():
        builder.note(f"{name} not run: {reason}")
    builder.note(
        "peak_rss_over_start is the arm's peak resident memory minus its resident memory before the model was built; "
        "each arm ran in a fresh process"
    )
    return builder.build()


def demo_table(report: BenchmarkReport) -> str:
    return render_pivot(report, DEMO_METRICS)


def _smooth(points: Sequence[Sequence[float]], window: int) -> tuple[list[float], list[float]]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    out: list[float] = []
    total = 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return xs, out


def demo_panels(arms: Sequence[ArmResult], spec: ArmSpec) -> list[Panel]:
    """Smoothed training loss and validation loss against steps, one line per optimizer."""
    window = max(1, spec.steps // 50)
    train_series = []
    eval_series = []
    for arm in arms:
        xs, ys = _smooth(arm.train_curve, window)
        train_series.append(Series(arm.optimizer, tuple(xs), tuple(ys)))
        if arm.eval_curve:
            eval_series.append(
                Series(arm.optimizer, tuple(p[0] for p in arm.eval_curve), tuple(p[1] for p in arm.eval_curve))
            )
    panels = [Panel(f"training loss ({window}-step mean)", "step", "nats/token", tuple(train_series))]
    if eval_series:
        panels.append(Panel("validation loss", "step", "nats/token", tuple(eval_series)))
    return panels

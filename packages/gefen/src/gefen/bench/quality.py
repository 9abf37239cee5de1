"""``gefen bench quality``: held-out loss of each optimizer at its own best learning rate.

Protocol, per task and optimizer:

1. train once per learning rate of one shared grid (seed 0) and pick the rate with the
   lowest loss on the ``valid`` split (a diverged run counts as infinitely bad);
2. train at that rate with every seed (seed 0 is reused from the sweep);
3. report the mean loss on the held-out ``test`` split, its spread over seeds, and the best
   learning rate as a ratio to AdamW's, instead of assuming one.

Every run of a task has the same token budget (steps x batch x context), schedule and
seeded initialisation/batch order, so seeds are paired across optimizers.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from ..demo.model import preset
from ..demo.train import TrainConfig
from .optimizers import get_optimizer, unavailable_reason
from .plot import Panel, Series
from .schema import BenchmarkReport, ReportBuilder
from .training_pool import TrainJob, run_jobs

__all__ = [
    "DEFAULT_LR_GRID",
    "DEFAULT_OPTIMIZERS",
    "DEFAULT_TASKS",
    "QUALITY_TASKS",
    "QUALITY_TOLERANCE",
    "OptimizerOutcome",
    "QualityOptions",
    "QualityTask",
    "quality_panels",
    "run_quality",
]

#: Gefen's mean held-out loss should be within this fraction of AdamW's.
QUALITY_TOLERANCE = 0.01


@dataclass(frozen=True, slots=True)
class QualityTask:
    """A model preset trained on one tokenisation of tinylang with a fixed token budget."""

    name: str
    model_size: str
    tokenization: str
    steps: int
    batch_size: int
    eval_windows: int = 512

    def tokens(self) -> int:
        return self.steps * self.batch_size * preset(self.model_size).context


QUALITY_TASKS: Mapping[str, QualityTask] = MappingProxyType(
    {
        task.name: task
        for task in (
            QualityTask("char-mini", "mini", "char", steps=400, batch_size=32),
            QualityTask("word-small", "small", "word", steps=400, batch_size=16),
            QualityTask("char-tiny", "tiny", "char", steps=6, batch_size=4, eval_windows=8),
        )
    }
)
DEFAULT_TASKS = ("char-mini", "word-small")
DEFAULT_OPTIMIZERS = ("adamw", "gefen", "adamw-4bit")
DEFAULT_LR_GRID = (2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2)


@dataclass(frozen=True, slots=True)
class QualityOptions:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    lr_grid: tuple[float, ...] = DEFAULT_LR_GRID
    seeds: int = 3
    weight_decay: float = 0.01
    steps: int | None = None
    baseline: str = "adamw"
    workers: int = field(default_factory=lambda: max(1, min(2, os.cpu_count() or 1)))
    threads: int = 1

    def __post_init__(self) -> None:
        for name in self.tasks:
            if name not in QUALITY_TASKS:
                raise ValueError(f"unknown quality task {name!r}; known: {', '.join(QUALITY_TASKS)}")
        for name in self.optimizers:
            get_optimizer(name)
        if not self.lr_grid or any(not (math.isfinite(lr) and lr > 0) for lr in self.lr_grid):
            raise ValueError(f"lr_grid must hold positive finite learning rates, got {self.lr_grid!r}")
        if type(self.seeds) is not int or self.seeds < 1:
            raise ValueError(f"seeds must be a positive int, got {self.seeds!r}")
        for name in ("workers", "threads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.steps is not None and (type(self.steps) is not int or self.steps <= 0):
            raise ValueError(f"steps must be a positive int or None, got {self.steps!r}")

    def task(self, name: str) -> QualityTask:
        task = QUALITY_TASKS[name]
        if self.steps is None:
            return task
        return QualityTask(
            task.name, task.model_size, task.tokenization, self.steps, task.batch_size, task.eval_windows
        )


@dataclass(frozen=True, slots=True)
class OptimizerOutcome:
    """One optimizer on one task: the sweep on ``valid`` and the seeds at the chosen rate."""

    optimizer: str
    valid_by_lr: Mapping[float, float]
    best_lr: float
    test_by_seed: Mapping[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0

    @property
    def test_mean(self) -> float:
        return statistics.fmean(self.test_by_seed.values())

    @property
    def test_std(self) -> float:
        values = list(self.test_by_seed.values())
        return statistics.stdev(values) if len(values) > 1 else 0.0


def _job(task: QualityTask, optimizer: str, lr: float, seed: int, weight_decay: float) -> TrainJob:
    config = TrainConfig(
        optimizer=optimizer,
        lr=lr,
        steps=task.steps,
        batch_size=task.batch_size,
        seed=seed,
        weight_decay=weight_decay,
        eval_windows=task.eval_windows,
    )
    return TrainJob(task.model_size, task.tokenization, config)


def run_quality(
    options: QualityOptions, *, progress: Callable[[str], None] | None = None
) -> tuple[BenchmarkReport, dict[str, list[OptimizerOutcome]]]:
    """Run every task for every available optimizer; return the report and the raw outcomes.

    Phase 1 runs every learning rate of the grid at seed 0, phase 2 the other seeds at each
    optimizer's chosen rate; the runs of a phase are spread over ``options.workers`` processes.
    """
    tick = progress or (lambda _label: None)
    builder = ReportBuilder(
        "quality",
        config={
            **asdict(options),
            "task_definitions": {
                name: {**asdict(options.task(name)), "tokens": options.task(name).tokens()} for name in options.tasks
            },
            "recipe": "AdamW-style: warm-up 5 %, cosine to 10 %, clip 1.0; LR chosen on valid (seed 0), loss reported on test",
        },
    )
    available = []
    for name in options.optimizers:
        reason = unavailable_reason(name)
        if reason is None:
            available.append(name)
        else:
            builder.note(f"{name} not run: {reason}")
    ordered = sorted(available, key=lambda name: name != options.baseline)
    has_baseline = options.baseline in available
    pairs = [(options.task(task_name), name) for task_name in options.tasks for name in ordered]

    def done(job: TrainJob) -> None:
        tick(f"{job.model_size}/{job.label}")

    sweep_keys = [(task, name, lr) for task, name in pairs for lr in options.lr_grid]
    sweep_jobs = [_job(task, name, lr, 0, options.weight_decay) for task, name, lr in sweep_keys]
    sweep = dict(
        zip(
            [(task.name, name, lr) for task, name, lr in sweep_keys],
            run_jobs(sweep_jobs, workers=options.workers, threads=options.threads, on_done=done),
        )
    )
    best: dict[tuple[str, str], float] = {}
    for task, name in pairs:
        valid = {lr: sweep[(task.name, name, lr)].valid_loss for lr in options.lr_grid}
        best[(task.name, name)] = min(options.lr_grid, key=lambda lr: (valid[lr], lr))
    seed_keys = [(task, name, seed) for task, name in pairs for seed in range(1, options.seeds)]
    seed_jobs = [
        _job(task, name, best[(task.name, name)], seed, options.weight_decay) for task, name, seed in seed_keys
    ]
    seeded = dict(
        zip(
            [(task.name, name, seed) for task, name, seed in seed_keys],
            run_jobs(seed_jobs, workers=options.workers, threads=options.threads, on_done=done),
        )
    )

    outcomes: dict[str, list[OptimizerOutcome]] = {}
    for task, name in pairs:
        best_lr = best[(task.name, name)]
        runs = {0: sweep[(task.name, name, best_lr)]}
        runs.update({seed: seeded[(task.name, name, seed)] for seed in range(1, options.seeds)})
        outcome = OptimizerOutcome(
            optimizer=name,
            valid_by_lr={lr: sweep[(task.name, name, lr)].valid_loss for lr in options.lr_grid},
            best_lr=best_lr,
            test_by_seed={seed: result.test_loss for seed, result in runs.items()},
            tokens_per_s=statistics.fmean(result.tokens_per_s for result in runs.values()),
        )
        outcomes.setdefault(task.name, []).append(outcome)
        _add_rows(builder, task, outcome, options, has_baseline)
        if best_lr in (min(options.lr_grid), max(options.lr_grid)) and len(options.lr_grid) > 1:
            builder.note(f"{task.name}/{name}: best learning rate {best_lr:g} is at the edge of the grid")
    _add_verdicts(builder, outcomes, options)
    if options.workers > 1:
        builder.note(
            f"runs were spread over {options.workers} worker processes ({options.threads} thread(s) each); tokens_per_s is per run"
        )
    return builder.build(), outcomes


def _add_rows(
    builder: ReportBuilder, task: QualityTask, outcome: OptimizerOutcome, options: QualityOptions, has_baseline: bool
) -> None:
    name = f"{task.name}/{outcome.optimizer}"
    base = f"{task.name}/{options.baseline}" if has_baseline and outcome.optimizer != options.baseline else None
    values = [outcome.test_by_seed[seed] for seed in sorted(outcome.test_by_seed)]
    builder.add(
        name,
        "test_loss",
        outcome.test_mean,
        "nats/token",
        baseline=base,
        detail={
            "std": outcome.test_std,
            "min": min(values),
            "max": max(values),
            "per_seed": values,
            "best_lr": outcome.best_lr,
            "valid_by_lr": {
                f"{lr:g}": (loss if math.isfinite(loss) else None) for lr, loss in outcome.valid_by_lr.items()
            },
            "tokens": task.tokens(),
        },
    )
    builder.add(name, "best_lr", outcome.best_lr, "lr", baseline=base)
    builder.add(name, "tokens_per_s", outcome.tokens_per_s, "tokens/s", baseline=base)


def _add_verdicts(
    builder: ReportBuilder, outcomes: Mapping[str, Sequence[OptimizerOutcome]], options: QualityOptions
) -> None:
    for task_name, results in outcomes.items():
        by_name = {outcome.optimizer: outcome for outcome in results}
        adamw = by_name.get(options.baseline)
        gefen = by_name.get("gefen")
        if adamw is None or gefen is None:
            continue
        gap = gefen.test_mean / adamw.test_mean - 1.0
        verdict = "meets" if gap <= QUALITY_TOLERANCE else "misses"
        builder.note(
            f"{task_name}: gefen mean test loss is {gap:+.2%} vs {options.baseline} ({verdict} the {QUALITY_TOLERANCE:.0%} target; "
            f"seed spread {gefen.test_std:.4f} vs {adamw.test_std:.4f})"
        )
        four_bit = by_name.get("adamw-4bit")
        if four_bit is not None:
            relation = "no worse than" if gefen.test_mean <= four_bit.test_mean else "worse than"
            builder.note(
                f"{task_name}: gefen ({gefen.test_mean:.4f}) is {relation} adamw-4bit ({four_bit.test_mean:.4f})"
            )


def quality_panels(report: BenchmarkReport) -> list[Panel]:
    """Per task, validation loss against the learning rate; then test loss relative to the baseline."""
    tasks = list(dict.fromkeys(row.name.split("/", 1)[0] for row in report.rows if row.metric == "test_loss"))
    panels = []
    ratio_series: dict[str, list[float]] = {}
    for task in tasks:
        series = []
        for row in report.rows:
            if row.metric != "test_loss" or not row.name.startswith(task + "/"):
                continue
            sweep = row.detail.get("valid_by_lr")
            assert isinstance(sweep, dict)
            points = sorted((float(lr), float(loss)) for lr, loss in sweep.items() if isinstance(loss, (int, float)))
            if points:
                series.append(
                    Series(row.name.split("/", 1)[1], tuple(p[0] for p in points), tuple(p[1] for p in points))
                )
            ratio_series.setdefault(row.name.split("/", 1)[1], []).append(row.ratio if row.ratio is not None else 1.0)
        panels.append(
            Panel(
                f"{task}: validation loss vs learning rate (seed 0)",
                "peak learning rate",
                "nats/token",
                tuple(series),
                log_x=True,
            )
        )
    if all(len(values) == len(tasks) for values in ratio_series.values()):
        bars = tuple(Series(name, tuple(range(len(tasks))), tuple(values)) for name, values in ratio_series.items())
        panels.append(Panel("mean test loss / baseline", "task", "ratio", bars, kind="bar", categories=tuple(tasks)))
    return panels

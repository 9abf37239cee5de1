"""Orchestration of ``gefen demo``: one fresh process per optimizer, then the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType

from ..bench.optimizers import get_optimizer, unavailable_reason
from ..bench.schema import BenchmarkReport, require_distinct
from .arm import ArmResult, ArmSpec, run_arm
from .model import preset
from .report import build_demo_report

__all__ = ["DEFAULT_LEARNING_RATES", "DemoOptions", "DemoOutcome", "run_demo"]

#: Peak learning rate of each optimizer in the demo: the best of the shared grid for this model
#: size in ``gefen bench quality`` (task word-small), where Gefen, AdamW and 4-bit AdamW all chose
#: 4e-3 (see docs/benchmarks.md).
DEFAULT_LEARNING_RATES: Mapping[str, float] = MappingProxyType(
    {"adamw": 4e-3, "gefen": 4e-3, "gefen-block": 4e-3, "adamw-4bit": 4e-3, "adamw-8bit": 4e-3}
)


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The demo's knobs; the defaults take about two minutes on two CPU cores."""

    optimizers: tuple[str, ...] = ("gefen", "adamw")
    steps: int = 400
    model_size: str = "small"
    tokenization: str = "char"
    batch_size: int = 32
    seed: int = 0
    eval_every: int = 0
    learning_rates: Mapping[str, float] = field(default_factory=dict)
    baseline: str = "adamw"
    threads: int = 0

    def __post_init__(self) -> None:
        if type(self.steps) is not int or self.steps <= 0:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if not self.optimizers:
            raise ValueError("optimizers must name at least one optimizer")
        require_distinct(self.optimizers, "optimizers")
        for name in self.optimizers:
            get_optimizer(name)  # raises on an unknown name
        missing = {name: unavailable_reason(name) for name in self.optimizers}
        if all(reason is not None for reason in missing.values()):
            raise ValueError("no optimizer can run here: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
        preset(self.model_size)
        if self.tokenization not in ("char", "word"):
            raise ValueError(f"tokenization must be 'char' or 'word', got {self.tokenization!r}")
        for name, least in (("batch_size", 1), ("eval_every", 0), ("threads", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        unknown = sorted(set(self.learning_rates) - set(self.optimizers))
        if unknown:
            raise ValueError(f"learning rates given for {unknown}, which are not among the optimizers")

    def lr_of(self, name: str) -> float:
        return float(self.learning_rates.get(name, DEFAULT_LEARNING_RATES.get(name, 4e-3)))


@dataclass(frozen=True, slots=True)
class DemoOutcome:
    report: BenchmarkReport
    arms: tuple[ArmResult, ...]
    spec: ArmSpec


def run_demo(options: DemoOptions) -> DemoOutcome:
    """Train each available optimizer in its own process and build the report."""
    eval_every = options.eval_every or max(1, options.steps // 10)
    template = ArmSpec(
        optimizer="",
        lr=0.0,
        steps=options.steps,
        model_size=options.model_size,
        tokenization=options.tokenization,
        batch_size=options.batch_size,
        seed=options.seed,
        eval_every=eval_every,
        threads=options.threads,
    )
    skipped: dict[str, str] = {}
    arms: list[ArmResult] = []
    for name in options.optimizers:
        reason = unavailable_reason(name)
        if reason is not None:
            skipped[name] = reason
            continue
        arms.append(run_arm(replace(template, optimizer=name, lr=options.lr_of(name))))
    config = {key: value for key, value in asdict(template).items() if key not in ("optimizer", "lr")}
    config["learning_rates"] = {arm.optimizer: arm.lr for arm in arms}
    config["data"] = f"tinylang {options.tokenization}-level, generated (no download)"
    report = build_demo_report(arms, baseline=options.baseline, config=config, skipped=skipped)
    return DemoOutcome(report, tuple(arms), template)

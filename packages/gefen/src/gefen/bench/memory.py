"""``gefen bench memory``: optimizer-state bytes per parameter and the step's transient peak.

For every (model, optimizer) pair a fresh process (:mod:`gefen.bench.memory_probe`) builds
the model, takes ``steps`` optimizer steps on real gradients and reports

* ``state_bytes_per_param``: unique storages reachable from the optimizer after the last
  step (state, attributes, caches; parameters and gradients excluded), over the number of
  parameter elements; AdamW is counted the same way;
* ``step_peak_bytes_per_param``: the largest rise of resident memory during one
  steady-state ``step()`` (steps 2 and later) over the resident size just before it;
* ``first_step_peak_bytes_per_param``: the same for the first step, which also allocates the
  state (and, for Gefen, learns the codebook).

Ratios are against AdamW on the same model in the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from .fresh_process import run_fresh
from .memory_probe import ProbeResult, ProbeSpec
from .optimizers import get_optimizer, unavailable_reason
from .plot import Panel, Series
from .schema import BenchmarkReport, ReportBuilder, require_distinct

__all__ = [
    "DEFAULT_MODELS",
    "DEFAULT_OPTIMIZERS",
    "STATE_TARGET_BYTES_PER_PARAM",
    "MemoryOptions",
    "memory_panels",
    "run_memory",
]

DEFAULT_MODELS = ("small", "decoder-50m")
DEFAULT_OPTIMIZERS = ("adamw", "gefen", "gefen-block", "adamw-4bit", "adamw-8bit")
#: The target for Gefen with default options (the reference measured 1.016 B/param).
STATE_TARGET_BYTES_PER_PARAM = 1.02

# Large blocks are mmapped and returned on free, so a step's scratch buffers show up as resident growth.
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    models: tuple[str, ...] = DEFAULT_MODELS
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    steps: int = 3
    batch_size: int = 2
    sequence_length: int = 64
    baseline: str = "adamw"
    threads: int = 0

    def __post_init__(self) -> None:
        if type(self.steps) is not int or self.steps < 2:
            raise ValueError(
                f"steps must be an int >= 2 (state is counted after at least two steps), got {self.steps!r}"
            )
        if not self.models:
            raise ValueError("models must name at least one model preset")
        from ..demo.model import preset

        require_distinct(self.models, "models")
        require_distinct(self.optimizers, "optimizers")
        for model in self.models:
            preset(model)  # an unknown preset is the options' error, before anything runs
        for name in self.optimizers:
            get_optimizer(name)  # an unknown optimizer too
        if type(self.threads) is not int or self.threads < 0:
            raise ValueError(f"threads must be an int >= 0, got {self.threads!r}")


def run_memory(options: MemoryOptions, *, progress: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Measure every available optimizer on every model and build the report."""
    builder = ReportBuilder("memory", config={**asdict(options), "malloc_env": dict(_MALLOC_ENV)})
    available = []
    for name in options.optimizers:
        reason = unavailable_reason(name)
        if reason is None:
            available.append(name)
        else:
            builder.note(f"{name} not measured: {reason}")
    ordered = sorted(available, key=lambda name: name != options.baseline)
    has_baseline = options.baseline in available
    resettable = True
    for model in options.models:
        for name in ordered:
            spec = ProbeSpec(
                model, name, options.steps, options.batch_size, options.sequence_length, threads=options.threads
            )
            raw = run_fresh(
                "gefen.bench.memory_probe", asdict(spec), env=_MALLOC_ENV, label=f"memory probe {model}/{name}"
            )
            result = ProbeResult(**raw)
            if progress is not None:
                progress(f"{model}/{name}")
            resettable = resettable and result.peak_resettable
            base = f"{model}/{options.baseline}" if has_baseline and name != options.baseline else None
            row_name = f"{model}/{name}"
            params = result.parameters
            builder.add(
                row_name,
                "state_bytes_per_param",
                result.state_bytes / params,
                "B/param",
                baseline=base,
                detail={"state_bytes": result.state_bytes, "parameters": params, "by_kind": result.state_bytes_by_kind},
            )
            steady = max(result.step_transient_bytes[1:])
            builder.add(
                row_name,
                "step_peak_bytes_per_param",
                steady / params,
                "B/param",
                baseline=base,
                detail={
                    "per_step_bytes": result.step_transient_bytes,
                    "resident_before_step_bytes": result.resident_before_step_bytes,
                },
            )
            builder.add(
                row_name,
                "first_step_peak_bytes_per_param",
                result.step_transient_bytes[0] / params,
                "B/param",
                baseline=base,
            )
    if not resettable:
        builder.note("this platform cannot reset the peak resident size; step peaks are upper bounds")
    builder.note(f"target for gefen with default options: state <= {STATE_TARGET_BYTES_PER_PARAM} B/param")
    builder.note(
        "step peaks are resident-set growth during one optimizer.step() in a fresh process (glibc large blocks "
        "mmapped); a 4 KiB page is the resolution, so tiny models read 0"
    )
    return builder.build()


def memory_panels(report: BenchmarkReport) -> list[Panel]:
    """Per metric, one group of bars per model with the optimizers side by side (log scale)."""
    panels = []
    for metric, title in (
        ("state_bytes_per_param", "optimizer state"),
        ("step_peak_bytes_per_param", "steady-state step transient peak"),
    ):
        rows = [row for row in report.rows if row.metric == metric]
        models = tuple(dict.fromkeys(row.name.split("/", 1)[0] for row in rows))
        optimizers = list(dict.fromkeys(row.name.split("/", 1)[1] for row in rows))
        values = {row.name: row.value for row in rows}
        series = tuple(
            Series(optimizer, tuple(range(len(models))), tuple(values.get(f"{m}/{optimizer}", 0.0) for m in models))
            for optimizer in optimizers
        )
        panels.append(Panel(title, "model", "bytes per parameter", series, kind="bar", categories=models))
    return panels

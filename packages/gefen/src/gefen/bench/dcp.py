"""``gefen bench dcp``: save/load seconds and per-rank peak memory of DCP checkpoints vs torch DCP.

For each world size and arm, fresh processes (one per rank, gloo on 127.0.0.1) build the
benchmark's decoder under FSDP2, take two optimizer steps and measure two synchronous
``dcp.save`` calls (``first_save``, which also pays the process's one-time costs of a first
call, lazy imports and caches; then ``save``, what every later checkpoint costs), a
``dcp.async_save`` (until the write completed) and a ``dcp.load`` into a fresh model and
optimizer (:mod:`gefen.bench.dcp_worker`). Reported per operation: the
slowest rank's seconds, and the peak resident growth above the resident size just before
the operation on the worst rank, per parameter element that rank holds (the rank's local
shard: ``to_local().numel()`` summed over its parameters). The checkpoint modules are
imported before measuring, as a training script imports them; their one-time resident cost
is reported separately.

An arm ``recipe:<arm>`` saves ``<arm>``'s optimizer through torch's recipe, exactly as the
baseline does: any optimizer whose state dict DCP can shard. Any other arm saves its
optimizer through :class:`gefen_dcp.GefenDCPState` and must claim ``parameter_shaped_state`` (an
arm whose contract does not is skipped with the contract's reason). Default arms:
``recipe:gefen``, ``gefen`` (``GefenDCPState``) and gefen-dcp's reference codec ``int8-sgd``
(``gefen_dcp.testing.Int8MomentumSGD``, about 1 B/param). The baseline ``torch-dcp-adamw``
is ``torch.optim.AdamW`` through ``get_state_dict`` / ``set_state_dict`` with DCP's stock
planner and writer; ratios are against it at the same world size, measured in the same run.
Besides seconds and peaks, ``disk_bytes_per_param`` is the synchronous checkpoint's size on
disk over the model's parameter count. With ``flatten``, every recipe arm and the baseline pass
``StateDictOptions(flatten_optimizer_state_dict=True)``, as torchtitan's and OLMo-core's
checkpointers do: torch then repeats every group option under each parameter's FQN.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gefen_contracts import FEATURE_PARAMETER_SHAPED_STATE

from .checkpoint_arms import build_status, check_arm, check_ranks, claim_status
from .dcp_worker import RECIPE_PREFIX, TORCH_ARM, through_torch_recipe
from .model_sizes import bench_decoder
from .plot import Panel, Series
from .rank_processes import MALLOC_ENV, run_ranks
from .schema import BenchmarkReport, ReportBuilder, require_distinct

__all__ = ["DEFAULT_ARMS", "OPERATIONS", "TORCH_ARM", "DcpOptions", "dcp_panels", "run_dcp"]

DEFAULT_ARMS = ("recipe:gefen", "gefen", "int8-sgd")
OPERATIONS = ("first_save", "save", "async_save", "load")


@dataclass(frozen=True, slots=True)
class DcpOptions:
    """Model (a preset or ``<N>m``), world sizes, arms and the training batch of the workers."""

    model: str = "decoder-50m"
    ranks: tuple[int, ...] = (1, 2, 3)
    arms: tuple[str, ...] = DEFAULT_ARMS
    threads: int = 1
    batch_size: int = 2
    sequence_length: int = 64
    with_model: bool = False
    flatten: bool = False

    def __post_init__(self) -> None:
        bench_decoder(self.model)  # raises on an unknown model
        check_ranks(self.ranks, "DcpOptions.ranks")
        require_distinct(self.ranks, "DcpOptions.ranks")
        require_distinct(self.arms, "DcpOptions.arms")
        if not self.arms or TORCH_ARM in self.arms:
            raise ValueError(f"DcpOptions.arms must name at least one arm besides the baseline {TORCH_ARM!r}")
        for arm in self.arms:
            check_arm(arm.removeprefix(RECIPE_PREFIX))
        for name in ("threads", "batch_size", "sequence_length"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"DcpOptions.{name} must be a positive int, got {value!r}")


def run_dcp(options: DcpOptions, *, progress: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Run every claiming arm on every world size; return the report (module docstring)."""
    tick = progress or (lambda _label: None)
    config = bench_decoder(options.model)
    builder = ReportBuilder(
        "dcp", config={**asdict(options), "parameters": config.parameter_count(), "malloc_env": dict(MALLOC_ENV)}
    )
    arms = []
    for arm in options.arms:
        if through_torch_recipe(arm):  # torch's recipe takes any optimizer that can be built
            reason = build_status(arm.removeprefix(RECIPE_PREFIX))
        else:
            reason = claim_status(arm, FEATURE_PARAMETER_SHAPED_STATE)
        if reason is None:
            arms.append(arm)
        else:
            builder.note(f"{arm}: not measured: {reason}")
    with tempfile.TemporaryDirectory(prefix="gefen-bench-dcp-") as root:
        for world_size in options.ranks:
            for arm in (TORCH_ARM, *arms):
                spec = {**asdict(options), "arm": arm, "root": root}
                results = run_ranks(
                    "gefen.bench.dcp_worker", spec, world_size, threads=options.threads, label=f"dcp {arm}"
                )
                tick(f"{world_size} ranks / {arm}")
                _add_rows(builder, options.model, world_size, arm, results, config.parameter_count())
    builder.note(
        "peak = resident-set high-water mark (or 1 ms samples) above the resident size just before the operation, "
        "on the worst rank, per parameter element held by that rank; seconds = the slowest rank"
    )
    builder.note(
        "the checkpoint modules (torch.distributed.checkpoint, and gefen_dcp for Gefen arms) are imported before "
        "the operations, as a training script imports them at its top; their one-time resident cost is in "
        "detail.per_rank_checkpoint_import_bytes, not in the peaks"
    )
    builder.note(
        "first_save is the process's first dcp.save (with the one-time costs of a first call: lazy imports, "
        "caches); save is the second, what every later checkpoint of a training run costs"
    )
    builder.note("async_save is measured from the call until the write completed")
    builder.note("load goes into a freshly built model and optimizer, so its peak includes the state it allocates")
    builder.note(
        "checkpoints hold the optimizer only unless config.with_model (then DCP also stages the model for async "
        "saves: 4 B/param of fp32 parameters in either arm)"
    )
    return builder.build()


def _add_rows(
    builder: ReportBuilder, model: str, world_size: int, arm: str, results: Sequence[dict[str, Any]], parameters: int
) -> None:
    name = f"{model}/{world_size}ranks/{arm}"
    base = None if arm == TORCH_ARM else f"{model}/{world_size}ranks/{TORCH_ARM}"
    builder.add(name, "disk_bytes_per_param", results[0]["disk_bytes"] / max(1, parameters), "B/param", baseline=base)
    for operation in OPERATIONS:
        worst = max(results, key=lambda r: r[operation]["peak_extra_bytes"] / max(1, r["local_parameters"]))
        detail = {
            "per_rank_peak_extra_bytes": [r[operation]["peak_extra_bytes"] for r in results],
            "per_rank_seconds": [r[operation]["seconds"] for r in results],
            "per_rank_local_parameters": [r["local_parameters"] for r in results],
            "per_rank_resident_before_bytes": [r["resident_bytes"] for r in results],
            "per_rank_checkpoint_import_bytes": [r.get("checkpoint_import_bytes") for r in results],
            "exact_peak": all(r[operation]["exact_peak"] for r in results),
        }
        builder.add(
            name,
            f"{operation}_seconds",
            max(r[operation]["seconds"] for r in results),
            "s",
            baseline=base,
            detail=detail,
        )
        builder.add(
            name,
            f"{operation}_peak_bytes_per_param",
            worst[operation]["peak_extra_bytes"] / max(1, worst["local_parameters"]),
            "B/param",
            baseline=base,
        )


def dcp_panels(report: BenchmarkReport) -> list[Panel]:
    """Per operation and metric: groups of bars by world size, one bar per arm."""
    panels = []
    for operation in OPERATIONS:
        for metric, unit in ((f"{operation}_peak_bytes_per_param", "B/param"), (f"{operation}_seconds", "s")):
            rows = [row for row in report.rows if row.metric == metric]
            if not rows:
                continue
            worlds = tuple(dict.fromkeys(row.name.split("/")[1] for row in rows))
            arms = tuple(dict.fromkeys(row.name.split("/", 2)[2] for row in rows))
            values = {(row.name.split("/")[1], row.name.split("/", 2)[2]): row.value for row in rows}
            series = tuple(
                Series(arm, tuple(range(len(worlds))), tuple(values.get((w, arm), 0.0) for w in worlds)) for arm in arms
            )
            panels.append(Panel(metric, "world size", unit, series, kind="bar", categories=worlds))
    return panels

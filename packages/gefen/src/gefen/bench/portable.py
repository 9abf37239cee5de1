"""``gefen bench portable``: export and import of portable optimizer state vs torch's state-dict API.

For each model size (10M to 100M parameters by default), world size (1 to 3) and arm, fresh
processes (one per rank, gloo on 127.0.0.1) build the model, take one step and measure, in
memory and through DCP storage alike, an export and an import into a fresh optimizer
(:mod:`gefen.bench.portable_worker`). Reported per operation: the slowest rank's seconds and
the worst rank's peak resident growth (sampled every millisecond, and the kernel's
high-water mark where Linux offers it) per parameter element that rank holds. Per arm and
world size also: ``export_bytes_per_param``, the tensor bytes of the in-memory export summed
over the ranks (a ``PortableState``'s fragments; torch's local state-dict shards), and
``disk_bytes_per_param``, the storage checkpoint's size on disk, both over the model's
parameter count.

The baseline is ``torch.optim.AdamW`` under FSDP2 through ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (and ``dcp.save`` / ``dcp.load``), measured in the same run at the
same size and world size. Arms are optimizer names (``gefen``, ``contracted-adamw``, any name
of :mod:`gefen.bench.optimizers`) or ``MODULE:FACTORY``; an arm is measured when its
contract claims ``portable_state`` (and, on more than one rank, ``post_sharding``), and is
otherwise skipped with a note quoting its contract's reason. On more than one rank an arm is
finalized by ``post_sharding`` onto flattened element shards over the ranks (with a codebook
scope over them when it claims ``collective_scope``, as Gefen does) and goes through
gefen-portable and gefen-dcp's portable checkpoint, never GefenDCPState; imports go
onto the same layout. Each row's ``detail`` names the layout the arm held.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gefen_contracts import FEATURE_PORTABLE_STATE, FEATURE_POST_SHARDING

from .checkpoint_arms import check_arm, check_ranks, claim_status
from .model_sizes import bench_decoder
from .plot import Panel, Series
from .portable_worker import OPERATIONS, TORCH_ARM
from .rank_processes import MALLOC_ENV, run_ranks
from .schema import BenchmarkReport, ReportBuilder, require_distinct

__all__ = ["DEFAULT_ARMS", "OPERATIONS", "TORCH_ARM", "PortableOptions", "portable_panels", "run_portable"]

DEFAULT_ARMS = ("gefen", "contracted-adamw")


@dataclass(frozen=True, slots=True)
class PortableOptions:
    """Model sizes (presets or ``<N>m``), world sizes, arms and the workers' batch."""

    models: tuple[str, ...] = ("10m", "50m", "100m")
    ranks: tuple[int, ...] = (1, 2, 3)
    arms: tuple[str, ...] = DEFAULT_ARMS
    threads: int = 1
    batch_size: int = 1
    sequence_length: int = 16

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("PortableOptions.models must name at least one model")
        for model in self.models:
            bench_decoder(model)  # raises on an unknown model
        check_ranks(self.ranks, "PortableOptions.ranks")
        require_distinct(self.models, "PortableOptions.models")
        require_distinct(self.ranks, "PortableOptions.ranks")
        require_distinct(self.arms, "PortableOptions.arms")
        if not self.arms or TORCH_ARM in self.arms:
            raise ValueError(f"PortableOptions.arms must name at least one arm besides the baseline {TORCH_ARM!r}")
        for arm in self.arms:
            check_arm(arm)
        for name in ("threads", "batch_size", "sequence_length"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"PortableOptions.{name} must be a positive int, got {value!r}")


def _available(arm: str, needs_sharding: bool) -> str | None:
    reason = claim_status(arm, FEATURE_PORTABLE_STATE)
    if reason is None and needs_sharding:
        reason = claim_status(arm, FEATURE_POST_SHARDING)
    return reason


def run_portable(options: PortableOptions, *, progress: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Run every available arm on every size and world size (module docstring)."""
    tick = progress or (lambda _label: None)
    builder = ReportBuilder(
        "portable",
        config={
            **asdict(options),
            "parameters": {model: bench_decoder(model).parameter_count() for model in options.models},
            "malloc_env": dict(MALLOC_ENV),
        },
    )
    skipped: dict[tuple[str, bool], str | None] = {}
    with tempfile.TemporaryDirectory(prefix="gefen-bench-portable-") as root:
        for model in options.models:
            for world_size in options.ranks:
                for arm in (TORCH_ARM, *options.arms):
                    if arm != TORCH_ARM:
                        key = (arm, world_size > 1)
                        if key not in skipped:
                            skipped[key] = _available(arm, world_size > 1)
                        if skipped[key] is not None:
                            continue
                    spec = {**asdict(options), "model": model, "arm": arm, "root": root}
                    results = run_ranks(
                        "gefen.bench.portable_worker",
                        spec,
                        world_size,
                        threads=options.threads,
                        label=f"portable {arm}",
                    )
                    tick(f"{model} / {world_size} ranks / {arm}")
                    _add_rows(builder, model, world_size, arm, results, bench_decoder(model).parameter_count())
    for (arm, sharded), reason in sorted(skipped.items()):
        if reason is not None:
            where = "on more than one rank" if sharded else "on one rank"
            builder.note(f"{arm}: not measured {where}: {reason}")
    builder.note(
        f"{TORCH_ARM}: torch.optim.AdamW under FSDP2 fully_shard (dim-0 DTensor shards on more than one rank) "
        "through get_optimizer_state_dict / set_optimizer_state_dict, and dcp.save / dcp.load of that state dict"
    )
    builder.note(
        "other arms: whole parameters on one rank; on more than one rank finalized by post_sharding onto flattened "
        "element shards (near-even contiguous slices of every flattened parameter), with a codebook scope over the "
        "ranks when the contract claims collective_scope (Gefen); export_portable_state / import_portable_state in "
        "memory (each rank its own fragments), save_portable_dcp / load_portable_dcp through storage; imports go onto "
        "the same layout"
    )
    builder.note(
        "peak = resident growth above the resident size just before the operation (1 ms samples and the kernel's "
        "high-water mark), on the worst rank, per parameter element that rank holds; seconds = the slowest rank"
    )
    builder.note(
        "memory_export keeps the exported state until memory_import has read it; imports go into a fresh optimizer "
        "built (and bound) before the measured region, so their peak includes the state they allocate but not the "
        "parameters; storage goes through DCP on local disk"
    )
    return builder.build()


def _add_rows(
    builder: ReportBuilder, model: str, world_size: int, arm: str, results: Sequence[dict[str, Any]], parameters: int
) -> None:
    name = f"{model}/{world_size}ranks/{arm}"
    base = None if arm == TORCH_ARM else f"{model}/{world_size}ranks/{TORCH_ARM}"
    exported = sum(r["export_bytes"] for r in results)
    builder.add(name, "export_bytes_per_param", exported / max(1, parameters), "B/param", baseline=base)
    builder.add(name, "disk_bytes_per_param", results[0]["disk_bytes"] / max(1, parameters), "B/param", baseline=base)
    for operation in OPERATIONS:
        worst = max(results, key=lambda r: r[operation]["peak_extra_bytes"] / max(1, r["local_parameters"]))
        builder.add(
            name,
            f"{operation}_seconds",
            max(r[operation]["seconds"] for r in results),
            "s",
            baseline=base,
            detail={
                "per_rank_seconds": [r[operation]["seconds"] for r in results],
                "per_rank_peak_extra_bytes": [r[operation]["peak_extra_bytes"] for r in results],
                "per_rank_local_parameters": [r["local_parameters"] for r in results],
                "layout": results[0]["layout"],
                "exact_peak": all(r[operation]["exact_peak"] for r in results),
            },
        )
        builder.add(
            name,
            f"{operation}_peak_bytes_per_param",
            worst[operation]["peak_extra_bytes"] / max(1, worst["local_parameters"]),
            "B/param",
            baseline=base,
        )


def portable_panels(report: BenchmarkReport) -> list[Panel]:
    """Per operation: peak bytes/param and seconds against the model size, one line per arm and world size."""
    panels = []
    recorded = report.config.get("parameters")
    sizes = {str(k): v for k, v in recorded.items()} if isinstance(recorded, dict) else {}
    for operation in OPERATIONS:
        for metric, unit in ((f"{operation}_peak_bytes_per_param", "B/param"), (f"{operation}_seconds", "s")):
            rows = [row for row in report.rows if row.metric == metric]
            if not rows:
                continue
            lines: dict[str, list[tuple[float, float]]] = {}
            for row in rows:
                model, world, arm = row.name.split("/", 2)
                size = sizes.get(model)
                x = float(size) / 1e6 if isinstance(size, (int, float)) else 0.0
                lines.setdefault(f"{arm} ({world})", []).append((x, row.value))
            series = tuple(
                Series(label, tuple(x for x, _ in sorted(points)), tuple(y for _, y in sorted(points)))
                for label, points in lines.items()
            )
            panels.append(Panel(metric, "parameters (millions)", unit, series))
    return panels

"""``gefen bench guard``: the cost of the sealed-layout guard after ``post_sharding``.

After ``post_sharding`` every ``step()`` verifies the optimizer's owned, immutable
``SealedLayout`` against its public containers (group ``params`` lists by identity, names,
state keys): once in the step's preflight and once more before a closure. For many small
parameter tensors this measures one guard pass in µs per parameter tensor (timed through
``shard_bindings()``, which verifies and returns a tuple) and its share of the step it
protects, against baselines measured in the same run: the same optimizer unbound, and
torch's AdamW. A composite verifies each child twice per step (its preflight, then the
child's step), so its row is twice the sum of its children's passes. Timings are medians of
interleaved samples.

Arms: ``ContractedAdamW`` and a composite of two, always; ``Gefen`` once its contract
claims ``post_sharding`` (until then a note quotes the contract's reason). Once Gefen claims
``collective_scope``, two gloo ranks bind a codebook scope and count the collectives of a
steady-state scoped step against the optimizer's declared ``collective_budget()``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from gefen_contracts import FEATURE_COLLECTIVE_SCOPE, FEATURE_POST_SHARDING
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.protocols import ContractProvider
from gefen_contracts.testing import replicated_copy_plan

from .plot import Panel, Series
from .schema import BenchmarkReport, ReportBuilder

__all__ = ["GuardOptions", "guard_panels", "run_guard", "scoped_step_collectives"]

NamedParameters = list[tuple[str, torch.nn.Parameter]]


@dataclass(frozen=True, slots=True)
class GuardOptions:
    """``tensors`` parameters of ``numel`` elements; ``steps`` calls per sample, ``repeats`` samples."""

    tensors: int = 500
    numel: int = 64
    steps: int = 20
    repeats: int = 5
    threads: int = 1
    scoped_ranks: int = 2

    def __post_init__(self) -> None:
        for name in ("tensors", "numel", "steps", "repeats", "threads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"GuardOptions.{name} must be a positive int, got {value!r}")
        if type(self.scoped_ranks) is not int or self.scoped_ranks < 2:
            raise ValueError(f"GuardOptions.scoped_ranks must be an int >= 2, got {self.scoped_ranks!r}")


def _named(tensors: int, numel: int, seed: int = 0) -> NamedParameters:
    """Alternating small matrices and vectors, each with a gradient."""
    generator = torch.Generator().manual_seed(seed)
    named = []
    for index in range(tensors):
        shape = (8, numel // 8) if index % 2 == 0 and numel % 8 == 0 else (numel,)
        parameter = torch.nn.Parameter(torch.randn(shape, generator=generator))
        parameter.grad = torch.randn(shape, generator=generator)
        named.append((f"blocks.{index}.weight", parameter))
    return named


def _bind(optimizer: Any, named: NamedParameters, scope: object = None) -> None:
    """``post_sharding`` onto the same tensors (ungrouped ``REPLICATED`` identity)."""
    plan = replicated_copy_plan(named)
    rebindings = [type(r)(r.old_parameter, r.old_parameter, r.shard) for r in plan.rebindings]
    grads = {name: p.grad for name, p in named}
    for _, p in named:
        p.grad = None  # post_sharding refuses tensors that carry gradients
    optimizer.post_sharding(rebindings, manifest=plan.manifest, scope=scope)
    for name, p in named:
        p.grad = grads[name]


def _interleaved_us(calls: dict[str, tuple[Callable[[], object], int]], repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of the mean wall time of one call of each entry, in µs."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (call, count) in calls.items():
            start = time.perf_counter()
            for _ in range(count):
                call()
            samples[name].append((time.perf_counter() - start) / count * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def _claims(optimizer: object, feature: str) -> str | None:
    """``None`` when ``optimizer``'s contract supports ``feature``, else the contract's reasons."""
    if not isinstance(optimizer, ContractProvider):
        return "the optimizer publishes no contract"
    status = optimizer.optimizer_contract().capabilities.feature(feature)
    return None if status.supported else "; ".join(status.reasons) or "unsupported"


def _gefen(named: NamedParameters) -> torch.optim.Optimizer:
    from gefen_core import Gefen

    return Gefen(named, lr=1e-3, fused=None)


def _contracted_adamw(named: NamedParameters) -> torch.optim.Optimizer:
    from gefen_hybrid import ContractedAdamW

    return ContractedAdamW(named, lr=1e-3)


def _composite(named: NamedParameters) -> torch.optim.Optimizer:
    from gefen_hybrid import CompositeOptimizer, ContractedAdamW

    return CompositeOptimizer.from_factories(
        named, {"muon": lambda n: ContractedAdamW(n, lr=1e-3), "backup": lambda n: ContractedAdamW(n, lr=1e-3)}
    )


def _measure_single(
    builder: ReportBuilder,
    label: str,
    factory: Callable[[NamedParameters], torch.optim.Optimizer],
    options: GuardOptions,
    torch_step: Callable[[], object] | None,
) -> None:
    """Rows for one optimizer kind; with ``torch_step`` torch's AdamW is timed in the same samples."""
    torch_row = "torch-adamw/step"
    unbound = factory(_named(options.tensors, options.numel))
    bound_named = _named(options.tensors, options.numel)
    bound = factory(bound_named)
    _bind(bound, bound_named)
    for optimizer in (unbound, bound):
        optimizer.step()  # create the state first: the guard then also walks every state key
    passes = max(options.steps * 10, 50)
    calls: dict[str, tuple[Callable[[], object], int]] = {
        "unbound": (unbound.step, options.steps),
        "bound": (bound.step, options.steps),
        "guard": (bound.shard_bindings, passes),  # type: ignore[attr-defined]
    }
    if torch_step is not None:
        calls["torch"] = (torch_step, options.steps)
    timed = _interleaved_us(calls, options.repeats)
    if torch_step is not None:
        builder.add(torch_row, "step_time", timed["torch"], "us")
    builder.add(f"{label}/step-unbound", "step_time", timed["unbound"], "us", baseline=torch_row)
    builder.add(f"{label}/step-bound", "step_time", timed["bound"], "us", baseline=f"{label}/step-unbound")
    builder.add(f"{label}/guard-pass", "time_per_tensor", timed["guard"] / options.tensors, "us/tensor")
    builder.add(f"{label}/guard-per-step", "step_time", timed["guard"], "us", baseline=f"{label}/step-bound")
    builder.add(
        f"{label}/guard-per-step-with-closure", "step_time", 2 * timed["guard"], "us", baseline=f"{label}/step-bound"
    )
    if timed["bound"] > 0:
        builder.note(
            f"{label}: guard {timed['guard'] / options.tensors:.3f} µs per parameter tensor per pass; "
            f"{100 * timed['guard'] / timed['bound']:.2f} % of a bound step (one pass; two with a closure)"
        )


def _measure_composite(builder: ReportBuilder, options: GuardOptions) -> None:
    unbound = _composite(_named(options.tensors, options.numel))
    bound_named = _named(options.tensors, options.numel)
    bound = _composite(bound_named)
    _bind(bound, bound_named)
    unbound.step()
    bound.step()
    passes = max(options.steps * 10, 50)
    children = bound.child_optimizers()  # type: ignore[attr-defined]
    entries: dict[str, tuple[Callable[[], object], int]] = {
        "unbound": (unbound.step, options.steps),
        "bound": (bound.step, options.steps),
    }
    for role, child in children.items():
        entries[role] = (child.shard_bindings, passes)
    timed = _interleaved_us(entries, options.repeats)
    guard = sum(timed[role] for role in children)
    builder.add("composite/step-unbound", "step_time", timed["unbound"], "us")
    builder.add("composite/step-bound", "step_time", timed["bound"], "us", baseline="composite/step-unbound")
    builder.add("composite/guard-per-step", "step_time", 2 * guard, "us", baseline="composite/step-bound")


def _scoped_rebindings(named: NamedParameters, group: ProcessGroupIdentity, rank: int) -> tuple[list[Any], Any]:
    """Replicated shards of every parameter on every member of ``group`` (the manifest names the
    group, as a codebook scope requires), and this rank's rebindings onto the same tensors."""
    from gefen_contracts.enums import ParameterLayout, PlacementKind
    from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity, ShardPlacement
    from gefen_contracts.manifest import ShardingManifest
    from gefen_contracts.rebinding import ParameterRebinding

    members = group.ordered_members
    rebindings, shards = [], []
    for name, parameter in named:
        identity = ParameterIdentity(name, tuple(parameter.shape))
        for member in range(len(members)):
            placement = ShardPlacement(group.semantic_name, PlacementKind.REPLICATE, member, len(members))
            shard = ShardIdentity(
                identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity), (placement,), group, members[member]
            )
            shards.append(shard)
            if member == rank:
                rebindings.append(ParameterRebinding(parameter, parameter, shard))
    return rebindings, ShardingManifest(tuple(shards))


def scoped_step_collectives(rank: int, world_size: int, tensors: int, numel: int) -> dict[str, int]:
    """Rank function (for :class:`gefen_contracts.testing.GlooWorld`): Gefen bound with a
    codebook scope over the world; the collectives of each scoped operation and the budget."""
    import torch.distributed as dist
    from gefen_contracts.torch_support import CodebookProcessGroupBinding, CollectiveCounter

    torch.set_num_threads(1)
    named = _named(tensors, numel)  # the same seed on every rank: replicated parameters
    optimizer: Any = _gefen(named)
    identity = ProcessGroupIdentity("bench.codebook", tuple(f"rank:{r}" for r in range(world_size)))
    scope = CodebookProcessGroupBinding(identity, f"rank:{rank}", dist.group.WORLD, torch.device("cpu"))
    grads = {name: p.grad for name, p in named}
    for _, p in named:
        p.grad = None  # post_sharding refuses tensors that carry gradients
    rebindings, manifest = _scoped_rebindings(named, identity, rank)
    optimizer.post_sharding(rebindings, manifest=manifest, scope=scope)

    def counted(action: Callable[[], object]) -> int:
        for name, parameter in named:
            parameter.grad = grads[name].clone()  # type: ignore[union-attr]
        counter = CollectiveCounter()
        with counter.patched():
            action()
        return counter.total

    return {
        "learning-step": counted(optimizer.step),  # first gradient: learns the codebook over the scope
        "collectives": counted(optimizer.step),
        "with-closure": counted(lambda: optimizer.step(lambda: None)),
        "refresh": counted(optimizer.refresh_collective_state),
        "budget": int(optimizer.collective_budget()),
    }


def _measure_scoped(builder: ReportBuilder, options: GuardOptions) -> None:
    from gefen_contracts.testing import GlooWorld

    with GlooWorld(options.scoped_ranks) as world:
        results = world.run("gefen.bench.guard:scoped_step_collectives", min(options.tensors, 64), options.numel)
    worst = max(results, key=lambda r: r["collectives"])
    budget = worst["budget"]
    # the contract's promised ceiling, not a measurement (the counted row below is one)
    builder.add(
        "gefen/scoped-step-budget",
        "collectives_per_step",
        float(budget),
        "calls",
        detail={"kind": "collective_budget()"},
    )
    builder.add(
        "gefen/scoped-step-counted",
        "collectives_per_step",
        float(worst["collectives"]),
        "calls",
        baseline="gefen/scoped-step-budget",
        detail={"per_rank": [r["collectives"] for r in results], "ranks": options.scoped_ranks},
    )
    for operation in ("with-closure", "learning-step", "refresh"):
        builder.add(
            f"gefen/scoped-{operation}-counted",
            "collectives",
            float(max(r[operation] for r in results)),
            "calls",
            detail={"per_rank": [r[operation] for r in results]},
        )
    builder.note(
        f"gefen scoped collectives on {options.scoped_ranks} gloo ranks: steady step {worst['collectives']}, "
        f"with a closure {worst['with-closure']}, learning step {worst['learning-step']}, "
        f"refresh_collective_state {worst['refresh']} (budget {budget} per steady step)"
    )


def run_guard(options: GuardOptions, *, progress: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Measure every arm that can run here and return the report (module docstring)."""
    tick = progress or (lambda _label: None)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        builder = ReportBuilder("guard", config=asdict(options))
        torch_named = _named(options.tensors, options.numel)
        torch_adamw = torch.optim.AdamW([p for _, p in torch_named], lr=1e-3)
        torch_adamw.step()
        _measure_single(builder, "contracted-adamw", _contracted_adamw, options, torch_adamw.step)
        tick("contracted-adamw")
        _measure_composite(builder, options)
        tick("composite")
        probe = _gefen(_named(2, 16))
        reason = _claims(probe, FEATURE_POST_SHARDING)
        if reason is None:
            _measure_single(builder, "gefen", _gefen, options, None)
        else:
            builder.note(f"gefen: guard not measured: its contract does not claim post_sharding ({reason})")
        tick("gefen")
        reason = _claims(probe, FEATURE_COLLECTIVE_SCOPE)
        if reason is None:
            _measure_scoped(builder, options)
        else:
            builder.note(
                f"gefen: scoped step collectives not counted: its contract does not claim collective_scope ({reason})"
            )
        tick("scoped step")
        builder.note(
            "median of interleaved samples; guard = one SealedLayout verification (timed through shard_bindings()); "
            "a step verifies once, twice with a closure; a composite twice per child"
        )
        return builder.build()
    finally:
        torch.set_num_threads(previous_threads)


def guard_panels(report: BenchmarkReport) -> list[Panel]:
    """The guard's share of each bound step (bars) and µs per tensor per pass."""
    shares = [row for row in report.rows if row.name.endswith(("guard-per-step", "guard-per-step-with-closure"))]
    per_tensor = [row for row in report.rows if row.metric == "time_per_tensor"]
    panels = []
    if shares:
        series = tuple(Series(row.name, (0.0,), (100.0 * (row.ratio or 0.0),)) for row in shares)
        panels.append(Panel("guard share of a bound step", "", "% of step", series, kind="bar"))
    if per_tensor:
        series = tuple(Series(row.name, (0.0,), (row.value,)) for row in per_tensor)
        panels.append(Panel("one guard pass", "", "µs per parameter tensor", series, kind="bar"))
    return panels

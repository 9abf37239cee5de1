"""Measure the sealed-layout guard of ``post_sharding`` on ContractedAdamW, a composite and Gefen,
and count the host-synchronising collectives of Gefen's codebook-scope protocol.

After ``post_sharding`` every ``step()`` verifies the owned, immutable ``SealedLayout``
against the public containers (group ``params`` lists by identity, names, state keys): once
in ``preflight_step`` and once more before a closure. This prints, for many small parameter
tensors, the cost of one guard pass in µs per parameter tensor, and its share of the step it
protects (baselines measured in this run: the same optimizer unbound, and torch's AdamW).
One guard pass is timed through ``shard_bindings()``, which verifies and returns a tuple.
The composite verifies each child twice per step (its preflight, then the child's step), so
its row is twice the sum of its children's passes. Gefen's rows count the guard passes of one
bound step (without and with a closure) by wrapping its ``_verify_layout`` and compare them
with its reference-path step (``fused=False``) and, when a kernel provider serves it, its fused
step. The collective rows run Gefen under a 2-member codebook scope in gloo processes and
count the collectives of each operation by wrapping ``torch.distributed``
(``CollectiveCounter``); the steady step's budget is 2.

Prints a table and writes JSON in the ``gefen.bench`` row shape (name / metric / value /
unit / baseline / ratio / detail).

    uv run python tools/bench_guard.py [--tensors 500] [--numel 64] [--steps 20] [--repeats 5] [--json guard.json]
                                       [--collective-ranks 2]  (0 skips the gloo run)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gefen_contracts.testing import replicated_copy_plan
from gefen_core import Gefen
from gefen_hybrid import CompositeOptimizer, ContractedAdamW


def _named(tensors: int, numel: int, seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(seed)
    named = []
    for index in range(tensors):
        shape = (8, numel // 8) if index % 2 == 0 and numel % 8 == 0 else (numel,)  # matrices and vectors
        parameter = torch.nn.Parameter(torch.randn(shape, generator=generator))
        parameter.grad = torch.randn(shape, generator=generator)
        named.append((f"blocks.{index}.weight", parameter))
    return named


def _bind(optimizer: Any, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    plan = replicated_copy_plan(named)
    rebindings = [type(r)(r.old_parameter, r.old_parameter, r.shard) for r in plan.rebindings]  # identity only
    grads = {name: p.grad for name, p in named}
    for _, p in named:
        p.grad = None  # post_sharding refuses tensors that carry gradients
    optimizer.post_sharding(rebindings, manifest=plan.manifest)
    for name, p in named:
        p.grad = grads[name]


def _interleaved_us(calls: dict[str, tuple[Callable[[], object], int]], repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of the mean wall time of one call of each entry, in µs.

    Each repeat times every entry in turn (``name -> (callable, calls per sample)``), so slow
    drifts of a shared machine affect the entries alike.
    """
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, (call, count) in calls.items():
            start = time.perf_counter()
            for _ in range(count):
                call()
            samples[name].append((time.perf_counter() - start) / count * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def _composite(named: list[tuple[str, torch.nn.Parameter]]) -> CompositeOptimizer:
    factory = {"muon": lambda n: ContractedAdamW(n, lr=1e-3), "backup": lambda n: ContractedAdamW(n, lr=1e-3)}
    return CompositeOptimizer.from_factories(named, factory)


def _count_guard_passes(optimizer: Any, action: Callable[[], object]) -> int:
    """How many times ``action`` verifies ``optimizer``'s sealed layout (Gefen's ``_verify_layout``)."""
    original = optimizer._verify_layout
    calls = [0]

    def counted(where: str) -> None:
        calls[0] += 1
        original(where)

    optimizer._verify_layout = counted
    try:
        action()
    finally:
        del optimizer._verify_layout
    return calls[0]


def _gefen(named: list[tuple[str, torch.nn.Parameter]], fused: bool) -> Gefen:
    return Gefen(named, lr=1e-3, fused=fused)


def _gefen_rows(tensors: int, numel: int, steps: int, repeats: int, row: Callable[..., None]) -> list[str]:
    """Gefen's guard rows (reference path, and fused when a kernel provider serves it); returns notes."""
    notes: list[str] = []
    arms: dict[str, bool] = {"gefen": False}
    try:
        probe_named = _named(2, numel)
        _gefen(probe_named, True).step()
        arms["gefen-fused"] = True
    except Exception as exc:  # no provider (e.g. no compiler or GPU): the fused rows are left out
        notes.append(f"gefen fused path unavailable here ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    passes = max(steps * 10, 50)
    for arm, fused in arms.items():
        unbound = _gefen(_named(tensors, numel), fused)
        bound_named = _named(tensors, numel)
        bound = _gefen(bound_named, fused)
        _bind(bound, bound_named)
        for optimizer in (unbound, bound):
            optimizer.step()  # learn the codebook and create the state: the timed steps are steady
        per_step = _count_guard_passes(bound, bound.step)
        per_closure_step = _count_guard_passes(bound, lambda: bound.step(lambda: None))  # noqa: B023
        timed = _interleaved_us(
            {"unbound": (unbound.step, steps), "bound": (bound.step, steps), "guard": (bound.shard_bindings, passes)},
            repeats,
        )
        unbound_step, bound_step, guard = timed["unbound"], timed["bound"], timed["guard"]
        row(f"{arm}/step-unbound", "step_time", unbound_step, "us")
        row(f"{arm}/step-bound", "step_time", bound_step, "us", f"{arm}/step-unbound", unbound_step)
        row(f"{arm}/guard-pass", "time_per_tensor", guard / tensors, "us/tensor")
        row(f"{arm}/guard-passes-per-step", "count", float(per_step), "passes")
        row(f"{arm}/guard-per-step", "step_time", per_step * guard, "us", f"{arm}/step-bound", bound_step)
        row(
            f"{arm}/guard-per-step-with-closure",
            "step_time",
            per_closure_step * guard,
            "us",
            f"{arm}/step-bound",
            bound_step,
        )
    return notes


def scope_collective_counts(rank: int, world_size: int, numel: int) -> dict[str, int]:
    """(A gloo rank function.) Collectives of each scoped Gefen operation, counted by wrapping
    ``torch.distributed``: replicated parameters, a codebook scope over the world."""
    import torch.distributed as dist
    from gefen_contracts import (
        LogicalSlice,
        ParameterIdentity,
        ParameterLayout,
        ParameterRebinding,
        PlacementKind,
        ProcessGroupIdentity,
        ShardIdentity,
        ShardingManifest,
        ShardPlacement,
    )
    from gefen_contracts.torch_support import CodebookProcessGroupBinding, CollectiveCounter

    torch.set_num_threads(1)
    members = tuple(f"rank:{r}" for r in range(world_size))
    group = ProcessGroupIdentity("dp", members)
    scope = CodebookProcessGroupBinding(group, members[rank], dist.group.WORLD, torch.device("cpu"))
    named = _named(4, numel)
    optimizer = Gefen(named, lr=1e-3, fused=False)
    rebindings, shards = [], []
    grads: dict[str, torch.Tensor] = {}
    for name, parameter in named:
        identity = ParameterIdentity(name, tuple(parameter.shape))
        for member in range(world_size):
            placement = ShardPlacement("dp", PlacementKind.REPLICATE, member, world_size)
            shard = ShardIdentity(
                identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity), (placement,), group, members[member]
            )
            shards.append(shard)
            if member == rank:
                rebindings.append(ParameterRebinding(parameter, parameter, shard))
        assert parameter.grad is not None
        grads[name] = parameter.grad
        parameter.grad = None
    optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), scope=scope)

    def counted(action: Callable[[], object]) -> int:
        for name, parameter in named:
            parameter.grad = grads[name].clone()
        counter = CollectiveCounter()
        with counter.patched():
            action()
        return counter.total

    return {
        "learning-step": counted(optimizer.step),
        "steady-step": counted(optimizer.step),
        "steady-step-with-closure": counted(lambda: optimizer.step(lambda: None)),
        "refresh": counted(optimizer.refresh_codebook),
        "budget": optimizer.collective_budget(),
    }


def _collective_rows(ranks: int, numel: int, row: Callable[..., None]) -> None:
    from gefen_contracts.testing import GlooWorld

    tools = str(Path(__file__).resolve().parent)
    if tools not in sys.path:
        sys.path.insert(0, tools)  # the spawned ranks import this file as ``bench_guard``
    with GlooWorld(ranks) as world:
        counts = world.run("bench_guard:scope_collective_counts", numel)
    if any(c != counts[0] for c in counts):
        raise RuntimeError(f"members counted different collectives: {counts}")
    budget = float(counts[0]["budget"])
    for operation in ("steady-step", "steady-step-with-closure", "learning-step", "refresh"):
        value = float(counts[0][operation])
        baseline = "scope/budget" if operation.startswith("steady") else None
        row(f"scope/{operation}", "collectives", value, "collectives", baseline, budget)
    row("scope/budget", "collectives", budget, "collectives")


def run(tensors: int, numel: int, steps: int, repeats: int, collective_ranks: int = 2) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    detail = {"tensors": tensors, "numel_per_tensor": numel}

    def row(name: str, metric: str, value: float, unit: str, baseline: str | None = None, base: float = 0.0) -> None:
        ratio = None if baseline is None or base == 0 else value / base
        rows.append(
            {
                "name": name,
                "metric": metric,
                "value": value,
                "unit": unit,
                "baseline": baseline,
                "ratio": ratio,
                "detail": detail,
            }
        )

    torch_named = _named(tensors, numel)
    torch_adamw = torch.optim.AdamW([p for _, p in torch_named], lr=1e-3)
    unbound = ContractedAdamW(_named(tensors, numel), lr=1e-3)
    bound_named = _named(tensors, numel)
    bound = ContractedAdamW(bound_named, lr=1e-3)
    _bind(bound, bound_named)
    for optimizer in (torch_adamw, unbound, bound):
        optimizer.step()  # create the state first: the guard then also walks every state key
    passes = max(steps * 10, 50)
    timed = _interleaved_us(
        {
            "torch": (torch_adamw.step, steps),
            "unbound": (unbound.step, steps),
            "bound": (bound.step, steps),
            "guard": (bound.shard_bindings, passes),
        },
        repeats,
    )
    torch_step, unbound_step, bound_step, guard = (timed[k] for k in ("torch", "unbound", "bound", "guard"))
    row("torch-adamw/step", "step_time", torch_step, "us")
    row("contracted-adamw/step-unbound", "step_time", unbound_step, "us", "torch-adamw/step", torch_step)
    row("contracted-adamw/step-bound", "step_time", bound_step, "us", "contracted-adamw/step-unbound", unbound_step)
    row("guard/pass", "time_per_tensor", guard / tensors, "us/tensor")
    row("guard/per-step", "step_time", guard, "us", "contracted-adamw/step-bound", bound_step)
    row("guard/per-step-with-closure", "step_time", 2 * guard, "us", "contracted-adamw/step-bound", bound_step)

    unbound_composite = _composite(_named(tensors, numel))
    composite_named = _named(tensors, numel)
    bound_composite = _composite(composite_named)
    _bind(bound_composite, composite_named)
    unbound_composite.step()
    bound_composite.step()
    entries: dict[str, tuple[Callable[[], object], int]] = {
        "unbound": (unbound_composite.step, steps),
        "bound": (bound_composite.step, steps),
    }
    for role, child in bound_composite.child_optimizers().items():
        entries[role] = (child.shard_bindings, passes)  # type: ignore[attr-defined]
    timed = _interleaved_us(entries, repeats)
    composite_unbound, composite_bound = timed["unbound"], timed["bound"]
    composite_guard = sum(timed[role] for role in bound_composite.child_optimizers())
    row("composite/step-unbound", "step_time", composite_unbound, "us")
    row("composite/step-bound", "step_time", composite_bound, "us", "composite/step-unbound", composite_unbound)
    row("composite/guard-per-step", "step_time", 2 * composite_guard, "us", "composite/step-bound", composite_bound)

    run.notes = _gefen_rows(tensors, numel, steps, repeats, row)  # type: ignore[attr-defined]
    if collective_ranks > 1:
        _collective_rows(collective_ranks, numel, row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tensors", type=int, default=500, help="parameter tensors")
    parser.add_argument("--numel", type=int, default=64, help="elements per parameter tensor")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing sample")
    parser.add_argument("--repeats", type=int, default=5, help="timing samples (the median is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--collective-ranks", type=int, default=2, help="gloo ranks of the collective-count run (0: skip it)"
    )
    parser.add_argument("--json", type=Path, default=Path("bench_guard.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.tensors, args.numel, args.steps, args.repeats, args.collective_ranks)
    print(f"{'name':<36} {'metric':<16} {'value':>12} {'unit':<10} {'ratio':>8}  baseline")
    for item in rows:
        ratio = "" if item["ratio"] is None else f"{item['ratio']:.4f}"
        print(
            f"{item['name']:<36} {item['metric']:<16} {item['value']:>12.3f} {item['unit']:<10} {ratio:>8}  "
            f"{item['baseline'] or ''}"
        )
    by_name = {item["name"]: item for item in rows}
    share = by_name["guard/per-step"]["ratio"]
    print(
        f"guard: {by_name['guard/pass']['value']:.3f} µs per parameter tensor per pass; "
        f"{100 * share:.2f} % of a bound ContractedAdamW step (one pass; two with a closure)"
    )
    for arm in ("gefen", "gefen-fused"):
        if f"{arm}/guard-pass" in by_name:
            print(
                f"{arm}: {by_name[f'{arm}/guard-pass']['value']:.3f} µs per parameter tensor per pass, "
                f"{by_name[f'{arm}/guard-passes-per-step']['value']:.0f} pass(es) per step: "
                f"{100 * by_name[f'{arm}/guard-per-step']['ratio']:.2f} % of a bound step "
                f"({100 * by_name[f'{arm}/guard-per-step-with-closure']['ratio']:.2f} % with a closure)"
            )
    for note in getattr(run, "notes", []):
        print(f"note: {note}")
    if "scope/steady-step" in by_name:
        print(
            "scope collectives: "
            + ", ".join(
                f"{op} {by_name[f'scope/{op}']['value']:.0f}"
                for op in ("steady-step", "steady-step-with-closure", "learning-step", "refresh")
            )
            + f" (budget {by_name['scope/budget']['value']:.0f} per steady step)"
        )
    report = {
        "schema": "gefen.bench",
        "schema_version": 1,
        "benchmark": "guard",
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": sys.version.split()[0],
        },
        "libraries": {"torch": torch.__version__},
        "config": {
            "tensors": args.tensors,
            "numel": args.numel,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": args.threads,
            "collective_ranks": args.collective_ranks,
        },
        "notes": "median wall time; guard = one SealedLayout.verify pass (timed through shard_bindings())"
        + "".join(f"; {note}" for note in getattr(run, "notes", [])),
        "rows": rows,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

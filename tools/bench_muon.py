"""Benchmark GefenMuon's whole ``step()`` against ``torch.optim.Muon`` in the same process.

Both optimizers run Newton-Schulz in bf16 on the same matrices (by default twelve 1024x1024
and three 1024x4096 fp32 parameters), with the same gradients and the same thread count.
GefenMuon runs each schedule (``standard`` = NS5, ``tuned3``, ``tuned4``), on the reference
path (``fused=False``) and, when a kernel provider registers ``gefen.muon_momentum/1``, with
kernels (``fused=None``). Steps are timed round-robin across the optimizers (so machine noise
hits all of them alike) after one warm-up step (GefenMuon's first step also learns the
codebook); the median is reported. Also measured: Newton-Schulz alone per schedule against
torch's NS5, state bytes per parameter, and each schedule's orthogonality error
(``max |sigma - 1|`` over the singular values of its output on Gaussian matrices of the
benchmark's shapes) next to NS5's.

Prints a table and writes JSON in the ``gefen.bench`` schema (version 1): rows of
name / metric / value / unit / baseline / ratio / detail, every ratio against a baseline
measured in this run.

    uv run python tools/bench_muon.py [--tiny] [--repeats 3] [--threads N] [--json muon.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from gefen_contracts import default_kernel_registry
from gefen_core import GefenMuon
from gefen_core.newton_schulz import DEFAULT_COEFFICIENTS, newton_schulz, orthogonality_error, resolve_schedule
from gefen_core.ops import MUON_MOMENTUM
from torch.optim._muon import _zeropower_via_newtonschulz

SCHEDULES = ("standard", "tuned3", "tuned4")
FULL_SHAPES = [(1024, 1024)] * 12 + [(1024, 4096)] * 3
TINY_SHAPES = [(64, 64)] * 2 + [(64, 256)]
BASELINE = "muon/torch-ns5"


def _matrices(shapes: list[tuple[int, int]], seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) * scale for shape in shapes]


def _kernels_available() -> bool:
    return any(MUON_MOMENTUM in provider.op_ids() for provider in default_kernel_registry().providers)


Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _gefen(schedule: str, fused: bool | None) -> Factory:
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return GefenMuon(params, lr=1e-3, ns_schedule=schedule, fused=fused)

    return make


def _variants(kernels: bool) -> dict[str, Factory]:
    variants: dict[str, Factory] = {BASELINE: lambda ps: torch.optim.Muon(ps, lr=1e-3)}
    paths: list[tuple[str, bool | None]] = [("reference", False)] + ([("kernels", None)] if kernels else [])
    for path, fused in paths:
        for schedule in SCHEDULES:
            variants[f"muon/gefen-{schedule}-{path}"] = _gefen(schedule, fused)
    return variants


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if isinstance(optimizer, GefenMuon):
        return optimizer.state_bytes()
    return sum(v.nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _time_steps(
    shapes: list[tuple[int, int]], variants: dict[str, Factory], repeats: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    grads = [_matrices(shapes, 100 + step) for step in range(2)]
    runs: dict[str, tuple[list[torch.nn.Parameter], torch.optim.Optimizer]] = {}
    for name, make in variants.items():
        params = [torch.nn.Parameter(m) for m in _matrices(shapes, 0)]
        runs[name] = (params, make(params))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(repeats + 1):  # round 0 warms up (and learns GefenMuon's codebook)
        for name, (params, optimizer) in runs.items():
            for p, g in zip(params, grads[round_index % 2]):
                p.grad = g
            start = time.perf_counter()
            optimizer.step()
            elapsed = time.perf_counter() - start
            if round_index:
                times[name].append(elapsed)
    numel = sum(r * c for r, c in shapes)
    per_param = {name: _state_bytes(optimizer) / numel for name, (_, optimizer) in runs.items()}
    return times, per_param


def _time_newton_schulz(shapes: list[tuple[int, int]], repeats: int) -> dict[str, list[float]]:
    inputs = [m.to(torch.bfloat16) for m in _matrices(shapes, 7)]
    calls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "ns/torch-ns5": lambda x: _zeropower_via_newtonschulz(x, DEFAULT_COEFFICIENTS, 5, 1e-7)
    }
    for schedule in SCHEDULES:
        steps = resolve_schedule(ns_schedule=schedule)
        calls[f"ns/gefen-{schedule}"] = lambda x, s=steps: newton_schulz(x, s, 1e-7)  # type: ignore[misc]
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for x in inputs:
                call(x)
            times[name].append(time.perf_counter() - start)
    return times


def _orthogonality(shapes: list[tuple[int, int]]) -> dict[str, dict[str, float]]:
    errors: dict[str, dict[str, float]] = {}
    for shape in sorted(set(shapes)):
        (x,) = _matrices([shape], 11)
        for schedule in SCHEDULES:
            output = newton_schulz(x, resolve_schedule(ns_schedule=schedule), 1e-7)
            errors.setdefault(schedule, {})[f"{shape[0]}x{shape[1]}"] = orthogonality_error(output)
    return errors


def _row(
    name: str, metric: str, value: float, unit: str, baseline: str | None, base: float | None, **detail: Any
) -> dict[str, Any]:
    ratio = None if baseline is None or not base else value / base
    return {
        "name": name,
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "detail": detail,
    }


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "accelerator": "cpu",
    }


def _libraries() -> dict[str, Any]:
    versions: dict[str, Any] = {}
    for name in ("gefen-contracts", "gefen-core", "gefen-kernels", "torch", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def run(shapes: list[tuple[int, int]], repeats: int, threads: int) -> dict[str, Any]:
    """Measure everything and return the ``gefen.bench`` v1 document."""
    torch.set_num_threads(threads)
    kernels = _kernels_available()
    step_times, per_param = _time_steps(shapes, _variants(kernels), repeats)
    ns_times = _time_newton_schulz(shapes, repeats)
    ortho = _orthogonality(shapes)
    rows: list[dict[str, Any]] = []
    base = statistics.median(step_times[BASELINE])
    for name, samples in step_times.items():
        rows.append(
            _row(
                name,
                "step_time",
                statistics.median(samples),
                "s",
                None if name == BASELINE else BASELINE,
                base,
                samples=samples,
            )
        )
    base_bytes = per_param[BASELINE]
    for name, value in per_param.items():
        rows.append(
            _row(name, "state_bytes_per_param", value, "B/param", None if name == BASELINE else BASELINE, base_bytes)
        )
    ns_base = statistics.median(ns_times["ns/torch-ns5"])
    for name, samples in ns_times.items():
        baseline = None if name == "ns/torch-ns5" else "ns/torch-ns5"
        rows.append(_row(name, "ns_time", statistics.median(samples), "s", baseline, ns_base, samples=samples))
    for shape in ortho["standard"]:
        for schedule in SCHEDULES:
            baseline = None if schedule == "standard" else f"ns/gefen-standard@{shape}"
            value = ortho[schedule][shape]
            rows.append(
                _row(
                    f"ns/gefen-{schedule}@{shape}",
                    "orthogonality_error",
                    value,
                    "max|sigma-1|",
                    baseline,
                    ortho["standard"][shape],
                )
            )
    notes = [
        "CPU timings on a shared machine are noisy: medians of round-robin steps, one warm-up step excluded.",
        "Both optimizers run Newton-Schulz in bf16; GefenMuon's step includes its momentum codec.",
        "Orthogonality errors are on Gaussian matrices: a square one has singular values near 0 that no "
        "schedule lifts, so every schedule scores about 1 there; rectangular shapes tell the schedules apart.",
    ]
    if not kernels:
        notes.append("no kernel provider registers gefen.muon_momentum/1: only the reference path (fused=False) ran")
    return {
        "schema": "gefen.bench",
        "schema_version": 1,
        "benchmark": "muon",
        "created_utc": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "machine": _machine(),
        "libraries": _libraries(),
        "config": {
            "shapes": [list(s) for s in shapes],
            "repeats": repeats,
            "threads": threads,
            "kernels": kernels,
        },
        "notes": notes,
        "rows": rows,
    }


def render(document: dict[str, Any]) -> str:
    """The rows as a fixed-width table, then the notes."""
    header = ("name", "metric", "value", "unit", "ratio")
    lines = [header] + [
        (
            row["name"],
            row["metric"],
            f"{row['value']:.4g}",
            row["unit"],
            "" if row["ratio"] is None else f"{row['ratio']:.3f}x",
        )
        for row in document["rows"]
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in lines]
    out.extend(f"note: {note}" for note in document["notes"])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny matrices (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per optimizer (default 3)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads for every run")
    parser.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    document = run(TINY_SHAPES if args.tiny else FULL_SHAPES, args.repeats, args.threads)
    print(render(document))
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

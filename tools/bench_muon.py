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

``--device-check`` is the GPU check of ``fp8_ns`` (needs CUDA capability >= 8.9; elsewhere it
says so and exits 0): on 2048-4096 matrices it runs the real e4m3 iteration
(``torch._scaled_mm``, eager and compiled) against its emulated twin (the same numerics up to
fp32 accumulation order: relative L2 < 1e-2) and against bf16 (< 0.2, the bound the CPU
tests state for the twin), times both iterations, and times GefenMuon steps with and without
``fp8_ns`` against ``torch.optim.Muon`` on the GPU.

    uv run python tools/bench_muon.py [--tiny] [--repeats 3] [--threads N] [--json muon.json]
    uv run python tools/bench_muon.py --device-check [--json fp8.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
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
from gefen_core.fp8_newton_schulz import emulated_scaled_mm, fp8_capable, fp8_eligible, newton_schulz_fp8
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
                min=min(samples),
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
        rows.append(
            _row(name, "ns_time", statistics.median(samples), "s", baseline, ns_base, samples=samples, min=min(samples))
        )
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


FP8_SHAPES = [(2048, 2048), (2048, 8192), (4096, 4096)]
#: Device-check bounds: real fp8 vs its emulated twin, and fp8 vs bf16 (relative L2).
FP8_TWIN_BOUND = 1e-2
FP8_BF16_BOUND = 0.2


def _cuda_median(call: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def device_check(repeats: int) -> dict[str, Any] | None:
    """The ``fp8_ns`` GPU check (module docstring); ``None`` without a capable GPU."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is None or not fp8_capable(device):
        return None
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for shape in FP8_SHAPES:
        assert fp8_eligible(shape, device)
        (x,) = _matrices([shape], 3)
        x = x.to(device)
        label = f"{shape[0]}x{shape[1]}"
        for schedule in SCHEDULES:
            steps = resolve_schedule(ns_schedule=schedule)
            bf16 = newton_schulz(x, steps, 1e-7)
            real = newton_schulz_fp8(x, steps, 1e-7)
            compiled = newton_schulz_fp8(x, steps, 1e-7, compile=True)
            twin = newton_schulz_fp8(x, steps, 1e-7, scaled_mm=emulated_scaled_mm)
            checks = {
                "real_vs_twin": _relative(real, twin),
                "compiled_vs_twin": _relative(compiled, twin),
                "fp8_vs_bf16": _relative(real, bf16),
            }
            if checks["real_vs_twin"] >= FP8_TWIN_BOUND or checks["compiled_vs_twin"] >= FP8_TWIN_BOUND:
                problems.append(f"{label} {schedule}: fp8 GEMMs differ from the emulated twin {checks}")
            if checks["fp8_vs_bf16"] >= FP8_BF16_BOUND:
                problems.append(f"{label} {schedule}: fp8 is {checks['fp8_vs_bf16']:.3f} away from bf16")
            base = _cuda_median(functools.partial(newton_schulz, x, steps, 1e-7), repeats)
            fast = _cuda_median(functools.partial(newton_schulz_fp8, x, steps, 1e-7, compile=True), repeats)
            name = f"ns/{schedule}@{label}"
            rows.append(_row(f"{name}/bf16", "ns_time", base, "s", None, None))
            rows.append(_row(f"{name}/fp8", "ns_time", fast, "s", f"{name}/bf16", base, **checks))
    shapes = [(2048, 2048)] * 4 + [(2048, 8192)] * 2
    grads = [g.to(device) for g in _matrices(shapes, 5)]
    makers: dict[str, Factory] = {
        "step/torch-ns5": lambda ps: torch.optim.Muon(ps, lr=1e-3),
        "step/gefen-tuned3-bf16": lambda ps: GefenMuon(ps, lr=1e-3, ns_schedule="tuned3"),
        "step/gefen-tuned3-fp8": lambda ps: GefenMuon(ps, lr=1e-3, ns_schedule="tuned3", fp8_ns=True),
    }
    base_step = None
    for name, make in makers.items():
        params = [torch.nn.Parameter(m.to(device)) for m in _matrices(shapes, 0)]
        optimizer = make(params)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()  # warm-up (codebook, compilation)
        seconds = _cuda_median(optimizer.step, repeats)
        rows.append(_row(name, "step_time", seconds, "s", None if base_step is None else "step/torch-ns5", base_step))
        base_step = seconds if base_step is None else base_step
    return {
        "schema": "gefen.bench",
        "schema_version": 1,
        "benchmark": "muon-fp8-device-check",
        "created_utc": datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "machine": {**_machine(), "accelerator": f"cuda:{torch.cuda.get_device_name(device)}"},
        "libraries": _libraries(),
        "config": {"shapes": [list(s) for s in FP8_SHAPES], "repeats": repeats},
        "notes": problems or ["every fp8 bound held"],
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
    parser.add_argument(
        "--device-check", action="store_true", help="the fp8_ns check on a CUDA GPU (capability >= 8.9)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    if args.device_check:
        checked = device_check(max(args.repeats, 5))
        if checked is None:
            print("device check skipped: fp8_ns needs a CUDA GPU of compute capability >= 8.9")
            return 0
        document = checked
    else:
        document = run(TINY_SHAPES if args.tiny else FULL_SHAPES, args.repeats, args.threads)
    print(render(document))
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 1 if args.device_check and document["notes"] != ["every fp8 bound held"] else 0


if __name__ == "__main__":
    sys.exit(main())

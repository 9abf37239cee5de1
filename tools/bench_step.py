"""Benchmark of a whole optimizer ``step()`` (the driver ``gefen bench step`` folds in).

Same process, same parameters, median of ``--repeats`` timed steps after warm-up (Gefen's
codebook already learned), ``--threads`` intra-op threads. Every row is a ratio against
``torch.optim.AdamW(fused=True)`` measured in the same run; a copy of the bytes Gefen moves
per step (14 B/param for fp32) is the bandwidth bound. Prints a table and writes JSON rows
of name / metric / value / unit / baseline / ratio (schema ``gefen.bench`` v1).

    uv run python tools/bench_step.py                 # >= 16M parameters, CPU
    uv run python tools/bench_step.py --device cuda   # on a GPU
    uv run python tools/bench_step.py --tiny          # smoke run (tests)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: (name, shape) of a small decoder: embeddings, attention and MLP matrices, 1-D norm weights.
Shape = tuple[int, ...]


def decoder_shapes(d_model: int, layers: int, vocab: int) -> list[tuple[str, Shape]]:
    shapes: list[tuple[str, Shape]] = [("embed", (vocab, d_model))]
    for layer in range(layers):
        prefix = f"layers.{layer}"
        shapes += [
            (f"{prefix}.attn_norm", (d_model,)),
            (f"{prefix}.q", (d_model, d_model)),
            (f"{prefix}.k", (d_model // 4, d_model)),
            (f"{prefix}.v", (d_model // 4, d_model)),
            (f"{prefix}.o", (d_model, d_model)),
            (f"{prefix}.mlp_norm", (d_model,)),
            (f"{prefix}.gate", (4 * d_model, d_model)),
            (f"{prefix}.up", (4 * d_model, d_model)),
            (f"{prefix}.down", (d_model, 4 * d_model)),
        ]
    shapes.append(("final_norm", (d_model,)))
    return shapes


def _make_params(shapes: list[tuple[str, Shape]], device: str, seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for name, shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator).mul_(0.02).to(device))
        param.grad = torch.randn(shape, generator=generator).to(device)
        params.append((name, param))
    return params


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_step(step: Callable[[], Any], device: str, warmup: int, repeats: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times), times


def _arms(device: str, numel: int) -> dict[str, Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]]:
    from gefen_core import Gefen

    def adamw(fused: bool | None) -> Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]:
        def build(params: list[tuple[str, torch.nn.Parameter]]) -> Callable[[], Any]:
            return torch.optim.AdamW([p for _, p in params], lr=1e-3, weight_decay=0.01, fused=fused).step

        return build

    def gefen(fused: bool) -> Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]:
        def build(params: list[tuple[str, torch.nn.Parameter]]) -> Callable[[], Any]:
            optimizer = Gefen(params, lr=1e-3, weight_decay=0.01, fused=fused)
            optimizer.step()  # learns the codebook and periods before timing
            return optimizer.step

        return build

    def copy_bound(params: list[tuple[str, torch.nn.Parameter]]) -> Callable[[], Any]:
        del params
        half = (14 * numel) // 2  # read 7 B/param + write 7 B/param = 14 B/param moved
        source = torch.empty(half, dtype=torch.uint8, device=device).fill_(1)
        target = torch.empty_like(source)
        return lambda: target.copy_(source)

    arms: dict[str, Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]] = {
        "adamw-fused": adamw(True),
        "adamw-default": adamw(None),
        "copy-14B": copy_bound,
        "gefen-reference": gefen(False),
        "gefen-fused": gefen(True),
        "gefen-block-fused": _gefen_block(True),
    }
    muon = _muon_arm()
    if muon is not None:
        arms["gefenmuon-momentum-fused"] = muon
    arms.update(_peer_arms(device))
    return arms


def _gefen_block(fused: bool) -> Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]:
    from gefen_core import Gefen

    def build(params: list[tuple[str, torch.nn.Parameter]]) -> Callable[[], Any]:
        optimizer = Gefen(params, lr=1e-3, weight_decay=0.01, fused=fused, factored_v_2d=False)
        optimizer.step()
        return optimizer.step

    return build


def _muon_arm() -> Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]] | None:
    """GefenMuon's quantised-momentum update alone (the op its step dispatches), on the 2-D matrices."""
    try:
        from gefen_core import step_scalars
        from gefen_kernels import provider
    except ImportError:
        return None
    if not hasattr(step_scalars, "muon_scalars"):
        return None

    def build(params: list[tuple[str, torch.nn.Parameter]]) -> Callable[[], Any]:
        kernels = provider()
        run = kernels.implementation("gefen.muon_momentum/1")
        work = []
        codebook = torch.linspace(-1.0, 1.0, 256, device=params[0][1].device)
        for _, param in params:
            if param.dim() != 2:
                continue
            grad = param.grad
            assert grad is not None
            period = param.shape[1]
            indices = torch.zeros(param.numel() // period, period, dtype=torch.uint8, device=param.device)
            magnitude = torch.zeros(param.numel() // period, 1, device=param.device)
            out = torch.empty(param.shape, dtype=torch.bfloat16, device=param.device)
            packet = step_scalars.muon_scalars(param.device, 0.95)
            work.append((grad, indices, magnitude, codebook, packet, None, out))

        def step() -> None:
            for args in work:
                run(*args, nesterov=True, deterministic=False)

        return step

    return build


def _peer_arms(device: str) -> dict[str, Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]]:
    arms: dict[str, Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]] = {}
    try:
        from torchao.optim import AdamW4bit, AdamW8bit  # type: ignore[import-not-found]

        def torchao_arm(cls: Any) -> Callable[[list[tuple[str, torch.nn.Parameter]]], Callable[[], Any]]:
            return lambda params: cls([p for _, p in params], lr=1e-3).step

        arms["torchao-adamw8bit"] = torchao_arm(AdamW8bit)
        arms["torchao-adamw4bit"] = torchao_arm(AdamW4bit)
    except ImportError:
        pass
    try:
        import bitsandbytes as bnb  # type: ignore[import-not-found]

        arms["bnb-adamw8bit"] = lambda params: bnb.optim.AdamW8bit([p for _, p in params], lr=1e-3).step
    except ImportError:
        pass
    return arms


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.tiny:
        shapes = decoder_shapes(64, 1, 256)
    else:
        shapes = decoder_shapes(args.d_model, args.layers, args.vocab)
    numel = sum(int(torch.Size(shape).numel()) for _, shape in shapes)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    arms = _arms(args.device, numel)
    if args.arms:
        wanted = [name.strip() for name in args.arms.split(",") if name.strip()]
        unknown = sorted(set(wanted) - set(arms))
        if unknown:
            raise SystemExit(f"--arms: unknown arm(s) {unknown}; known: {sorted(arms)}")
        arms = {name: build for name, build in arms.items() if name in wanted or name == "adamw-fused"}
    baseline = "adamw-fused"
    medians: dict[str, float] = {}
    for name, build in arms.items():
        params = _make_params(shapes, args.device, seed=0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step = build(params)
                median, times = _median_step(step, args.device, args.warmup, args.repeats)
        except Exception as exc:  # a peer that installs but cannot run here
            notes.append(f"{name}: not measured ({type(exc).__name__}: {exc})")
            continue
        medians[name] = median
        rows.append(
            {
                "name": name,
                "metric": "step_time",
                "value": median * 1e3,
                "unit": "ms",
                "baseline": None if name == baseline else baseline,
                "ratio": None,
                "detail": {"ns_per_param": median / numel * 1e9, "min_ms": min(times) * 1e3},
            }
        )
        del params, step
    base = medians.get(baseline)
    for row in rows:
        if row["baseline"] is not None and base:
            row["ratio"] = row["value"] / (base * 1e3)
    for peer in ("torchao-adamw8bit", "torchao-adamw4bit", "bnb-adamw8bit"):
        if peer not in arms:
            notes.append(f"{peer}: not installed")
    try:
        load = os.getloadavg()
        notes.append(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    except OSError:
        pass
    kernels: dict[str, Any] = {}
    try:
        from gefen_kernels import cpu_kernel_status

        status = cpu_kernel_status()
        kernels = {"cpu_available": status.available, "flags": " ".join(status.flags), "reason": status.reason}
    except ImportError:
        pass
    return {
        "schema": "gefen.bench",
        "schema_version": 1,
        "benchmark": "step",
        "created_utc": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        },
        "libraries": {"torch": torch.__version__},
        "config": {
            "device": args.device,
            "threads": args.threads,
            "params": numel,
            "tensors": len(shapes),
            "warmup": args.warmup,
            "repeats": args.repeats,
            "dtype": "float32",
            "kernels": kernels,
        },
        "notes": notes,
        "rows": rows,
    }


def render(report: dict[str, Any]) -> str:
    lines = [f"step benchmark: {report['config']['params']:,} fp32 parameters in {report['config']['tensors']} tensors"]
    lines.append(f"{'name':28s} {'median ms':>10s} {'ns/param':>9s} {'vs adamw-fused':>15s}")
    for row in report["rows"]:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.3f}x"
        lines.append(f"{row['name']:28s} {row['value']:10.2f} {row['detail']['ns_per_param']:9.3f} {ratio:>15s}")
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--tiny", action="store_true", help="a smoke run at tiny sizes")
    parser.add_argument(
        "--arms", default="", help="comma-separated arms to run (the adamw-fused baseline always runs); default: all"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.warmup, args.repeats = 1, 3
    report = run(args)
    print(render(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

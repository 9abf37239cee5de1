"""Benchmark driver for gefen-dcp: save/load seconds and per-rank peak memory against torch DCP.

For each world size and each arm, fresh processes (one per rank, gloo on 127.0.0.1) build a
decoder-shaped model under FSDP2 ``fully_shard``, take two optimizer steps, and then measure

* a synchronous ``dcp.save`` of model + optimizer,
* a ``dcp.async_save`` (timed from the call until the write completed),
* a ``dcp.load`` into a freshly built model and optimizer (resharding when the world size
  differs from the one that saved: the load uses the checkpoint written by the same arm at
  the same world size),

reporting the wall-clock seconds and the peak resident-set growth above the resident size
just before each operation (Linux: the high-water mark ``VmHWM``, reset before each
operation through ``/proc/self/clear_refs``; elsewhere a 1 ms RSS sampler), on the worst
rank, per parameter held by that rank.

Arms: ``gefen_dcp`` saves the optimizer through :class:`gefen_dcp.GefenDCPState` (with
``GefenSavePlanner``, ``GefenFileSystemWriter`` and ``GefenLoadPlanner``); the baseline
``torch_dcp_adamw`` is ``torch.optim.AdamW`` through ``get_state_dict`` / ``set_state_dict``
and DCP's stock planner and ``FileSystemWriter``. Ratios are against the baseline measured in
the same run. Output: a table on stdout and, with ``--json``, the ``gefen.bench`` v1 report.

Usage::

    python tools/bench_dcp.py --model decoder-50m --ranks 1 2 3 --json dcp.json
    python tools/bench_dcp.py --model tiny --ranks 1          # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import importlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_NAME = "gefen.bench"
SCHEMA_VERSION = 1
BASELINE = "torch_dcp_adamw"
ARMS = ("gefen_dcp", BASELINE)
DEFAULT_OPTIMIZER = "gefen_dcp.testing:conformance_factory"
# Large blocks are mmapped and returned on free, so transient buffers show up as resident growth.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A GPT-style pre-norm decoder (the tensor kinds of ``gefen bench memory``'s model)."""

    d_model: int
    n_layers: int
    n_heads: int
    context: int
    vocab_size: int

    def parameter_count(self) -> int:
        d, v, f = self.d_model, self.vocab_size, 4 * self.d_model
        per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return v * d + self.context * d + self.n_layers * per_layer + 2 * d + v * d


#: ``decoder-50m`` has the shape of ``gefen bench memory``'s preset (about 52.7M parameters).
MODEL_SHAPES = {
    "tiny": ModelShape(d_model=32, n_layers=1, n_heads=2, context=32, vocab_size=256),
    "small": ModelShape(d_model=128, n_layers=4, n_heads=4, context=64, vocab_size=2048),
    "decoder-50m": ModelShape(d_model=512, n_layers=14, n_heads=8, context=256, vocab_size=8192),
}


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    model: str
    arm: str
    world_size: int
    port: int
    root: str
    optimizer: str
    chunk_bytes: int | None
    threads: int
    batch_size: int
    sequence_length: int
    with_model: bool


# -- the model (built in the workers) -------------------------------------------------------


def _build_model(shape: ModelShape) -> Any:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = shape.d_model
            self.norm1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.norm2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch, length, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
            view = (batch, length, shape.n_heads, d // shape.n_heads)
            q, k, v = (t.view(view).transpose(1, 2) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d))
            result: torch.Tensor = x + self.out(F.gelu(self.fc(self.norm2(x))))
            return result

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token_embedding = nn.Embedding(shape.vocab_size, shape.d_model)
            self.position_embedding = nn.Embedding(shape.context, shape.d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.n_layers))
            self.norm = nn.LayerNorm(shape.d_model)
            self.head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(ids.shape[1])
            x = self.token_embedding(ids) + self.position_embedding(positions)
            for block in self.blocks:
                x = block(x)
            logits: torch.Tensor = self.head(self.norm(x))
            return logits

    torch.manual_seed(0)
    return Decoder()


# -- resident memory --------------------------------------------------------------------------


def _status_bytes(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _rss() -> int:
    value = _status_bytes("VmRSS")
    if value is not None:
        return value
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(usage if sys.platform == "darwin" else usage * 1024)


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5", encoding="ascii")
    except OSError:
        return False
    return _status_bytes("VmHWM") is not None


class _Sampler:
    """Samples the resident size every millisecond while active (a fallback for ``VmHWM``)."""

    def __init__(self) -> None:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _measure(operation: Callable[[], object]) -> dict[str, float]:
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    exact = _reset_high_water_mark()
    before = _rss()
    started = time.perf_counter()
    with _Sampler() as sampler:
        operation()
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM") if exact else None
    peak = max(sampler.peak, peak or 0)
    gc.collect()
    after = _rss()
    dist.barrier()
    return {"seconds": seconds, "peak_extra_bytes": float(peak - before), "retained_bytes": float(after - before)}


# -- the arms ----------------------------------------------------------------------------------


def _resolve(spec: str) -> Callable[..., Any]:
    module, _, attribute = spec.partition(":")
    target: Any = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


def _optimizer(spec: WorkerSpec, model: Any) -> Any:
    import torch

    if spec.arm == BASELINE:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _resolve(spec.optimizer)(list(model.named_parameters()))


def _train(model: Any, optimizer: Any, spec: WorkerSpec, steps: int) -> None:
    import torch
    from torch.nn import functional as F

    shape = MODEL_SHAPES[spec.model]
    length = min(spec.sequence_length, shape.context)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, shape.vocab_size, (spec.batch_size, length + 1), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, shape.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _save(spec: WorkerSpec, model: Any, optimizer: Any, path: Path, *, group: Any = None) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    asynchronous = group is not None
    write: Callable[..., Any] = async_save if asynchronous else save
    options: dict[str, Any] = {"process_group": group} if asynchronous else {}
    state: dict[str, Any]
    if spec.arm == BASELINE:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state} if spec.with_model else {"optim": optimizer_state}
        return write(state, storage_writer=FileSystemWriter(path), **options)
    from gefen_dcp import GefenDCPState, GefenFileSystemWriter, GefenSavePlanner

    state = {"optim": GefenDCPState(optimizer, chunk_bytes=spec.chunk_bytes)}
    if spec.with_model:
        state["model"] = model.state_dict()
    return write(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner(), **options)


def _load(spec: WorkerSpec, model: Any, optimizer: Any, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    state: dict[str, Any]
    if spec.arm == BASELINE:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state} if spec.with_model else {"optim": optimizer_state}
        load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state.get("model", {}), optim_state_dict=state["optim"])
        return
    from gefen_dcp import GefenDCPState, GefenLoadPlanner

    state = {"optim": GefenDCPState(optimizer)}
    if spec.with_model:
        state["model"] = model.state_dict()
    load(state, checkpoint_id=path, planner=GefenLoadPlanner())


def _async_saver(spec: WorkerSpec, model: Any, optimizer: Any, path: Path) -> Callable[[], None]:
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")  # async writes must not share a group with training collectives

    def run() -> None:
        future = _save(spec, model, optimizer, path, group=group)
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()

    return run


def _local_numel(model: Any) -> int:
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += int(local.numel())
    return total


def _worker(spec: WorkerSpec, rank: int) -> dict[str, Any]:
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec.port}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=600),
    )
    try:
        shape = MODEL_SHAPES[spec.model]
        mesh = init_device_mesh("cpu", (spec.world_size,))
        model = _build_model(shape)
        fully_shard(model, mesh=mesh)
        optimizer = _optimizer(spec, model)
        _train(model, optimizer, spec, steps=2)
        path = Path(spec.root) / f"{spec.arm}-{spec.world_size}"
        result: dict[str, Any] = {"local_parameters": _local_numel(model), "resident_bytes": _rss()}
        result["save"] = _measure(functools.partial(_save, spec, model, optimizer, path))
        result["async_save"] = _measure(_async_saver(spec, model, optimizer, Path(str(path) + "-async")))
        del optimizer, model
        gc.collect()
        fresh = _build_model(shape)
        fully_shard(fresh, mesh=mesh)
        fresh_optimizer = _optimizer(spec, fresh)
        result["load"] = _measure(functools.partial(_load, spec, fresh, fresh_optimizer, path))
        return result
    finally:
        dist.destroy_process_group()


# -- orchestration -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_world(spec: WorkerSpec) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="gefen-bench-dcp-") as scratch:
        spec_path = Path(scratch) / "spec.json"
        spec_path.write_text(json.dumps(asdict(spec)), encoding="utf-8")
        env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": str(spec.threads or 1)}
        processes = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(spec_path), str(rank), str(Path(scratch) / f"r{rank}.json")],
                env=env,
                stdout=subprocess.DEVNULL,
            )
            for rank in range(spec.world_size)
        ]
        codes = [process.wait() for process in processes]
        if any(codes):
            raise RuntimeError(f"{spec.arm} on {spec.world_size} ranks failed (exit codes {codes}; errors above)")
        return [
            json.loads((Path(scratch) / f"r{rank}.json").read_text(encoding="utf-8")) for rank in range(spec.world_size)
        ]


def _library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in ("gefen-dcp", "gefen-contracts", "torch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def run_benchmark(
    *,
    model: str,
    ranks: Sequence[int],
    optimizer: str = DEFAULT_OPTIMIZER,
    chunk_bytes: int | None = None,
    threads: int = 1,
    batch_size: int = 2,
    sequence_length: int = 64,
    with_model: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every arm on every world size; return the ``gefen.bench`` v1 report document."""
    if model not in MODEL_SHAPES:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODEL_SHAPES)}")
    if not ranks or any(type(n) is not int or n < 1 for n in ranks):
        raise ValueError(f"ranks must be positive ints, got {list(ranks)!r}")
    rows: list[dict[str, Any]] = []
    index: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="gefen-bench-dcp-ckpt-") as root:
        for world_size in ranks:
            for arm in (BASELINE, "gefen_dcp"):
                spec = WorkerSpec(
                    model,
                    arm,
                    world_size,
                    _free_port(),
                    root,
                    optimizer,
                    chunk_bytes,
                    threads,
                    batch_size,
                    sequence_length,
                    with_model,
                )
                results = _run_world(spec)
                if progress is not None:
                    progress(f"{world_size} ranks / {arm}")
                name = f"{model}/{world_size}ranks/{arm}"
                base = None if arm == BASELINE else f"{model}/{world_size}ranks/{BASELINE}"
                for operation in ("save", "async_save", "load"):
                    worst = max(results, key=lambda r: r[operation]["peak_extra_bytes"] / r["local_parameters"])
                    per_param = worst[operation]["peak_extra_bytes"] / worst["local_parameters"]
                    seconds = max(r[operation]["seconds"] for r in results)
                    detail = {
                        "per_rank_peak_extra_bytes": [r[operation]["peak_extra_bytes"] for r in results],
                        "per_rank_local_parameters": [r["local_parameters"] for r in results],
                        "per_rank_resident_before_bytes": [r["resident_bytes"] for r in results],
                    }
                    for metric, value, unit in (
                        (f"{operation}_seconds", seconds, "s"),
                        (f"{operation}_peak_bytes_per_param", per_param, "B/param"),
                    ):
                        ratio = None
                        if base is not None and index[(base, metric)] != 0.0:
                            ratio = value / index[(base, metric)]
                        rows.append(
                            {
                                "name": name,
                                "metric": metric,
                                "value": float(value),
                                "unit": unit,
                                "baseline": base,
                                "ratio": ratio,
                                "detail": detail,
                            }
                        )
                        index[(name, metric)] = float(value)
    shape = MODEL_SHAPES[model]
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "benchmark": "dcp",
        "created_utc": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()},
        "libraries": _library_versions(),
        "config": {
            "model": model,
            "parameters": shape.parameter_count(),
            "ranks": list(ranks),
            "optimizer": optimizer,
            "chunk_bytes": chunk_bytes,
            "threads": threads,
            "batch_size": batch_size,
            "sequence_length": sequence_length,
            "with_model": with_model,
            "malloc_env": MALLOC_ENV,
        },
        "notes": [
            "peak = resident-set high-water mark (or 1 ms samples) above the resident size just before the operation, "
            "on the worst rank, per parameter held by that rank",
            "async_save is timed and measured from the call until the write completed",
            "load goes into a freshly built model and optimizer, so its peak includes the state it allocates",
            "checkpoints hold the optimizer only unless config.with_model (then DCP also stages the model for async "
            "saves: 4 B/param of fp32 parameters in either arm)",
        ],
        "rows": rows,
    }


def render_table(report: dict[str, Any]) -> str:
    """One line per row: name, metric, value, unit, ratio against the baseline."""
    lines = [f"{'name':<40} {'metric':<32} {'value':>12} {'unit':<8} {'vs baseline':>11}"]
    for row in report["rows"]:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.3f}x"
        lines.append(f"{row['name']:<40} {row['metric']:<32} {row['value']:>12.4f} {row['unit']:<8} {ratio:>11}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--worker"]:
        spec = WorkerSpec(**json.loads(Path(args[1]).read_text(encoding="utf-8")))
        result = _worker(spec, int(args[2]))
        Path(args[3]).write_text(json.dumps(result), encoding="utf-8")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="decoder-50m", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--optimizer", default=DEFAULT_OPTIMIZER, help="MODULE:FACTORY of a DenseShardCodec optimizer")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="GefenDCPState chunk_bytes (default: its own)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--with-model", action="store_true", help="save the model beside the optimizer")
    parser.add_argument("--json", type=Path, default=None, help="write the gefen.bench v1 report here")
    options = parser.parse_args(args)
    report = run_benchmark(
        model=options.model,
        ranks=options.ranks,
        optimizer=options.optimizer,
        chunk_bytes=options.chunk_bytes,
        threads=options.threads,
        batch_size=options.batch_size,
        sequence_length=options.sequence_length,
        with_model=options.with_model,
        progress=lambda text: print(f"done: {text}", file=sys.stderr),
    )
    print(render_table(report))
    if options.json is not None:
        options.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if any(not math.isfinite(row["value"]) for row in report["rows"]):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

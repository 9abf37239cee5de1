"""Run a benchmark on ``world_size`` fresh processes joined in one gloo group on 127.0.0.1.

``run_ranks(module, spec, world_size)`` starts ``python -m MODULE SPEC.json RANK RESULT.json``
once per rank (with the rendezvous port in the spec as ``port``), waits for all of them and
returns each rank's JSON result. Per-rank peak memory is a per-process quantity, so every
measurement runs in processes of its own; glibc is told to map large blocks directly so a
transient shows up as resident growth. :func:`join_group` is the rank side.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .fresh_process import FreshProcessError

__all__ = ["MALLOC_ENV", "free_port", "join_group", "read_rank_arguments", "run_ranks", "write_rank_result"]

#: Large blocks are mmapped and returned on free, so transient buffers show up as resident growth.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    module: str, spec: Mapping[str, Any], world_size: int, *, threads: int = 1, label: str = ""
) -> list[dict[str, Any]]:
    """Run ``module`` on ``world_size`` ranks and return their results in rank order."""
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    with tempfile.TemporaryDirectory(prefix="gefen-ranks-") as scratch:
        spec_path = Path(scratch) / "spec.json"
        spec_path.write_text(json.dumps({**spec, "port": free_port(), "world_size": world_size}), encoding="utf-8")
        env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": str(threads)}
        results = [Path(scratch) / f"rank{rank}.json" for rank in range(world_size)]
        processes = []
        try:
            for rank in range(world_size):
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module, str(spec_path), str(rank), str(results[rank])],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        start_new_session=True,  # as run_fresh's child: Ctrl-C stops them through this process
                    )
                )
            codes = [process.wait() for process in processes]
        except BaseException:
            for process in processes:
                process.kill()
                process.wait()
            raise
        if any(codes) or not all(path.exists() for path in results):
            raise FreshProcessError(
                f"{label or module} on {world_size} rank(s) failed (exit codes {codes}; the error is printed above)"
            )
        return [json.loads(path.read_text(encoding="utf-8")) for path in results]


def read_rank_arguments(argv: list[str]) -> tuple[dict[str, Any], int, Path]:
    """The rank side's ``(spec, rank, result path)`` from ``SPEC.json RANK RESULT.json``."""
    if len(argv) != 3:
        raise SystemExit("usage: python -m MODULE SPEC.json RANK RESULT.json")
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    return spec, int(argv[1]), Path(argv[2])


def write_rank_result(path: Path, result: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(dict(result)), encoding="utf-8")


def join_group(spec: Mapping[str, Any], rank: int, *, timeout_s: float = 600.0) -> None:
    """Join the gloo group of :func:`run_ranks` (``torch.set_num_threads`` from ``spec["threads"]``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(spec.get("threads") or 1))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=int(spec["world_size"]),
        timeout=timedelta(seconds=timeout_s),
    )

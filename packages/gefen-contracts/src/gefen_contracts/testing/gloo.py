"""A reusable multi-process gloo world for distributed checks on CPU.

Spawning ranks costs seconds, so one :class:`GlooWorld` runs many cases: each
:meth:`GlooWorld.run` sends ``fn(rank, world_size, *args, **kwargs)`` to every rank and
collects the results. Ranks use ``torch.set_num_threads(1)``, a gloo timeout of at most 60 s
(so a hang fails a test instead of the run) and TCP rendezvous on 127.0.0.1. ``fn`` must be
importable in a fresh interpreter: a module-level function, or ``"MODULE:FUNCTION"``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from .target import import_attribute

__all__ = ["GlooWorld", "RankFailure", "RankOutcome", "resolve_callable"]

_MAX_GLOO_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankOutcome:
    """What one rank returned or raised for one case."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    message: str = ""
    traceback: str = ""


class RankFailure(AssertionError):
    """At least one rank raised; ``outcomes`` holds every rank's result."""

    def __init__(self, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        lines = [f"rank {o.rank}: {o.error_type}: {o.message}\n{o.traceback}" for o in outcomes if not o.ok]
        super().__init__("distributed case failed:\n" + "\n".join(lines))


def resolve_callable(spec: str) -> Callable[..., Any]:
    return import_attribute(spec)  # type: ignore[no-any-return]


def _spec_of(fn: Callable[..., Any] | str) -> str:
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"{fn!r} is not importable by spawned ranks; use a module-level function")
    return f"{module}:{qualname}"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    gloo_timeout_s: float,
    env: dict[str, str],
    tasks: Any,
    results: Connection,
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=gloo_timeout_s),
    )
    results.send((0, RankOutcome(rank, True, "ready")))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            case_id, spec, args, kwargs = task
            try:
                outcome = RankOutcome(rank, True, resolve_callable(spec)(rank, world_size, *args, **kwargs))
            except BaseException as exc:
                outcome = _failure(rank, exc)
            try:
                results.send((case_id, outcome))
            except Exception as exc:  # the value did not pickle: report that instead of going silent
                results.send((case_id, _failure(rank, exc)))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _failure(rank: int, exc: BaseException) -> RankOutcome:
    return RankOutcome(rank, False, None, type(exc).__name__, str(exc), traceback.format_exc(limit=12))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GlooWorld:
    """``world_size`` spawned ranks joined in one gloo process group, reused across cases."""

    def __init__(
        self,
        world_size: int,
        *,
        gloo_timeout_s: float = 30.0,
        case_timeout_s: float = 180.0,
        startup_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if type(world_size) is not int or world_size < 1:
            raise ValueError("world_size must be a positive int")
        self.world_size = world_size
        self.gloo_timeout_s = min(float(gloo_timeout_s), _MAX_GLOO_TIMEOUT_S)
        self.case_timeout_s = case_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        # one pipe per rank, written synchronously: a rank that dies can hold no lock another rank's
        # result waits on (a shared mp.Queue's writer lock can be left held by an os._exit)
        self._results: list[Connection] = []
        self._case = 0

    def __enter__(self) -> GlooWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        ctx = mp.get_context("spawn")
        port = _free_port()
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._results = [reader for reader, _ in pipes]
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.gloo_timeout_s, self.env, self._tasks[rank], writer),
                daemon=True,
            )
            for rank, (_, writer) in enumerate(pipes)
        ]
        for proc, (_, writer) in zip(self._procs, pipes, strict=True):
            proc.start()
            writer.close()  # the rank holds the only writer, so its death reads as end-of-file here
        ready = self._collect(0, self.startup_timeout_s, "start up")
        failed = [o for o in ready if not o.ok]
        if failed:
            self.close()
            raise RankFailure(ready)

    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def run_outcomes(self, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> list[RankOutcome]:
        """Run ``fn`` on every rank and return each rank's outcome (raises only on timeout)."""
        self.start()
        spec = _spec_of(fn)
        self._case += 1
        case_id = self._case
        for task_queue in self._tasks:
            task_queue.put((case_id, spec, args, kwargs))
        return self._collect(case_id, self.case_timeout_s, spec)

    def _collect(self, case_id: int, timeout_s: float, what: str) -> list[RankOutcome]:
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                self.close()
                raise TimeoutError(f"ranks {missing} did not finish {what} within {timeout_s:.0f} s")
            pending = [r for r in range(self.world_size) if r not in outcomes]
            ready = wait([self._results[r] for r in pending], timeout=remaining)
            for rank in [r for r in pending if self._results[r] in ready]:
                try:
                    got: tuple[int, RankOutcome] = self._results[rank].recv()
                except (EOFError, OSError):  # end of file, possibly mid-message: the rank died
                    self._procs[rank].join(timeout=5.0)
                    code = self._procs[rank].exitcode
                    outcomes[rank] = RankOutcome(rank, False, None, "ProcessDied", f"exit code {code}")
                    continue
                if got[0] == case_id:
                    outcomes[rank] = got[1]
        if any(o.error_type == "ProcessDied" for o in outcomes.values()):
            self.close()
        return [outcomes[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank; return the per-rank values or raise :class:`RankFailure`."""
        outcomes = self.run_outcomes(fn, *args, **kwargs)
        if not all(o.ok for o in outcomes):
            raise RankFailure(outcomes)
        return [o.value for o in outcomes]

    def close(self) -> None:
        for task_queue in self._tasks:
            with contextlib.suppress(Exception):
                task_queue.put(None)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for reader in self._results:
            reader.close()
        self._procs = []
        self._tasks = []
        self._results = []

"""A reusable multi-process gloo world for distributed checks on CPU.

Starting ranks costs seconds, so one :class:`GlooWorld` runs many cases: each
:meth:`GlooWorld.run` sends ``fn(rank, world_size, *args, **kwargs)`` to every rank and
collects the results. On Linux, ranks are forked from a ``forkserver`` that imported torch
once (0.3-0.7 s to start and close a world of two or three, against 4.3-6.2 s for freshly
spawned interpreters that each import torch); each rank then takes this process's environment
and ``sys.path`` as they are when the world starts, as a spawned one would. Ranks use
``torch.set_num_threads(1)``, a gloo timeout of at most 60 s (so a hang fails a test instead
of the run) and TCP rendezvous on 127.0.0.1. ``fn`` must be
importable in a fresh interpreter: a module-level function, or ``"MODULE:FUNCTION"``.

Each rank's standard error goes to a file (with :mod:`faulthandler` on it), copied to this
process's standard error after every case, so a rank that dies of a signal (a C++ exception
in gloo, a crash in a kernel) is reported with the last lines it printed, not just its exit code.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
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
#: imported once by the forkserver (with torch, numpy, torch.distributed and DTensor, which they
#: import), so a forked rank starts without them: TorchDynamo is imported when any optimizer is
#: built, about 5 s of imports a rank. torch's only: a module the caller's environment can change
#: when it is imported (Triton's interpreter switch, gefen-kernels' compiler) is the rank's own.
_FORKSERVER_PRELOAD = ["torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp"]
_DEATH_LINES = 40  # lines of a dead rank's standard error quoted in its outcome


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
    log_path: str,
) -> None:
    # the whole environment of the starting process, not the forkserver's (started earlier)
    os.environ.clear()
    os.environ.update(env)
    # file descriptor 2 itself, so what C++ (gloo's terminate message) and C print is kept too
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 2)  # sys.stderr writes to descriptor 2 already
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):  # what a hung rank is doing, asked for before it is killed
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
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


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def _tail(path: str, lines: int) -> str:
    with contextlib.suppress(OSError), open(path, "rb") as handle:
        return "\n".join(handle.read().decode(errors="replace").splitlines()[-lines:])
    return ""


def _rank_context() -> Any:
    """``forkserver`` with torch preloaded on Linux, else ``spawn``."""
    # macOS has a forkserver, but forking a process whose imports started the Objective-C
    # runtime (torch loads Metal) can crash the child: Python spawns there by default for this
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)  # ignored once the server runs
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class GlooWorld:
    """``world_size`` rank processes joined in one gloo process group, reused across cases."""

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
        self._log_dir = ""
        self._log_offsets: list[int] = []

    def __enter__(self) -> GlooWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(check=exc[0] is None)  # an error in flight is not masked by a teardown one

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close(check=False)
        ctx = _rank_context()
        port = _free_port()
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.world_size)]
        self._results = [reader for reader, _ in pipes]
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._log_dir = tempfile.mkdtemp(prefix="gefen-gloo-")
        self._log_offsets = [0] * self.world_size
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    port,
                    self.gloo_timeout_s,
                    {**os.environ, **self.env},
                    self._tasks[rank],
                    writer,
                    self._log_path(rank),
                ),
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
            self.close(check=False)
            raise RankFailure(ready)

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def _forward_logs(self) -> None:
        """Copy what each rank printed since the last case to this process's standard error."""
        for rank in range(len(self._log_offsets)):
            with contextlib.suppress(OSError), open(self._log_path(rank), "rb") as handle:
                handle.seek(self._log_offsets[rank])
                text = handle.read()
                self._log_offsets[rank] += len(text)
                if text:
                    sys.stderr.write(f"[rank {rank}] " + text.decode(errors="replace"))

    def _stacks_of(self, ranks: list[int]) -> str:
        """The Python stacks of hung ranks (faulthandler, on SIGUSR1), as the timeout's text."""
        if not hasattr(signal, "SIGUSR1"):
            return ""
        for rank in ranks:
            with contextlib.suppress(OSError):
                os.kill(int(self._procs[rank].pid), signal.SIGUSR1)
        time.sleep(1.0)
        return "".join(f"\n--- rank {r} ---\n{_tail(self._log_path(r), _DEATH_LINES)}" for r in ranks)

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
                stacks = self._stacks_of(missing)
                self.close(check=False)
                raise TimeoutError(f"ranks {missing} did not finish {what} within {timeout_s:.0f} s{stacks}")
            pending = [r for r in range(self.world_size) if r not in outcomes]
            ready = wait([self._results[r] for r in pending], timeout=remaining)
            for rank in [r for r in pending if self._results[r] in ready]:
                try:
                    got: tuple[int, RankOutcome] = self._results[rank].recv()
                except (EOFError, OSError):  # end of file, possibly mid-message: the rank died
                    self._procs[rank].join(timeout=5.0)
                    said = _tail(self._log_path(rank), _DEATH_LINES)
                    message = _exit_text(self._procs[rank].exitcode)
                    outcomes[rank] = RankOutcome(rank, False, None, "ProcessDied", message, said)
                    continue
                if got[0] == case_id:
                    outcomes[rank] = got[1]
        self._forward_logs()
        if any(o.error_type == "ProcessDied" for o in outcomes.values()):
            self.close(check=False)
        return [outcomes[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank; return the per-rank values or raise :class:`RankFailure`."""
        outcomes = self.run_outcomes(fn, *args, **kwargs)
        if not all(o.ok for o in outcomes):
            raise RankFailure(outcomes)
        return [o.value for o in outcomes]

    def close(self, *, check: bool = True) -> None:
        """Stop every rank (each leaves the process group and exits).

        With ``check``, a rank that did not exit cleanly (it died, for example aborted by gloo
        on a collective mismatch, or hung and was killed) raises :class:`RankFailure`: an
        optimizer whose ranks disagree on their last collectives fails here instead of
        vanishing with the processes.
        """
        for task_queue in self._tasks:
            with contextlib.suppress(Exception):
                task_queue.put(None)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(self._procs) if proc.is_alive()]
        stacks = self._stacks_of(hung) if hung and check else ""
        for rank in hung:
            self._procs[rank].kill()
            self._procs[rank].join(timeout=5.0)
        failed = [
            RankOutcome(
                rank,
                False,
                None,
                "TeardownFailure",
                "hung while leaving the process group (killed)" if rank in hung else _exit_text(proc.exitcode),
                stacks if rank in hung else _tail(self._log_path(rank), _DEATH_LINES),
            )
            for rank, proc in enumerate(self._procs)
            if rank in hung or proc.exitcode != 0
        ]
        for reader in self._results:
            reader.close()
        if self._log_dir:
            self._forward_logs()
            shutil.rmtree(self._log_dir, ignore_errors=True)
        self._procs = []
        self._tasks = []
        self._results = []
        self._log_dir = ""
        self._log_offsets = []
        if check and failed:
            raise RankFailure(failed)

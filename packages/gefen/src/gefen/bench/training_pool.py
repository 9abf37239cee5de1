"""Independent training runs spread over worker processes with one thread each.

On a small machine, one single-threaded run per core is faster than one run using every
core (no thread synchronisation, and no collapse when other work shares the machine), and
the results do not depend on the number of workers: each run is seeded and deterministic.
``workers=1`` runs in this process.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..demo.data import load_corpus
from ..demo.model import preset
from ..demo.train import TrainConfig, train

__all__ = ["JobResult", "TrainJob", "run_jobs"]


@dataclass(frozen=True, slots=True)
class TrainJob:
    """One run: a model preset on a corpus (:data:`gefen.demo.data.CORPORA`) with a training config."""

    model_size: str
    corpus: str
    config: TrainConfig

    @property
    def label(self) -> str:
        return f"{self.config.optimizer} lr={self.config.lr:g} seed={self.config.seed}"


@dataclass(frozen=True, slots=True)
class JobResult:
    """Final losses (``inf`` when diverged) and throughput of one run."""

    valid_loss: float
    test_loss: float
    tokens_per_s: float
    optimizer_step_s: float
    diverged: bool


def _execute(job: TrainJob) -> JobResult:
    data = load_corpus(job.corpus)
    result = train(preset(job.model_size), data, job.config)
    return JobResult(
        valid_loss=result.final_loss["valid"],
        test_loss=result.final_loss["test"],
        tokens_per_s=result.tokens_per_s,
        optimizer_step_s=result.optimizer_step_s,
        diverged=result.diverged,
    )


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    # a terminal's Ctrl-C reaches every process of its group: the pool's owner stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_jobs(
    jobs: Sequence[TrainJob], *, workers: int = 1, threads: int = 1, on_done: Callable[[TrainJob], None] | None = None
) -> list[JobResult]:
    """Run ``jobs`` (results in job order); ``on_done(job)`` is called as each one finishes."""
    if type(workers) is not int or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if type(threads) is not int or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    notify = on_done or (lambda _job: None)
    if workers == 1:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results = []
            for job in jobs:
                results.append(_execute(job))
                notify(job)
            return results
        finally:
            torch.set_num_threads(previous)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(threads,)
    ) as pool:
        futures: dict[Future[JobResult], int] = {pool.submit(_execute, job): index for index, job in enumerate(jobs)}
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    if future.exception() is not None:  # re-raise a failed run now, not after the queue
                        pool.shutdown(wait=False, cancel_futures=True)
                        future.result()
                    notify(jobs[futures[future]])
        except KeyboardInterrupt:  # stop the running jobs too: leaving the pool would wait for them
            for process in list(pool._processes.values()):
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        return [future.result() for future in sorted(futures, key=futures.__getitem__)]

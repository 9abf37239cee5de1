"""Training runs in worker processes give the same results as in this process."""

from __future__ import annotations

import pytest
from gefen.bench.training_pool import TrainJob, run_jobs
from gefen.demo.train import TrainConfig


def _jobs() -> list[TrainJob]:
    return [
        TrainJob("tiny", "tinylang-char", TrainConfig("adamw", 3e-3, 3, batch_size=2, eval_windows=2, seed=seed))
        for seed in (0, 1, 2)
    ]


@pytest.mark.slow
def test_workers_do_not_change_results_or_order() -> None:
    finished: list[int] = []
    in_process = run_jobs(_jobs(), workers=1, on_done=lambda job: finished.append(job.config.seed))
    pooled = run_jobs(_jobs(), workers=2)
    assert finished == [0, 1, 2]
    assert [r.test_loss for r in pooled] == [r.test_loss for r in in_process]
    assert len({r.test_loss for r in pooled}) == 3  # different seeds, different runs


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="workers"):
        run_jobs([], workers=0)
    with pytest.raises(ValueError, match="threads"):
        run_jobs([], threads=0)
    assert run_jobs([], workers=1) == []


def test_a_failed_run_is_reported_without_running_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails is re-raised with the runs queued behind it cancelled: leaving ``with
    ProcessPoolExecutor`` ran every one of them first (hours, in ``gefen bench quality``).
    Threads stand in for the worker processes so the runs can be counted."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from gefen.bench import training_pool

    ran: list[int] = []
    lock = threading.Lock()

    def execute(job: TrainJob) -> object:
        if job.config.seed < 0:
            raise RuntimeError("this run fails")
        threading.Event().wait(0.2)
        with lock:
            ran.append(job.config.seed)
        return job

    def threads(max_workers: int, **_: object) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=max_workers)

    monkeypatch.setattr(training_pool, "_execute", execute)
    monkeypatch.setattr(training_pool, "ProcessPoolExecutor", threads)
    jobs = [TrainJob("tiny", "tinylang-char", TrainConfig("adamw", 3e-3, 3, seed=seed)) for seed in (-1, *range(10))]
    with pytest.raises(RuntimeError, match="this run fails"):
        run_jobs(jobs, workers=2)
    assert len(ran) <= 2  # the run beside the failed one, at most; not the ten queued

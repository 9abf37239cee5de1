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

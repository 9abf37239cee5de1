"""DDP and FSDP2 (``fully_shard``) with the default constructor, in two real gloo processes."""

from __future__ import annotations

import io
from collections.abc import Iterator

import gefen_core_distributed_cases as cases
import pytest
import torch
from gefen_contracts.testing import GlooWorld
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(2) as gloo:
        yield gloo


def _load(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)


def test_ddp_replicas_stay_bit_identical(world: GlooWorld) -> None:
    rank0, rank1 = world.run(cases.ddp_replicas)
    assert rank0["params"] == rank1["params"] and rank0["codebook"] == rank1["codebook"]
    assert rank0["gap"] < 0.1  # DDP's averaged gradient differs from one process only by rounding


@pytest.mark.parametrize(
    ("clip_threshold", "min_dim", "stochastic_round"),
    [(None, 0, False), (1.0, 0, False), (0.05, 0, False), (None, 128, False), (None, 0, True)],
    ids=["factored", "clipping", "always-clipping", "default-narrow", "stochastic-rounding"],
)
def test_fsdp2_default_constructor_trains_like_one_process(
    world: GlooWorld, clip_threshold: float | None, min_dim: int, stochastic_round: bool
) -> None:
    """Same batches on every rank: the averaged gradient is the one-process gradient, the
    mesh's codebook is learned from the whole histogram and blocks never cross a row, so
    FSDP2 is bit-identical to one process whose 1-D parameters keep per-element state
    (what a sharded 1-D parameter keeps, README "Distributed training"). Update clipping's
    statistic is summed over the row shards, so it clips exactly as one process does. With
    the default ``min_dim_size_to_factor`` these narrow matrices keep a per-element ``v``,
    row-sharded with the parameter and needing no collective. Stochastic rounding drew the same
    numbers on every shard (each started at element 0), so FSDP2 differed from one process."""
    results = world.run(cases.fsdp_parity, clip_threshold, min_dim, stochastic_round)
    for rank, result in enumerate(results):
        for name, gap in result["gaps"].items():
            assert gap == 0.0, f"rank {rank}: {name} moved {gap:.3e} (relative) away from one process"
        assert result["preflight_collectives"] == 0
        if min_dim:
            assert result["element"] == result["two_d"] and not result["replicated"]
            continue
        assert result["replicated"] and all(result["replicated"].values()), "v_col must be identical on every rank"
        assert sorted(result["col_gaps"]) == result["two_d"]  # every 2-D weight, the empty shard included
        for name, gap in {**result["col_gaps"], **result["row_gaps"]}.items():
            assert gap < 1e-6, f"{name}: sharded factored statistics differ from one process by {gap:.2e}"
    assert results[0]["gaps"] == results[1]["gaps"]


def test_fsdp2_rank_local_checkpoints_resume_exactly(world: GlooWorld) -> None:
    for result in world.run(cases.fsdp_checkpoints):
        assert result["native"], "native rank-local resume must be bit-exact"
        assert result["dcp"], "get/set_optimizer_state_dict resume must be bit-exact"


def test_a_failure_or_a_different_set_of_gradients_on_one_rank_raises_on_every_rank(world: GlooWorld) -> None:
    rank0, rank1 = world.run(cases.fsdp_failures_and_presence)
    assert rank0["failure"] == {"type": "CollectiveFailureError", "local": True, "cause": "GradientError"}
    assert rank1["failure"] == {"type": "CollectiveFailureError", "local": False, "cause": None}
    for result in (rank0, rank1):
        assert result["failure_unchanged"] and result["presence_unchanged"]
        assert result["presence"]["type"] == "ShardAgreementError"
        assert "'0.weight' (1/2 members)" in result["presence"]["message"]
        assert result["trained_on"] == 2

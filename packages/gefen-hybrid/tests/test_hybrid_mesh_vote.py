"""On a 2x2 device mesh (4 gloo ranks), a failure on one rank reaches all four in one vote
pass: the flag travels mesh dimension by mesh dimension. The vote is exercised directly
(the composite's step calls exactly these two functions), without optimizers, to keep the
4-process case cheap."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from gefen_contracts import CollectiveFailureError
from gefen_contracts.testing import GlooWorld
from gefen_contracts.torch_support import CollectiveCounter
from gefen_hybrid import STEP_PHASE
from gefen_hybrid.failure_vote import step_vote_groups, vote_failure

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _holders(mesh: Any) -> list[Any]:
    """Two stand-in children whose param groups hold DTensors on ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    matrix = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0), Replicate()])
    bias = distribute_tensor(torch.zeros(6), mesh, [Replicate(), Shard(0)])
    return [SimpleNamespace(param_groups=[{"params": [matrix]}]), SimpleNamespace(param_groups=[{"params": [bias]}])]


def rank_vote_on_a_2d_mesh(rank: int, world_size: int, failing: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicas", "shards"))
    groups = step_vote_groups(_holders(mesh))  # type: ignore[arg-type]
    counter = CollectiveCounter()
    with counter.patched():
        vote_failure(groups, STEP_PHASE, None)
    healthy_votes = counter.total
    error = ValueError("bad gradient here") if rank == failing else None
    try:
        vote_failure(groups, STEP_PHASE, error)
    except CollectiveFailureError as exc:
        return {"raised": True, "local": exc.local, "phase": exc.phase, "votes": healthy_votes}
    return {"raised": False, "votes": healthy_votes}


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(4) as spawned:
        yield spawned


@pytest.mark.parametrize("failing", [0, 3])
def test_a_failure_on_one_rank_of_a_2d_mesh_reaches_every_rank(world: GlooWorld, failing: int) -> None:
    outcomes = world.run(rank_vote_on_a_2d_mesh, failing)
    for rank, outcome in enumerate(outcomes):
        assert outcome["votes"] == 2  # one all_reduce per mesh dimension
        assert outcome["raised"], f"rank {rank} did not learn of the failure on rank {failing}"
        assert outcome["phase"] == STEP_PHASE
        assert outcome["local"] is (rank == failing)

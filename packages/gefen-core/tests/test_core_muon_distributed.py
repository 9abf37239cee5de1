"""GefenMuon under FSDP2 / DTensor in two and three real gloo processes: parity, votes, resume.

Stated results (asserted below): ``"exact"`` and ``"distributed"`` are bit-identical on CPU to
one process fed the same full gradients, for even, uneven and empty row splits, with and
without NorMuon; ``"approx"`` trains (finite, moving) and differs from that oracle. A failure
on one rank before a collective makes every rank raise, each failing phase within the gloo
timeout and (up to the AMP agreement) without mutation.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import gefen_core_muon_distributed_cases as cases
import pytest
import torch
from gefen_contracts.testing import GlooWorld
from gefen_core import GefenMuon
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.distributed

#: Stated bound for fully_shard end to end against one process on the same batch (FSDP2's
#: reduce-scatter averages two equal gradients, which is exact in fp32 for two ranks).
FSDP_EXACT_BOUND = 1e-5


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(2, gloo_timeout_s=30.0) as gloo:
        yield gloo


@pytest.fixture(scope="module")
def world3() -> Iterator[GlooWorld]:
    with GlooWorld(3, gloo_timeout_s=30.0) as gloo:
        yield gloo


@pytest.mark.parametrize("mode", ["exact", "distributed"])
@pytest.mark.parametrize(
    ("case", "normuon"), [("even", False), ("uneven", False), ("empty", False), ("even", True), ("uneven", True)]
)
def test_exact_and_distributed_are_bit_identical_to_one_process(
    world: GlooWorld, mode: str, case: str, normuon: bool
) -> None:
    results = world.run(cases.parity, mode, case, normuon)
    for rank, result in enumerate(results):
        assert result["bitwise"], f"rank {rank}: max abs diff {result['max_abs']:.3e}"
        assert result["finite"] and result["moved"]
    assert results[0]["codebook"] == results[1]["codebook"]
    prefix = "quantized_normuon" if normuon else "quantized_muon"
    if mode == "exact":
        assert all(r["variants"] == [[f"{prefix}_global"]] * 2 for r in results)
    else:  # owners 0 and 1: each rank holds the state of the matrix it owns, whole
        assert results[0]["variants"] == [[f"{prefix}_owner"], []]
        assert results[1]["variants"] == [[], [f"{prefix}_owner"]]
        rows = [results[0]["state_rows"][0], results[1]["state_rows"][1]]
        assert rows == [r * c for r, c in cases.SHAPES[case]]


@pytest.mark.parametrize("case", ["even", "uneven", "empty"])
def test_approx_trains_on_local_rows_and_is_not_the_oracle(world: GlooWorld, case: str) -> None:
    results = world.run(cases.parity, "approx", case, False)
    for result in results:
        assert result["finite"] and result["moved"] and not result["bitwise"] and result["max_abs"] > 1e-6
        assert all(v in ([], ["quantized_muon_local"]) for v in result["variants"])
    (rows, cols), _ = cases.SHAPES[case]
    assert [r["state_rows"][0] for r in results] == [
        n * cols for n in (-(-rows // 2), rows - -(-rows // 2))
    ] or case == "empty"


@pytest.mark.parametrize("mode", ["exact", "distributed", "approx"])
def test_fully_shard_end_to_end(world: GlooWorld, mode: str) -> None:
    for result in world.run(cases.fsdp_model, mode):
        if mode == "approx":
            assert result["max_abs"] > 0
        else:
            assert result["max_abs"] <= FSDP_EXACT_BOUND


def test_collective_budget(world: GlooWorld) -> None:
    exact = world.run(cases.collectives, "exact")
    distributed = world.run(cases.collectives, "distributed")
    approx = world.run(cases.collectives, "approx")
    for result in exact + distributed + approx:
        assert result["preflight"] == 0
    # one preflight vote + one agreement all_gather (exact gathers each matrix through DTensor)
    assert all(r["step"] == {"all_reduce": 1, "all_gather": 1} for r in exact)
    # owners [0, 1, 0] make two buckets: a gather vote, an all_to_all, a broadcast vote, an all_to_all each
    assert all(r["step"] == {"all_reduce": 5, "all_gather": 1, "all_to_all_single": 4} for r in distributed)
    assert all(r["step"] == {} for r in approx)


FAULTS = ["entry checks", "entry checks without closure", "closure", "gradient preflight", "amp"]


@pytest.mark.parametrize("mode", ["exact", "distributed"])
@pytest.mark.parametrize("where", FAULTS)
def test_a_failure_on_one_rank_before_a_collective_raises_on_every_rank(
    world: GlooWorld, mode: str, where: str
) -> None:
    rank0, rank1 = world.run(cases.fault, mode, where)
    assert rank0["error"] and rank1["error"], (rank0, rank1)
    assert rank0["unchanged"] and rank1["unchanged"]
    if where == "amp":
        assert rank0["scaler_dropped"] and rank1["scaler_dropped"]  # a retry unscales once
        assert rank0["error"] == rank1["error"] == "ShardAgreementError"
        assert rank0["message"] == rank1["message"] and "group-aware gradient scaler" in rank0["message"]
        return
    phase = "entry checks" if where in ("entry checks", "closure") and where == "entry checks" else "step preflight"
    assert rank0["error"] == rank1["error"] == "CollectiveFailureError"
    assert f"GefenMuon {phase} failed on local member 'rank 0'" in rank0["message"]
    assert rank1["message"] == f"GefenMuon {phase} failed on another process-group member"
    expected = {"closure": "closure boom", "gradient preflight": "not finite"}.get(where, "learning rate")
    assert expected in rank0["message"]


@pytest.mark.parametrize("mode", ["exact", "distributed"])
def test_a_non_finite_gradient_after_learning_is_taken_on_every_rank_whichever_rank_holds_it(
    world: GlooWorld, mode: str
) -> None:
    """Once the codebook is learned nothing is learned from a gradient: "exact" and one process
    take a NaN (the matrix becomes NaN, as with torch's Muon). "distributed" refused it on
    every rank when it lay in a non-owner's rows (a non-owner holds no state, so it took every
    gradient for a first one) and took it in the owner's: it now takes it alike."""
    rank0, rank1 = world.run(cases.late_nan, mode)
    assert rank0["error"] is None and rank1["error"] is None, (rank0["error"], rank1["error"])
    assert rank0["finite"] == rank1["finite"] == [False, True, True]
    values0, values1 = cases.load(rank0["values"]), cases.load(rank1["values"])
    for a, b in zip(values0[1:], values1[1:], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["bucket gather", "update broadcast"])
def test_a_failure_inside_the_distributed_exchange_raises_on_every_rank(world: GlooWorld, where: str) -> None:
    rank0, rank1 = world.run(cases.fault, "distributed", where)
    assert rank0["error"] == rank1["error"] == "CollectiveFailureError"
    assert f"GefenMuon {where} failed on local member 'rank 0'" in rank0["message"]
    assert "injected fault on rank 0" in rank0["message"]
    assert rank1["message"] == f"GefenMuon {where} failed on another process-group member"
    if where == "bucket gather":  # the first bucket's gather: nothing was touched yet
        assert rank0["unchanged"] and rank1["unchanged"]
    else:  # owners changed state before the broadcast failed: the step counts on every rank alike
        assert rank0["global_step"] == rank1["global_step"] == 2


@pytest.mark.parametrize("mode", ["exact", "distributed"])
def test_gradient_presence_must_agree(world: GlooWorld, mode: str) -> None:
    rank0, rank1 = world.run(cases.presence, mode)
    assert rank0["error"] == rank1["error"] == "ShardAgreementError"
    assert rank0["message"] == rank1["message"] and "(1/2 mesh ranks have gradients)" in rank0["message"]
    assert rank0["unchanged"] and rank1["unchanged"]


def test_codebooks_must_agree(world: GlooWorld) -> None:
    rank0, rank1 = world.run(cases.presence, "exact", "codebook")
    assert rank0["error"] == rank1["error"] == "ShardAgreementError"
    assert rank0["message"] == rank1["message"] and "different codebooks" in rank0["message"]
    assert rank0["unchanged"] and rank1["unchanged"]


def _load(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)


@pytest.mark.parametrize("mode", ["exact", "distributed", "approx"])
def test_same_topology_resume_is_bit_exact(world: GlooWorld, mode: str) -> None:
    results = world.run(cases.resume, mode)
    for result in results:
        assert result["bitwise"]
        if mode == "approx":
            assert "topology" in result["foreign"] and not result["identical_dicts"]
        else:  # whole-matrix state: every rank's checkpoint is the same, consolidated one
            assert result["foreign"] == "" and result["identical_dicts"]
            assert result["saved_states"] == [0, 1, 2]
    if mode == "distributed":
        assert [r["owned_states"] for r in results] == [[0, 2], [1]]


@pytest.mark.parametrize("mode", ["exact", "distributed"])
def test_resume_in_one_process_from_two_ranks(world: GlooWorld, mode: str) -> None:
    result = world.run(cases.resume, mode)[0]
    at_two = _load(result["at_two"])
    params = [torch.nn.Parameter(value.clone()) for value in at_two]  # type: ignore[attr-defined]
    opt = GefenMuon(cases.named_pairs(params), lr=cases.LR, normuon=True, sharded_mode=mode, fused=False)  # type: ignore[arg-type]
    opt.load_state_dict(_load(result["checkpoint"]))  # type: ignore[arg-type]
    assert all(opt.state.get(p) for p in params)
    cases.train(opt, params, 2, 2, None)
    assert all(torch.equal(a, b) for a, b in zip(cases.full_values(params), _load(result["final"])))  # type: ignore[call-overload]


def test_owner_manifest_corruptions_are_refused(world: GlooWorld) -> None:
    for result in world.run(cases.manifest_corruptions):
        assert all(outcome == "ok" for outcome in result.values()), result


@pytest.mark.parametrize("mode", ["exact", "distributed"])
def test_two_rank_checkpoint_resumes_on_three_ranks(world: GlooWorld, world3: GlooWorld, mode: str) -> None:
    saved = world.run(cases.resume, mode)[0]
    results = world3.run(cases.load_checkpoint, saved["checkpoint"], saved["at_two"], mode)
    final = _load(saved["final"])
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(_load(result["final"]), final))  # type: ignore[call-overload]
    if mode == "distributed":  # three matrices, three owners
        assert [r["owned"] for r in results] == [[0], [1], [2]]
    else:
        assert all(r["owned"] == [0, 1, 2] for r in results)


@pytest.mark.parametrize("mode", ["exact", "distributed"])
@pytest.mark.parametrize("case", ["uneven", "empty"])
def test_three_ranks_are_bit_identical_to_one_process(world3: GlooWorld, mode: str, case: str) -> None:
    for rank, result in enumerate(world3.run(cases.parity, mode, case, True)):
        assert result["bitwise"], f"rank {rank}: max abs diff {result['max_abs']:.3e}"


@pytest.mark.parametrize("mode", ["exact", "distributed"])  # approx learns locally: no collective
def test_a_plain_matrix_with_a_gradient_on_one_rank_learns_on_every_rank(world: GlooWorld, mode: str) -> None:
    """Only the ranks with an active matrix used to learn the codebook: the others returned from
    step() and met the learning's vote with their next collective (gloo SIGABRT)."""
    rank0, rank1 = world.run(cases.local_gradient_on_one_rank, mode)
    assert rank0["after"] == rank1["after"] == 16.0
    assert torch.equal(cases.load(rank0["codebook"]), cases.load(rank1["codebook"]))

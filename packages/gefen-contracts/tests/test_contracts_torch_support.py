from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch
from gefen_contracts import CodecError, ContractError, ContractTypeError
from gefen_contracts.digest import canonical_digest
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.testing import GlooWorld, RankFailure
from gefen_contracts.torch_support import (
    CheckpointProcessGroupBinding,
    CodebookProcessGroupBinding,
    export_with_hooks,
    load_with_hooks,
    names_mismatch,
    routing_mismatch,
    tensor_digest,
)


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(2, gloo_timeout_s=20, case_timeout_s=60) as w:
        yield w


def test_binding_construction_rules() -> None:
    solo = ProcessGroupIdentity("solo", ("m0",))
    binding = CodebookProcessGroupBinding(solo, "m0", None, "cpu")
    assert binding.collective_device == torch.device("cpu") and not binding.communicates
    assert binding.sort_key == ("solo", ("m0",))
    assert binding.scope_record() == {"semantic_name": "solo", "ordered_members": ["m0"]}
    twin = CheckpointProcessGroupBinding(solo, "m0", None, torch.device("cpu"))
    assert binding.same_scope(twin) and twin.same_scope(binding)
    binding.validate_runtime()
    with pytest.raises(ContractError, match="process_group=None"):
        CodebookProcessGroupBinding(solo, "m0", object(), "cpu")
    with pytest.raises(ContractError, match="not a member"):
        CodebookProcessGroupBinding(solo, "m9", None, "cpu")
    with pytest.raises(ContractTypeError):
        CodebookProcessGroupBinding(solo, 0, None, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="cpu or cuda"):
        CodebookProcessGroupBinding(solo, "m0", None, "meta")
    with pytest.raises(ContractTypeError, match="device"):
        CodebookProcessGroupBinding(solo, "m0", None, "not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="does not exist"):
            CodebookProcessGroupBinding(solo, "m0", None, "cuda:0").validate_runtime()


def test_tensor_digest_is_dtype_shape_and_bit_sensitive() -> None:
    base = tensor_digest({"t": torch.tensor([1.0, -0.0], dtype=torch.float32)})
    assert base != tensor_digest({"t": torch.tensor([1.0, 0.0], dtype=torch.float32)})
    assert base != tensor_digest({"t": torch.tensor([1.0, -0.0], dtype=torch.float64)})
    assert base != tensor_digest({"t": torch.tensor([[1.0, -0.0]], dtype=torch.float32)})
    strided = torch.arange(12, dtype=torch.int16).reshape(3, 4)[:, ::2]
    assert tensor_digest(strided) == tensor_digest(strided.contiguous())
    assert tensor_digest(torch.tensor(3 + 4j, dtype=torch.complex64)) == tensor_digest(
        torch.tensor(3 + 4j, dtype=torch.complex64)
    )
    # golden: int16 [1, -2] under the grammar
    assert tensor_digest(torch.tensor([1, -2], dtype=torch.int16)) == canonical_digest(_Leaf())
    with pytest.raises(CodecError):
        canonical_digest(torch.zeros(2))


class _Leaf:
    def digest_dtype(self) -> str:
        return "int16"

    def digest_shape(self) -> tuple[int, ...]:
        return (2,)

    def digest_nbytes(self) -> int:
        return 4

    def digest_chunks(self) -> Iterator[bytes]:
        yield b"\x01\x00"
        yield b"\xfe\xff"


@pytest.mark.distributed
def test_launcher_reuses_one_world_for_many_cases(world: GlooWorld) -> None:
    pids = world.pids()
    assert world.run("contracts_gloo_ranks:echo", 4) == [(0, 2, 40), (1, 2, 40)]
    assert world.run("contracts_gloo_ranks:plain_all_reduce") == [3, 3]
    assert world.pids() == pids
    with pytest.raises(RankFailure, match="boom on 1"):
        world.run("contracts_gloo_ranks:raise_on", 1)
    assert world.run("contracts_gloo_ranks:echo", 1) == [(0, 2, 10), (1, 2, 10)]
    # a result that cannot travel back is reported as that rank's failure, not lost to a timeout
    bad, good = world.run_outcomes("contracts_gloo_ranks:unpicklable_on", 0)
    assert not bad.ok and "pickle" in bad.message and good.ok and good.value == 1
    assert world.pids() == pids


@pytest.mark.distributed
def test_bindings_validate_against_the_live_group(world: GlooWorld) -> None:
    for outcome in world.run("contracts_gloo_ranks:validate_bindings"):
        assert outcome == ["ok", "order:named", "size:named", "handle"]


@pytest.mark.distributed
def test_failure_vote_is_symmetric(world: GlooWorld) -> None:
    local, remote = world.run("contracts_gloo_ranks:vote_with_fault", 0, "step preamble")
    assert local.startswith("True|step preamble failed on local member 'rank:0'") and "closure boom" in local
    assert remote == "False|step preamble failed on another process-group member"
    assert world.run("contracts_gloo_ranks:vote_with_fault", -1, "x") == ["no error", "no error"]
    local_g, remote_g = world.run("contracts_gloo_ranks:vote_on_group_with_fault", 1)[::-1]
    assert local_g.startswith("True|preflight failed on local member 'rank:1'")
    assert remote_g == "False|preflight failed on another process-group member"


@pytest.mark.distributed
def test_agreement_and_collective_counter(world: GlooWorld) -> None:
    assert world.run("contracts_gloo_ranks:agreement", False) == ["ok|2", "ok|2"]
    for outcome in world.run("contracts_gloo_ranks:agreement", True):
        assert outcome.startswith("error|process-group members disagree on the step header") and outcome.endswith("|1")


@pytest.mark.distributed
def test_writes_through_a_dtensor_parameter_change_the_token_and_its_digest_is_refused(world: GlooWorld) -> None:
    """An FSDP2 parameter is a DTensor marked as a parameter. In-place ops through it bump the
    DTensor's version counter, not its local shard's, which the token read alone: a step, a
    state write or a ``copy_`` went unseen by a staged commit. Its digest raised torch's
    ``RuntimeError`` (``.numpy()`` of a subclass) where a DTensor's raises ``CodecError``."""
    for facts in world.run("contracts_gloo_ranks:dtensor_parameter_facts"):
        assert facts == {"changed": {"step": True, "state": True, "copy_": True}, "digest_error": "CodecError"}


@pytest.mark.distributed
def test_dtensor_from_local_is_what_torch_from_local_returns(world: GlooWorld) -> None:
    """The state dicts build their DTensors through ``dtensor_from_local`` (FSDP2's constructor,
    no autograd function): the same global shape, strides, placements, mesh, storage and
    ``requires_grad`` as ``DTensor.from_local`` for even, uneven, empty and replicated pieces."""
    assert world.run("contracts_gloo_ranks:dtensor_from_local_facts") == [[], []]


def test_a_hanging_case_times_out_and_a_dead_rank_is_reported() -> None:
    # 4 s flaked under a loaded full run (a live rank answered late)
    with GlooWorld(2, gloo_timeout_s=10, case_timeout_s=8) as world:
        with pytest.raises(TimeoutError, match="did not finish"):
            world.run("contracts_gloo_ranks:sleep_forever")
        assert world.run("contracts_gloo_ranks:echo", 2) == [(0, 2, 20), (1, 2, 20)]
        outcomes = world.run_outcomes("contracts_gloo_ranks:die", 0)
        assert outcomes[0].error_type == "ProcessDied" and outcomes[1].ok


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_is_reported_with_what_it_printed_and_its_stack(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with GlooWorld(2) as world:
        outcomes = world.run_outcomes("contracts_gloo_ranks:abort_after_saying", 1, "terminate called: bad preamble")
    assert outcomes[0].ok and outcomes[1].error_type == "ProcessDied"
    assert outcomes[1].message == "exit code -6 (SIGABRT)"
    # the C-level message and faulthandler's Python stack of the dying rank
    assert "terminate called: bad preamble" in outcomes[1].traceback
    assert "Fatal Python error: Aborted" in outcomes[1].traceback
    assert "abort_after_saying" in outcomes[1].traceback
    assert "[rank 1] terminate called: bad preamble" in capfd.readouterr().err


@pytest.mark.distributed
def test_ranks_see_the_environment_as_it_is_when_the_world_starts(
    world: GlooWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the module's world has started the forkserver: a world started now must still see a variable
    # set since, and not one removed since, as freshly spawned ranks would
    monkeypatch.setenv("GEFEN_TEST_SET_LATER", "yes")
    monkeypatch.delenv("HOME", raising=False)
    with GlooWorld(2, env={"GEFEN_TEST_PASSED": "1"}) as fresh:
        seen = fresh.run("contracts_gloo_ranks:environment_of", ["GEFEN_TEST_SET_LATER", "HOME", "GEFEN_TEST_PASSED"])
    assert seen == [{"GEFEN_TEST_SET_LATER": "yes", "HOME": None, "GEFEN_TEST_PASSED": "1"}] * 2
    assert (
        world.run("contracts_gloo_ranks:environment_of", ["GEFEN_TEST_SET_LATER"])
        == [{"GEFEN_TEST_SET_LATER": None}] * 2
    )


@pytest.mark.distributed
def test_ranks_fork_from_the_forkserver_on_linux_and_are_spawned_elsewhere(
    world: GlooWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    forked = world.run("contracts_gloo_ranks:parent_pid")
    assert os.getpid() not in forked and len(set(forked)) == 1  # the forkserver's children
    monkeypatch.setattr(sys, "platform", "darwin")
    with GlooWorld(2) as spawned:
        assert spawned.run("contracts_gloo_ranks:parent_pid") == [os.getpid()] * 2
        assert spawned.run("contracts_gloo_ranks:echo", 3) == [(0, 2, 30), (1, 2, 30)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("how", "message", "seen"),
    [("exit", "exit code 7", ""), ("hang", "hung while leaving the process group (killed)", "contracts_gloo_ranks.py")],
)
def test_a_rank_that_leaves_badly_after_its_last_case_fails_the_close(how: str, message: str, seen: str) -> None:
    """A rank that dies or hangs once the cases are over (gloo aborts a rank at the next
    collective after a mismatch) used to vanish with the processes; ``close`` raises."""
    world = GlooWorld(2)
    with pytest.raises(RankFailure) as raised, world:
        assert world.run("contracts_gloo_ranks:leave_badly", 1, how) == [0, 1]
    failure = raised.value
    assert [(o.rank, o.error_type, o.message) for o in failure.outcomes] == [(1, "TeardownFailure", message)]
    assert seen in failure.outcomes[0].traceback  # a hung rank's stack, from faulthandler
    world.close()  # closed already: nothing left to fail


@pytest.mark.distributed
def test_a_hung_rank_s_stack_is_in_the_timeout() -> None:
    with GlooWorld(2, case_timeout_s=8) as world, pytest.raises(TimeoutError) as raised:
        world.run("contracts_gloo_ranks:sleep_forever")
    assert "--- rank 0 ---" in str(raised.value) and "sleep_forever" in str(raised.value)


def test_on_device_puts_exact_host_values_on_the_device_in_the_dtype_asked() -> None:
    from gefen_contracts.torch_support import on_device

    scalars = on_device([0.1, 2.0, -3.5], torch.float32, torch.device("cpu"))
    assert scalars.dtype is torch.float32 and scalars.device.type == "cpu"
    assert torch.equal(scalars, torch.tensor([0.1, 2.0, -3.5], dtype=torch.float32))
    seeds = on_device([(7 << 32) + 3, -1], torch.int64, torch.device("cpu"))
    assert seeds.tolist() == [(7 << 32) + 3, -1]


def test_expand_blocks_never_expands_past_the_piece_whatever_the_period() -> None:
    from gefen_contracts.torch_support import expand_blocks

    # a document may name any period; a run longer than the piece is one run of the piece
    # (the old expansion allocated period * blocks elements: 2**45 here)
    assert torch.equal(expand_blocks(torch.tensor([1.5]), 2**45, (3,)), torch.full((3,), 1.5))
    assert torch.equal(expand_blocks(torch.tensor([1.0, 2.0]), 2, (3,)), torch.tensor([1.0, 1.0, 2.0]))
    assert expand_blocks(torch.zeros(0), 2**45, (0, 4)).shape == (0, 4)


def test_load_with_hooks_runs_torch_s_hooks_in_order_around_the_load_on_a_copy() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    calls: list[str] = []

    def pre_edit(_: object, state_dict: dict[str, object]) -> None:
        calls.append("pre-edit")
        state_dict["edited"] = True  # edits the copy, never the caller's dict

    def pre_replace(_: object, state_dict: dict[str, object]) -> dict[str, object]:
        calls.append("pre-replace")
        return {**state_dict, "replaced": True}

    optimizer.register_load_state_dict_pre_hook(pre_edit)
    optimizer.register_load_state_dict_pre_hook(pre_replace)
    optimizer.register_load_state_dict_post_hook(lambda _: calls.append("post"))
    caller = {"original": True}
    loaded: list[dict[str, object]] = []
    load_with_hooks(optimizer, caller, lambda state_dict: (calls.append("load"), loaded.append(state_dict)))
    assert calls == ["pre-edit", "pre-replace", "load", "post"]
    assert loaded == [{"original": True, "edited": True, "replaced": True}]
    assert caller == {"original": True}


def test_export_with_hooks_runs_torch_s_hooks_in_order_and_a_post_hook_may_replace_the_result() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    calls: list[str] = []
    optimizer.register_state_dict_pre_hook(lambda _: calls.append("pre"))
    optimizer.register_state_dict_post_hook(lambda _, state_dict: calls.append("post-keep"))
    optimizer.register_state_dict_post_hook(lambda _, state_dict: {**state_dict, "replaced": True})
    result = export_with_hooks(optimizer, lambda: (calls.append("build"), {"built": True})[1])
    assert calls == ["pre", "build", "post-keep"]
    assert result == {"built": True, "replaced": True}


def test_names_mismatch_says_whether_the_names_only_moved() -> None:
    assert names_mismatch(("a", "b"), ["a", "b"]) is None
    moved = names_mismatch(["a.weight", "b.weight"], ["b.weight", "a.weight"])
    assert moved is not None and moved.startswith("the same names in another order")
    assert "parameter 0 is 'a.weight' in the checkpoint but 'b.weight' here" in moved
    assert "saving order" in moved
    renamed = names_mismatch(["a", "b"], ["a", "c"])
    assert (
        renamed
        == "parameter 1 is 'b' in the checkpoint but 'c' here; rename them with a load_state_dict pre-hook if the model really changed"
    )
    longer = names_mismatch(["a", "b"], ["a"])
    assert longer is not None and longer.startswith("the checkpoint names 2 parameters, this group 1")
    # a checkpoint's param_names that are not names at all are said so (it was a bare TypeError)
    assert names_mismatch(7, ["a"]) == "the checkpoint's param_names must be a list of str, got int 7"
    assert (
        names_mismatch(["a", 1], ["a", "b"]) == "the checkpoint's param_names must be a list of str, got list ['a', 1]"
    )


def test_routing_mismatch_names_a_wrapper_prefix_on_either_side_and_else_the_first_difference() -> None:
    plain = {"a.weight": "muon", "b": "backup"}
    wrapped = {"module." + fqn: role for fqn, role in plain.items()}
    assert routing_mismatch(dict(plain), plain) is None
    assert routing_mismatch(wrapped, plain).startswith(  # type: ignore[union-attr]
        "the checkpoint's parameter names are the others' under the prefix 'module.': the optimizer was built from "
        "a wrapped model on one side only"
    )
    assert routing_mismatch(plain, wrapped).startswith(  # type: ignore[union-attr]
        "this composite's parameter names are the others' under the prefix 'module.'"
    )
    # a role changed, no prefix
    assert (
        routing_mismatch(plain, {"a.weight": "backup", "b": "backup"})
        == "parameter 'a.weight' is routed to 'muon' in the checkpoint but to 'backup' here"
    )
    # not every name under the prefix
    assert (
        routing_mismatch({"x.a.weight": "muon", "b": "backup"}, plain)
        == "parameter 'a.weight' (role 'muon') is missing from the checkpoint's routing"
    )

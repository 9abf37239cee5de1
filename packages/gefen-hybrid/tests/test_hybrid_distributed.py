"""A real 2-rank gloo group: under FSDP2 (fully_shard on CPU) and over a child's collective
scope, a one-rank failure makes every rank raise the same error with nothing changed; the
DTensor claims of ContractedAdamW (training, same-topology native checkpoints) hold; a
composite bound to each rank's flattened slices trains like the full tensors and refuses the
other rank's canonical document."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gefen_contracts import CollectiveFailureError, StateValidationError
from gefen_contracts.testing import GlooWorld, deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CollectiveCounter
from gefen_hybrid import STEP_PHASE, CompositeOptimizer, ContractedAdamW
from hybrid_toys import ScopedSignMomentum, adamw_factory, sign_factory
from torch import nn

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(self.embed(tokens).mean(dim=1)))
        return self.out(self.norm(hidden))  # type: ignore[no-any-return]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 16, (4, 3), generator=generator)
    target = torch.randn(4, 4, generator=generator)
    return nn.functional.mse_loss(model(tokens), target)


def _models(world_size: int) -> tuple[nn.Module, nn.Module]:
    """An FSDP2-sharded model and an identical plain twin (same initial values)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    plain = copy.deepcopy(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, plain


def _composite(model: nn.Module) -> CompositeOptimizer:
    return CompositeOptimizer.from_factories(model, {"muon": sign_factory, "backup": adamw_factory})


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fingerprint(model: nn.Module, optimizer: CompositeOptimizer) -> dict[str, torch.Tensor]:
    """Local parameter shards and every child's state, cloned (gradients excluded)."""
    values = {f"param:{n}": _local(p).clone() for n, p in model.named_parameters()}
    for role, child in optimizer.child_optimizers().items():
        for index, (parameter, entry) in enumerate(child.state.items()):
            for key, value in entry.items():
                values[f"{role}:{index}:{key}:{id(parameter)}"] = _local(torch.as_tensor(value)).clone()
    return values


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _failure(run: Callable[[], object]) -> dict[str, Any]:
    try:
        run()
    except CollectiveFailureError as exc:
        return {"type": "CollectiveFailureError", "phase": exc.phase, "local": exc.local, "message": str(exc)}
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


# -- rank functions (module level: spawned ranks import this module) -------------------------------


def rank_training_matches_a_single_process_twin(rank: int, world_size: int) -> dict[str, Any]:
    model, plain = _models(world_size)
    optimizer, reference = _composite(model), _composite(plain)
    counter = CollectiveCounter()
    _train(model, optimizer, 2)
    optimizer.zero_grad()
    _loss(model, 2).backward()
    with counter.patched():
        optimizer.step()
    _train(plain, reference, 3)
    mismatched = [
        name
        for (name, sharded), (_, full) in zip(model.named_parameters(), plain.named_parameters())
        if not torch.equal(sharded.full_tensor(), full)
    ]
    return {"mismatched": mismatched, "collectives": dict(counter.calls), "routing": optimizer.parameter_routing()}


def rank_closure_fault_on_rank0(rank: int, world_size: int) -> dict[str, Any]:
    model, _ = _models(world_size)
    optimizer = _composite(model)
    _train(model, optimizer, 1)
    before = _fingerprint(model, optimizer)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _loss(model, 1)
        loss.backward()  # FSDP2's own collectives run on every rank first
        if rank == 0:
            raise RuntimeError("the loss looked wrong on rank 0")
        return loss

    outcome = _failure(lambda: optimizer.step(closure))
    outcome["unchanged"] = _same(before, _fingerprint(model, optimizer))
    _train(model, optimizer, 1, start=2)  # the group is still healthy afterwards
    return outcome


def rank_preflight_fault_on_rank1(rank: int, world_size: int) -> dict[str, Any]:
    model, _ = _models(world_size)
    optimizer = _composite(model)
    _train(model, optimizer, 1)
    optimizer.zero_grad()
    _loss(model, 1).backward()
    if rank == 1:
        _local(model.hidden.weight.grad)[0, 0] = float("nan")  # the muon child's preflight refuses it
    before = deep_snapshot(optimizer)
    outcome = _failure(optimizer.step)
    outcome["diffs"] = snapshot_diff(before, optimizer)
    _train(model, optimizer, 1, start=2)
    return outcome


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(v) for v in tree]
    return copy.deepcopy(tree)


def rank_adamw_dtensor_native_checkpoint(rank: int, world_size: int) -> dict[str, Any]:
    model, _ = _models(world_size)
    optimizer = ContractedAdamW(model.named_parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    saved = _clone_tree(optimizer.state_dict())
    twin, _ = _models(world_size)
    twin_optimizer = ContractedAdamW(twin.named_parameters(), lr=1e-2)
    _train(twin, twin_optimizer, 1, start=50)  # some unrelated state to be replaced

    def corrupted(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        state = _clone_tree(saved)
        edit(state["state"][0])
        return state

    def nan_shard(entry: dict[str, Any]) -> None:
        _local(entry["exp_avg"])[0] = float("nan")

    refused = {}
    for name, edit in {
        "plain_for_dtensor": lambda e: e.__setitem__("exp_avg", torch.zeros(e["exp_avg"].shape)),
        "float64": lambda e: e.__setitem__("exp_avg", e["exp_avg"].to(torch.float64)),
        "nan_in_shard": nan_shard,
    }.items():
        before = deep_snapshot(twin_optimizer)
        try:
            twin_optimizer.load_state_dict(corrupted(edit))
            refused[name] = "accepted"
        except StateValidationError:
            refused[name] = "refused" if not snapshot_diff(before, twin_optimizer) else "refused but changed"
    with torch.no_grad():
        for a, b in zip(model.parameters(), twin.parameters()):
            _local(b).copy_(_local(a))
    twin_optimizer.load_state_dict(saved)
    _train(model, optimizer, 2, start=2)
    _train(twin, twin_optimizer, 2, start=2)
    same = all(torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), twin.parameters()))
    kinds = sorted({type(v).__name__ for entry in saved["state"].values() for v in entry.values()})
    return {"refused": refused, "continuation_equal": same, "state_kinds": kinds}


def rank_scope_binding_fault_on_rank0(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from gefen_contracts.identity import ProcessGroupIdentity
    from gefen_contracts.torch_support import CodebookProcessGroupBinding

    members = tuple(f"member{r}" for r in range(world_size))
    binding = CodebookProcessGroupBinding(
        ProcessGroupIdentity("tests.world", members), members[rank], dist.group.WORLD, "cpu"
    )
    torch.manual_seed(0)
    model = _Net()  # plain tensors: the binding is the only process group
    optimizer = CompositeOptimizer.from_factories(
        model,
        {"muon": lambda named: ScopedSignMomentum(named, binding), "backup": adamw_factory},
    )
    counter = CollectiveCounter()
    optimizer.zero_grad()
    _loss(model, 0).backward()
    with counter.patched():
        optimizer.step()
    optimizer.zero_grad()
    _loss(model, 1).backward()
    if rank == 0:
        model.out.weight.grad[0, 0] = float("inf")
    before = deep_snapshot(optimizer, model)
    outcome = _failure(optimizer.step)
    outcome["diffs"] = snapshot_diff(before, optimizer, model)
    outcome["healthy_step_collectives"] = dict(counter.calls)
    return outcome


def rank_flattened_composite_across_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank binds its own member's flattened slices; shards are gathered with real collectives."""
    import torch.distributed as dist
    from gefen_contracts.identity import ProcessGroupIdentity
    from gefen_contracts.testing import flattened_plan

    group = ProcessGroupIdentity("tests.dp", tuple(f"rank:{r}" for r in range(world_size)))

    def bound() -> tuple[nn.Module, CompositeOptimizer, Any]:
        torch.manual_seed(0)
        model = _Net()
        plan = flattened_plan(list(model.named_parameters()), rank, group=group, whole_to_first=["out.bias"])
        composite = CompositeOptimizer.from_factories(model, {"muon": adamw_factory, "backup": adamw_factory})
        composite.post_sharding(plan.rebindings, manifest=plan.manifest)
        return model, composite, plan

    driver, composite, plan = bound()
    torch.manual_seed(0)
    full = _Net()
    reference = CompositeOptimizer.from_factories(full, {"muon": adamw_factory, "backup": adamw_factory})
    mismatched: list[str] = []
    for step in range(3):
        driver.zero_grad(set_to_none=True)
        _loss(driver, step).backward()  # the same batch on every rank: replicated gradients
        for rebinding in plan.rebindings:
            name, extent = rebinding.shard.fqn, rebinding.shard.extent
            grad = dict(driver.named_parameters())[name].grad
            plan.targets[name].grad = grad.reshape(-1)[extent.flat_offset : extent.flat_offset + extent.length].clone()
        composite.step()
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, {n: t.detach().clone() for n, t in plan.targets.items()})
        reference.zero_grad(set_to_none=True)
        _loss(full, step).backward()
        reference.step()
        with torch.no_grad():
            for name, parameter in driver.named_parameters():
                parameter.copy_(torch.cat([shards[name] for shards in gathered]).view_as(parameter))
        mismatched += [n for n, p in full.named_parameters() if not torch.equal(p, dict(driver.named_parameters())[n])]
    document = composite.export_local_state()
    documents: list[Any] = [None] * world_size
    dist.all_gather_object(documents, document)
    _, twin, _ = bound()
    twin.commit_local_import(twin.prepare_local_import(documents[rank]))
    peer = documents[(rank + 1) % world_size]
    before = deep_snapshot(twin)
    refusal = _failure(lambda: twin.prepare_local_import(peer))
    contract = composite.optimizer_contract().capabilities
    canonical = [e for e in contract.checkpoints if e.transport.value == "canonical_local"]
    return {
        "mismatched": mismatched,
        "refusal": refusal,
        "unchanged": snapshot_diff(before, twin) == [],
        "canonical_layouts": sorted(layout.value for e in canonical for layout in e.same_topology),
        "empty_shard": plan.targets["out.bias"].numel() == 0,
    }


# -- tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    with GlooWorld(WORLD_SIZE) as spawned:
        yield spawned


def test_fsdp2_composite_training_is_bit_identical_to_a_single_process_twin(world: GlooWorld) -> None:
    for result in world.run(rank_training_matches_a_single_process_twin):
        assert result["mismatched"] == []
        assert result["collectives"] == {"all_reduce": 1}  # one failure vote on the one FSDP mesh group
        assert dict(result["routing"])["hidden.weight"] == "muon"
        assert dict(result["routing"])["embed.weight"] == "backup"


def test_a_closure_failure_on_one_rank_raises_the_same_error_everywhere(world: GlooWorld) -> None:
    rank0, rank1 = world.run(rank_closure_fault_on_rank0)
    for outcome in (rank0, rank1):
        assert outcome["type"] == "CollectiveFailureError" and outcome["phase"] == STEP_PHASE
        assert outcome["unchanged"]
    assert rank0["local"] and "the loss looked wrong on rank 0" in rank0["message"]
    assert not rank1["local"] and "failed on another process-group member" in rank1["message"]


def test_a_child_preflight_failure_on_one_rank_changes_nothing_on_any_rank(world: GlooWorld) -> None:
    rank0, rank1 = world.run(rank_preflight_fault_on_rank1)
    for outcome in (rank0, rank1):
        assert outcome["type"] == "CollectiveFailureError" and outcome["phase"] == STEP_PHASE
        assert outcome["diffs"] == []
    assert rank1["local"] and "not finite" in rank1["message"]
    assert not rank0["local"]


def test_contracted_adamw_dtensor_native_checkpoints_round_trip_and_refuse_corruption(world: GlooWorld) -> None:
    for result in world.run(rank_adamw_dtensor_native_checkpoint):
        assert result["state_kinds"] == ["DTensor", "Tensor"]  # DTensor moments, a plain step
        assert result["refused"] == {"plain_for_dtensor": "refused", "float64": "refused", "nan_in_shard": "refused"}
        assert result["continuation_equal"]


def test_a_failure_is_voted_over_a_childs_collective_scope_binding(world: GlooWorld) -> None:
    rank0, rank1 = world.run(rank_scope_binding_fault_on_rank0)
    for outcome in (rank0, rank1):
        assert outcome["type"] == "CollectiveFailureError" and outcome["diffs"] == []
        assert outcome["healthy_step_collectives"] == {"all_reduce": 1}
    assert rank0["local"] and not rank1["local"]


def test_flattened_composite_members_on_two_ranks_train_like_the_full_tensors(world: GlooWorld) -> None:
    rank0, rank1 = world.run(rank_flattened_composite_across_ranks)
    for outcome in (rank0, rank1):
        assert outcome["mismatched"] == []
        assert outcome["canonical_layouts"] == ["flattened_element_shard"]
        assert outcome["refusal"]["type"] == "StateValidationError" and outcome["unchanged"]
        assert "another member's slice" in outcome["refusal"]["message"]
    assert not rank0["empty_shard"] and rank1["empty_shard"]  # rank 1 holds an empty shard of out.bias

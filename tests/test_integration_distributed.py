"""Real 2-rank gloo groups: DDP keeps Gefen, GefenMuon and GefenMuonHybrid replicas
bit-identical, and the hybrid keeps its FSDP2 (``fully_shard``) claims: training (the
AdamW-backed hybrid bit-identical to a single-process twin), same-topology native resume and
corrupted DTensor checkpoints refused with nothing changed.

These cases execute the claims ``gefen.integrations.conformance.HYBRID_WAIVERS`` waives in a
single-process kit run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen_contracts import StateValidationError
from gefen_contracts.testing import GlooWorld, deep_snapshot, snapshot_diff
from torch import nn

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2


class _Net(nn.Module):
    """Embedding, two matrices (one with a bias), a norm: both hybrid halves are present."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(self.embed(tokens).mean(dim=1)))
        return self.out(self.norm(hidden))  # type: ignore[no-any-return]


class _Matrices(nn.Module):
    """Only 2-D parameters, for GefenMuon alone."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8, bias=False)
        self.second = nn.Linear(8, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs = nn.functional.one_hot(tokens, 16).float().mean(dim=1)[:, :8]
        return self.second(torch.relu(self.first(inputs)))  # type: ignore[no-any-return]


def _loss(model: nn.Module, step: int, rank: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + 10 * step + rank)
    tokens = torch.randint(0, 16, (4, 3), generator=generator)
    target = torch.randn(4, 4, generator=generator)
    return nn.functional.mse_loss(model(tokens), target)


BUILDERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "gefen": lambda model: Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.01),
    "gefen-muon": lambda model: GefenMuon(model.named_parameters(), lr=2e-2),
    "hybrid": lambda model: GefenMuonHybrid(model, lr=1e-2),
    "hybrid-adamw": lambda model: GefenMuonHybrid(model, lr=1e-2, backup_optimizer="adamw", weight_decay=0.01),
}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [_local(tree).detach().reshape(-1).to(torch.float64)]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _tensors(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _clone_tree(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_clone_tree(value) for value in tree]
    return tree


# -- rank functions (module level: spawned ranks import this module) ------------------------------


def rank_ddp_replicas_stay_identical(rank: int, world_size: int, name: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = _Matrices() if name == "gefen-muon" else _Net()
    initial = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model)
    optimizer = BUILDERS[name](model)
    losses = []
    for step in range(3):
        optimizer.zero_grad()
        loss = _loss(ddp, step, rank)  # different batches per rank: DDP averages the gradients
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    values = torch.cat(
        [p.detach().reshape(-1) for p in model.parameters()] + [t.float() for t in _tensors(optimizer.state_dict())]
    )
    gathered = [torch.empty_like(values) for _ in range(world_size)]
    dist.all_gather(gathered, values)
    moved = any(not torch.equal(a, b) for a, b in zip(model.parameters(), initial))
    return {"identical": all(torch.equal(g, gathered[0]) for g in gathered), "losses": losses, "moved": moved}


def _fsdp_models(world_size: int) -> tuple[nn.Module, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    plain = copy.deepcopy(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, plain


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad()
        _loss(model, step).backward()  # the same batch on every rank
        optimizer.step()


def rank_fsdp2_adamw_hybrid_matches_one_process(rank: int, world_size: int) -> dict[str, Any]:
    model, plain = _fsdp_models(world_size)
    optimizer, reference = BUILDERS["hybrid-adamw"](model), BUILDERS["hybrid-adamw"](plain)
    initial = copy.deepcopy(plain)
    _train(model, optimizer, 3)
    _train(plain, reference, 3)
    mismatched = [
        name
        for (name, sharded), (_, full) in zip(model.named_parameters(), plain.named_parameters())
        if not torch.equal(sharded.full_tensor(), full)
    ]
    unmoved = [name for (name, p), q in zip(plain.named_parameters(), initial.parameters()) if torch.equal(p, q)]
    return {
        "mismatched": mismatched,
        "routing": optimizer.parameter_routing(),  # type: ignore[attr-defined]
        "kinds": sorted({type(p).__name__ for p in model.parameters()}),
        "unmoved": unmoved,
    }


def rank_fsdp2_hybrid_resumes_and_refuses_corruption(rank: int, world_size: int, backup: str) -> dict[str, Any]:
    name = "hybrid" if backup == "gefen" else "hybrid-adamw"
    model, _ = _fsdp_models(world_size)
    optimizer = BUILDERS[name](model)
    _train(model, optimizer, 2)
    saved = _clone_tree(optimizer.state_dict())
    saved_params = [_local(p).clone() for p in model.parameters()]

    twin, _ = _fsdp_models(world_size)
    twin_optimizer = BUILDERS[name](twin)
    _train(twin, twin_optimizer, 1, start=50)  # unrelated state that a refused load must keep

    refused = {}
    muon_groups = len(optimizer.child_optimizers()["muon"].param_groups)  # type: ignore[attr-defined]
    halves = {"muon": saved["param_groups"][:muon_groups], "backup": saved["param_groups"][muon_groups:]}
    for half in ("muon", "backup"):
        corrupted = _clone_tree(saved)
        pid = next(pid for group in halves[half] for pid in group["params"] if pid in corrupted["state"])
        entry = corrupted["state"][pid]
        key = next(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
        _local(entry[key]).reshape(-1)[0] = float("nan")
        before = deep_snapshot(twin_optimizer)
        try:
            twin_optimizer.load_state_dict(corrupted)
            refused[f"{half}:{key}"] = "accepted"
        except StateValidationError:
            refused[f"{half}:{key}"] = "refused" if not snapshot_diff(before, twin_optimizer) else "refused but changed"
    with torch.no_grad():
        for target, value in zip(twin.parameters(), saved_params):
            _local(target).copy_(value)
    twin_optimizer.load_state_dict(saved)
    _train(model, optimizer, 2, start=2)
    _train(twin, twin_optimizer, 2, start=2)
    same = all(torch.equal(_local(a), _local(b)) for a, b in zip(model.parameters(), twin.parameters()))
    states = [_tensors(optimizer.state_dict()), _tensors(twin_optimizer.state_dict())]
    same_state = len(states[0]) == len(states[1]) and all(torch.equal(a, b) for a, b in zip(*states))
    return {"refused": refused, "continuation_equal": same, "state_equal": same_state}


def rank_zero_redundancy_with_a_group_a_rank_does_not_own(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """torch's ZeroRedundancyOptimizer hands a rank an empty group whenever it owns none of a
    group's parameters (Gefen and GefenMuon refused empty groups on that rank only, and the
    other ranks hung in ZeRO's broadcast)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    optimizer_class = {"gefen": Gefen, "gefen-muon": GefenMuon}[name]
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((16, 32), (32, 16), (16, 16))]
    zero = ZeroRedundancyOptimizer(
        [{"params": params[:2]}, {"params": params[2:]}], optimizer_class=optimizer_class, lr=1e-2
    )
    local_groups = [list(group["params"]) for group in zero.optim.param_groups]
    # the one-process twin: the same optimizer over the parameters this rank owns
    twins = {id(p): nn.Parameter(p.detach().clone()) for group in local_groups for p in group}
    reference = optimizer_class([{"params": [twins[id(p)] for p in group]} for group in local_groups], lr=1e-2)
    for step in range(2):
        grads = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)) for i, p in enumerate(params)
        ]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
            if id(param) in twins:
                twins[id(param)].grad = grad.clone()
        zero.step()
        reference.step()
    owned = [p for group in local_groups for p in group]
    return {
        "group_sizes": [len(group) for group in local_groups],
        "matches": all(torch.equal(p.detach(), twins[id(p)].detach()) for p in owned),
    }


# -- tests -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> Iterator[GlooWorld]:
    import gefen_kernels

    gefen_kernels.cpu_kernel_status()  # build (or load) the CPU kernel once, before ranks spawn
    with GlooWorld(WORLD_SIZE) as spawned:
        yield spawned


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_ddp_replicas_and_optimizer_state_stay_bit_identical(world: GlooWorld, name: str) -> None:
    for result in world.run(rank_ddp_replicas_stay_identical, name):
        assert result["identical"], name
        assert result["moved"], name
        assert all(torch.isfinite(torch.tensor(result["losses"]))), result["losses"]


@pytest.mark.parametrize("name", ["gefen", "gefen-muon"])
def test_zero_redundancy_builds_and_steps_with_a_group_a_rank_does_not_own(world: GlooWorld, name: str) -> None:
    results = world.run(rank_zero_redundancy_with_a_group_a_rank_does_not_own, name)
    assert any(0 in result["group_sizes"] for result in results), results  # the case happened
    assert all(result["matches"] for result in results), results


def test_fsdp2_adamw_backed_hybrid_trains_bit_identically_to_one_process(world: GlooWorld) -> None:
    for result in world.run(rank_fsdp2_adamw_hybrid_matches_one_process):
        assert result["kinds"] == ["DTensor"]
        assert dict(result["routing"]) == {
            "embed.weight": "backup",
            "hidden.bias": "backup",
            "hidden.weight": "muon",
            "norm.bias": "backup",
            "norm.weight": "backup",
            "out.weight": "muon",
        }
        assert result["mismatched"] == []
        assert result["unmoved"] == []


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_fsdp2_hybrid_resumes_exactly_and_refuses_corrupted_dtensor_checkpoints(world: GlooWorld, backup: str) -> None:
    for result in world.run(rank_fsdp2_hybrid_resumes_and_refuses_corruption, backup):
        assert len(result["refused"]) == 2
        assert set(result["refused"].values()) == {"refused"}, result["refused"]
        assert result["continuation_equal"]
        assert result["state_equal"]

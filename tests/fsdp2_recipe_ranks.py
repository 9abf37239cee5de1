"""Rank functions for tests/test_fsdp2_dcp_recipe.py (run inside GlooWorld ranks).

torch's documented optimizer-checkpoint recipe under FSDP2: a model sharded with
``fully_shard`` over every rank, ``get_optimizer_state_dict`` -> ``dcp.save`` on N ranks, then
on M ranks a fresh model and optimizer, ``get_optimizer_state_dict`` (the template: one
zero-gradient ``lr=0`` step) -> ``dcp.load`` -> ``set_optimizer_state_dict``; and torchtitan's
variant, ``optimizer.state_dict()`` keyed by parameter FQN through ``dcp.save``, loaded after
its own zero-gradient ``lr=0`` step with ``optimizer.load_state_dict``. Each function
returns, from rank 0, the gathered (full) optimizer state and the parameters after further
steps, so the test compares N and M ranks bit for bit (state) and closely (training).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen_dcp import GefenDCPState, GefenFileSystemWriter, GefenLoadPlanner, GefenSavePlanner
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

BEFORE = 3
AFTER = 3


class Net(nn.Module):
    """Rows that split unevenly over 2 and 3 ranks (11), two blocks per row (2560 = 2 x 1280),
    a head of 4 rows (an empty shard on 3 ranks), 1-D norm and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 2560)
        self.proj = nn.Linear(2560, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.proj(self.embed(tokens).mean(dim=1)))
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def _gefen(model: nn.Module) -> torch.optim.Optimizer:
    embed = [p for n, p in model.named_parameters() if n.startswith("embed")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("embed")]
    # the embedding keeps block second moments ([rows, blocks]), the rest Gefen's defaults
    return Gefen([{"params": embed, "factored_v_2d": False}, {"params": rest}], lr=1e-2, weight_decay=0.01)


FACTORIES: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "gefen": _gefen,
    "contracted_adamw": lambda m: ContractedAdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
    "gefen_muon": lambda m: GefenMuon([(n, p) for n, p in m.named_parameters() if p.ndim == 2], lr=1e-2),
    # each matrix's state on its owner rank only (not in the resharding matrix: see its own test)
    "gefen_muon_distributed": lambda m: GefenMuon(
        [(n, p) for n, p in m.named_parameters() if p.ndim == 2], lr=1e-2, sharded_mode="distributed"
    ),
    "hybrid_gefen": lambda m: GefenMuonHybrid(m.named_parameters(), lr=1e-2),
    "hybrid_adamw": lambda m: GefenMuonHybrid(m.named_parameters(), lr=1e-2, backup_optimizer="adamw"),
    # the composite class itself, over ContractedAdamW in both roles (it claims the recipe on
    # DTensors because both children do)
    "composite_adamw": lambda m: CompositeOptimizer.from_factories(
        list(m.named_parameters()),
        {"muon": lambda n: ContractedAdamW(n, lr=2e-2), "backup": lambda n: ContractedAdamW(n, lr=1e-2)},
    ),
}


def _model(seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return model


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 11, (6, 5), generator=generator)
    target = torch.randn(6, 4, generator=generator)
    return torch.nn.functional.mse_loss(model(tokens), target)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, step)  # the same batch on every rank
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _full(tree: Any) -> Any:
    """Every DTensor gathered to a full tensor (a collective: every rank calls it)."""
    if isinstance(tree, torch.Tensor):
        full = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        return full.detach().cpu().clone()
    if isinstance(tree, dict):
        return {key: _full(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_full(value) for value in tree)
    return tree


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p) for name, p in model.named_parameters()}


def _fqn_keyed(state_dict: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter ids replaced by FQNs (what torchtitan saves)."""
    names = {id(p): n for n, p in model.named_parameters()}
    fqn = {}
    for saved, live in zip(state_dict["param_groups"], optimizer.param_groups):
        for pid, param in zip(saved["params"], live["params"]):
            fqn[pid] = names[id(param)]
    state_dict["state"] = {fqn[pid]: entry for pid, entry in state_dict["state"].items()}
    for group in state_dict["param_groups"]:
        group["params"] = [fqn[pid] for pid in group["params"]]
    return state_dict


def _template_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """torchtitan's initialising step: zero gradients at ``lr=0`` so the state exists."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str) -> dict[str, Any]:
    if mode == "fqn_native":
        return _fqn_keyed(optimizer.state_dict(), model, optimizer)
    options = StateDictOptions(flatten_optimizer_state_dict=mode == "flattened")
    return get_optimizer_state_dict(model, optimizer, options=options)


def save(rank: int, world: int, name: str, path: str, mode: str) -> dict[str, Any] | None:
    """Train, save the checkpoint (torch's recipe, nested or flattened, or the FQN-keyed native
    state dict), report the gathered state, then train on."""
    model = _model(0)
    optimizer = FACTORIES[name](model)
    _train(model, optimizer, 0, BEFORE)
    if mode == "gefen_dcp_state":
        dcp.save(
            {"model": get_model_state_dict(model), "optim": GefenDCPState(optimizer)},
            storage_writer=GefenFileSystemWriter(path),
            planner=GefenSavePlanner(),
        )
    else:
        dcp.save(
            {"model": get_model_state_dict(model), "optim": _optimizer_state(model, optimizer, mode)},
            checkpoint_id=path,
        )
    state = _full(optimizer.state_dict())
    losses = _train(model, optimizer, BEFORE, AFTER)
    params = _params(model)
    return {"state": state, "params": params, "losses": losses} if rank == 0 else None


def load(rank: int, world: int, name: str, path: str, mode: str) -> dict[str, Any] | None:
    """Load the checkpoint into a fresh model and optimizer on this many ranks (the template
    first: torch's helper, or torchtitan's zero-gradient step); report the gathered state, then
    train on (and, from the same weights, without the state)."""
    model = _model(1)
    optimizer = FACTORIES[name](model)
    weights = get_model_state_dict(model)
    if mode == "fqn_native":
        _template_step(model, optimizer)
    if mode == "gefen_dcp_state":  # a fresh optimizer, no template: the metadata plans the load
        template: Any = GefenDCPState(optimizer)
    else:
        template = _optimizer_state(model, optimizer, mode)
    untouched = all(torch.equal(_full(p), q) for p, q in zip(model.parameters(), _params(_model(1)).values()))
    checkpoint = {"model": weights, "optim": template}
    if mode == "gefen_dcp_state":
        dcp.load(checkpoint, checkpoint_id=path, planner=GefenLoadPlanner())
    else:
        dcp.load(checkpoint, checkpoint_id=path)
    set_model_state_dict(model, checkpoint["model"])
    if mode == "gefen_dcp_state":
        pass  # GefenDCPState.load_state_dict verified, staged and committed it inside dcp.load
    elif mode == "fqn_native":
        optimizer.load_state_dict(checkpoint["optim"])
    else:
        options = StateDictOptions(flatten_optimizer_state_dict=mode == "flattened")
        set_optimizer_state_dict(model, optimizer, checkpoint["optim"], options=options)
    state = _full(optimizer.state_dict())
    losses = _train(model, optimizer, BEFORE, AFTER)
    params = _params(model)

    dropped = _loaded_model(path)
    _train(dropped, FACTORIES[name](dropped), BEFORE, AFTER)
    dropped_params = _params(dropped)
    if rank != 0:
        return None
    return {
        "state": state,
        "params": params,
        "losses": losses,
        "dropped_params": dropped_params,
        "template_step_moved_nothing": untouched,
    }


def _loaded_model(path: str) -> nn.Module:
    model = _model(2)
    weights = {"model": get_model_state_dict(model)}
    dcp.load(weights, checkpoint_id=path)
    set_model_state_dict(model, weights["model"])
    return model


def checkpoint_params(rank: int, world: int, path: str) -> dict[str, torch.Tensor] | None:
    """The checkpoint's parameters, full."""
    params = _params(_loaded_model(path))
    return params if rank == 0 else None

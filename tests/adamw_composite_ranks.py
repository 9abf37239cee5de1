"""Rank functions for tests/test_adamw_composite_resharding.py (run inside GlooWorld ranks, and in-process
for one-rank loads).

Portable cases run a replicated single-process *reference* (ContractedAdamW, or a composite of
two, on the full tensors) on every rank: deterministic, so every rank computes the same one.
Sharded optimizers are finalized with ``post_sharding`` onto flattened slices and fed the
reference's gradient slices, so a correct state transfer keeps them bit-identical to the
reference's slices. FSDP2 cases train ``fully_shard`` models on the same batch on every rank
and save / load through ``GefenDCPState``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import ShardingPlan, deep_snapshot, flattened_plan, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_dcp import (
    GefenDCPState,
    GefenFileSystemWriter,
    GefenLoadPlanner,
    GefenSavePlanner,
    load_portable_dcp,
    save_portable_dcp,
)
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from gefen_portable import (
    PortableCollectiveError,
    PortableCompositeState,
    PortableState,
    export_portable_composite_state,
    export_portable_state,
    import_portable_composite_state,
    import_portable_state,
)
from sign_momentum_child import sign_child_factory
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

LIMITS = PortableStateLimits(chunk_bytes=96)  # tiny chunks: many transfers even for small tensors
STEPS = 3
MORE = 3
#: An empty flattened slice on every member but the first.
WHOLE_ON_FIRST = ("head.bias",)
_GROUPS: dict[int, Any] = {}


class Net(nn.Module):
    """Embedding, two matrices with biases, a norm and a head: every routing rule is used."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.head = nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.hidden(self.embed(tokens)))
        return self.head(self.norm(hidden))  # type: ignore[no-any-return]


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    """The same batch on every rank: a regression loss over a (6, 4) token batch."""
    generator = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, 16, (6, 4), generator=generator)
    target = torch.randn(6, 4, 5, generator=generator)
    return nn.functional.mse_loss(model(tokens), target)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def adamw(named: Any) -> ContractedAdamW:
    return ContractedAdamW(named, lr=2e-2, weight_decay=0.01)


def composite_of_adamw(model: nn.Module) -> CompositeOptimizer:
    backup = lambda named: ContractedAdamW(named, lr=1e-2)  # noqa: E731
    return CompositeOptimizer.from_factories(model, {"muon": adamw, "backup": backup})


def composite_with_child(model: nn.Module) -> CompositeOptimizer:
    return CompositeOptimizer.from_factories(model, {"muon": sign_child_factory, "backup": adamw})


BUILDERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda model: adamw(model.named_parameters()),
    "composite": composite_of_adamw,
    "composite_with_child": composite_with_child,
}


# -- bindings and plumbing ---------------------------------------------------------------------------


def _process_group(size: int) -> Any:
    """One cached gloo group per size over ranks [0, size) (every rank creates every group once)."""
    if not _GROUPS:
        for members in range(2, dist.get_world_size() + 1):
            _GROUPS[members] = dist.new_group(list(range(members)))
    return None if size == 1 else _GROUPS[size]


def group(size: int) -> ProcessGroupIdentity:
    return ProcessGroupIdentity(f"tests.dp{size}", tuple(f"rank:{r}" for r in range(size)))


def binding(rank: int, size: int) -> CheckpointProcessGroupBinding:
    return CheckpointProcessGroupBinding(group(size), f"rank:{rank}", _process_group(size), "cpu")


def _share(value: Any, source: int = 0) -> Any:
    """Test plumbing only: every rank receives rank ``source``'s value (weights-only bytes)."""
    payload: list[Any] = [None]
    if dist.get_rank() == source:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = [buffer.getvalue()]
    dist.broadcast_object_list(payload, src=source)
    return torch.load(io.BytesIO(payload[0]), weights_only=True)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- portable resharding -----------------------------------------------------------------------------


@dataclass
class Sharded:
    """An optimizer finalized onto one member's flattened slices, and its plan."""

    optimizer: Any
    plan: ShardingPlan


@dataclass
class Reference:
    model: nn.Module
    optimizer: Any

    def state_of(self, fqn: str) -> dict[str, Any]:
        return self.optimizer.state[dict(self.model.named_parameters())[fqn]]  # type: ignore[no-any-return]


def reference(kind: str) -> Reference:
    model = net()
    return Reference(model, BUILDERS[kind](model))


def sharded(kind: str, rank: int, size: int, values: nn.Module | None = None, **options: Any) -> Sharded:
    """Build on a fresh full model (so the routing is the reference's), then bind ``rank``'s slices."""
    model = net()
    if kind == "adamw":
        optimizer: Any = ContractedAdamW(model.named_parameters(), lr=2e-2, weight_decay=0.01, **options)
    else:
        optimizer = BUILDERS[kind](model)
    source = dict((values or model).named_parameters())
    plan = flattened_plan(
        list(model.named_parameters()), rank, group=group(size), whole_to_first=WHOLE_ON_FIRST, values=source
    )
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    return Sharded(optimizer, plan)


def mirror_step(ref: Reference, shards: Sequence[Sharded], step: int) -> None:
    """One reference step; every sharded optimizer steps on the same gradient's slices."""
    ref.optimizer.zero_grad(set_to_none=True)
    loss_at(ref.model, step).backward()
    grads = {name: p.grad.detach().reshape(-1).clone() for name, p in ref.model.named_parameters()}
    for shard in shards:
        for rebinding in shard.plan.rebindings:
            extent = rebinding.shard.extent
            start = extent.flat_offset  # type: ignore[union-attr]
            target = shard.plan.targets[rebinding.shard.fqn]
            target.grad = grads[rebinding.shard.fqn][start : start + target.numel()].clone()
    ref.optimizer.step()
    for shard in shards:
        shard.optimizer.step()


def differences(ref: Reference, shard: Sharded, what: str) -> list[str]:
    """Parameters and AdamW state of ``shard`` that are not bit-identical to the reference's slices."""
    problems = []
    full = dict(ref.model.named_parameters())
    for rebinding in shard.plan.rebindings:
        fqn = rebinding.shard.fqn
        start = rebinding.shard.extent.flat_offset  # type: ignore[union-attr]
        tensor = shard.plan.targets[fqn]
        piece = slice(start, start + tensor.numel())
        if not _bitwise(tensor.detach(), full[fqn].detach().reshape(-1)[piece]):
            problems.append(f"{what}: parameter {fqn!r} differs")
        expected, got = ref.state_of(fqn), shard.optimizer.state.get(tensor) or {}
        if set(got) != set(expected) or float(got["step"]) != float(expected["step"]):
            problems.append(f"{what}: state keys or step of {fqn!r} differ")
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            if not _bitwise(got[key], expected[key].reshape(-1)[piece]):
                problems.append(f"{what}: {key} of {fqn!r} differs")
    return problems


def export_state(optimizer: Any, rank: int, size: int, transaction: str) -> Any:
    """A composite's state through gefen-portable's composite wrapper, anything else directly."""
    export = export_portable_composite_state if isinstance(optimizer, CompositeOptimizer) else export_portable_state
    return export(optimizer, checkpoint_process_group=binding(rank, size), transaction_id=transaction, limits=LIMITS)


def import_state(optimizer: Any, state: Any, rank: int, size: int, transaction: str) -> None:
    load = import_portable_composite_state if isinstance(optimizer, CompositeOptimizer) else import_portable_state
    load(optimizer, state, checkpoint_process_group=binding(rank, size), transaction_id=transaction, limits=LIMITS)


def _catalogs(state: Any) -> Any:
    """What a member without fragments needs: the agreed catalog(s), as plain records."""
    if isinstance(state, PortableCompositeState):
        roles = {role: child.catalog_record() for role, child in state.children.items()}
        return {"implementation": state.implementation, "routing": state.routing, "roles": roles}
    return {"catalog": state.catalog_record()}


def _without_fragments(shared: Any) -> Any:
    if "catalog" in shared:
        return PortableState.from_parts(shared["catalog"], [], limits=LIMITS)
    children = {role: PortableState.from_parts(record, [], limits=LIMITS) for role, record in shared["roles"].items()}
    return PortableCompositeState(shared["implementation"], shared["routing"], children)


def flattened_two_to_three(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """Flattened on 2 members -> export (a PortableState, or a composite's PortableCompositeState;
    no document) -> flattened on 3 members.

    Also: the same state imported into a fresh 2-member twin continues bit-identically, and a
    target whose rank 1 refuses (another ``maximize`` flag) makes every rank fail unchanged.
    """
    _process_group(2)
    ref = reference(kind)
    source = sharded(kind, rank, 2) if rank < 2 else None
    for step in range(STEPS):
        mirror_step(ref, [source] if source else [], step)
    state = twin = None
    if source is not None:
        state = export_state(source.optimizer, rank, 2, "export")
        twin = sharded(kind, rank, 2, values=ref.model)
        import_state(twin.optimizer, state, rank, 2, "same-layout")
    shared = _share(_catalogs(state) if state is not None else None)
    if state is None:
        state = _without_fragments(shared)
    refused = None
    if kind == "adamw":
        stubborn = sharded(kind, rank, 3, values=ref.model, maximize=rank == 1)
        before = deep_snapshot(stubborn.optimizer)
        try:
            import_state(stubborn.optimizer, state, rank, 3, "refused")
        except PortableCollectiveError as exc:
            refused = {"message": str(exc), "unchanged": not snapshot_diff(before, stubborn.optimizer)}
    target = sharded(kind, rank, 3, values=ref.model)
    import_state(target.optimizer, state, rank, 3, "reshard")
    problems = differences(ref, target, "after import")
    if twin is not None:
        problems += differences(ref, twin, "same-layout twin after import")
    shards = [s for s in (target, source, twin) if s is not None]
    for step in range(STEPS, STEPS + MORE):
        mirror_step(ref, shards, step)
    for name, shard in (("target", target), ("source", source), ("twin", twin)):
        if shard is not None:
            problems += differences(ref, shard, f"{name} after continuing")
    return {"problems": problems, "refused": refused, "empty_slice": target.plan.targets["head.bias"].numel() == 0}


def replicated_one_to_flattened_two(rank: int, world_size: int, kind: str, path: str) -> list[str]:
    """A single-process optimizer (implicit replicated layout, no post_sharding) saved with
    save_portable_dcp on one member, loaded with load_portable_dcp onto 2 flattened members."""
    _process_group(2)
    ref = reference(kind)
    for step in range(STEPS):
        mirror_step(ref, [], step)
    if rank == 0:
        save_portable_dcp(ref.optimizer, checkpoint_process_group=binding(0, 1),
                          storage_writer=GefenFileSystemWriter(path), transaction_id="save", limits=LIMITS)  # fmt: skip
    dist.barrier()
    if rank >= 2:
        return []
    target = sharded(kind, rank, 2, values=ref.model)
    load_portable_dcp(target.optimizer, checkpoint_process_group=binding(rank, 2),
                      storage_reader=FileSystemReader(path), transaction_id="load", limits=LIMITS)  # fmt: skip
    problems = differences(ref, target, "after load")
    for step in range(STEPS, STEPS + MORE):
        mirror_step(ref, [target], step)
    return problems + differences(ref, target, "after continuing")


def flattened_two_to_three_through_dcp(rank: int, world_size: int, kind: str, path: str) -> list[str]:
    """Flattened on 2 members -> save_portable_dcp -> load_portable_dcp onto 3 flattened members."""
    _process_group(2)
    ref = reference(kind)
    source = sharded(kind, rank, 2) if rank < 2 else None
    for step in range(STEPS):
        mirror_step(ref, [source] if source else [], step)
    if source is not None:
        save_portable_dcp(source.optimizer, checkpoint_process_group=binding(rank, 2),
                          storage_writer=GefenFileSystemWriter(path), transaction_id="save", limits=LIMITS)  # fmt: skip
    dist.barrier()
    target = sharded(kind, rank, 3, values=ref.model)
    load_portable_dcp(target.optimizer, checkpoint_process_group=binding(rank, 3),
                      storage_reader=FileSystemReader(path), transaction_id="load", limits=LIMITS)  # fmt: skip
    problems = differences(ref, target, "after load")
    for step in range(STEPS, STEPS + MORE):
        mirror_step(ref, [target], step)
    return problems + differences(ref, target, "after continuing")


# -- FSDP2 resharding of parameter-shaped state --------------------------------------------------------------------

BEFORE = 6
AFTER = 20


def fsdp(kind: str, world_size: int | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model sharded with ``fully_shard`` over the whole world (``None``: a plain, unsharded model)."""
    model = net()
    if world_size is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, BUILDERS[kind](model)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_at(model, step)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def fsdp_train_save_continue(rank: int, world_size: int, kind: str, path: str) -> list[float]:
    """Train, save model + optimizer through GefenDCPState, return the uninterrupted losses."""
    model, optimizer = fsdp(kind, world_size)
    train(model, optimizer, 0, BEFORE)
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner())
    return train(model, optimizer, BEFORE, AFTER)


def fsdp_load_continue(rank: int, world_size: int | None, kind: str, path: str, keep_state: bool) -> list[float]:
    """Load the model (and, with ``keep_state``, the optimizer) and return the next losses.

    ``world_size=None`` loads a plain model in this process (DCP's single-process mode).
    """
    model, optimizer = fsdp(kind, world_size)
    state: dict[str, Any] = {"model": model.state_dict()}
    if keep_state:
        state["optim"] = GefenDCPState(optimizer)
    dcp.load(state, checkpoint_id=Path(path), planner=GefenLoadPlanner())
    model.load_state_dict(state["model"])
    return train(model, optimizer, BEFORE, AFTER)


def fsdp_corrupted_load(rank: int, world_size: int, kind: str, path: str) -> dict[str, Any]:
    """Every rank loads a copy whose ``optim`` envelope rank 0 edited: all refuse, nothing changes."""
    import shutil

    model, optimizer = fsdp(kind, world_size)
    train(model, optimizer, 0, 2)
    copy_path = Path(f"{path}-corrupted")
    if rank == 0:
        shutil.copytree(path, copy_path)
        _edit_envelope(copy_path)
    dist.barrier()
    before = deep_snapshot(optimizer)
    outcome: dict[str, Any] = {"raised": None}
    try:
        dcp.load({"optim": GefenDCPState(optimizer)}, checkpoint_id=copy_path, planner=GefenLoadPlanner())
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        outcome["raised"] = type(exc).__name__
    outcome["unchanged"] = not snapshot_diff(before, optimizer)
    dist.barrier()
    return outcome


def _edit_envelope(path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader as Reader

    metadata = Reader(path).read_metadata()
    (info,) = [i for index, i in metadata.storage_data.items() if index.fqn == "optim.envelope"]
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    region = data[info.offset : info.offset + info.length]
    position = bytes(region).find(b'"format"')
    data[info.offset + position + 2] = ord("F")
    target.write_bytes(bytes(data))

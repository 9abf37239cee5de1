"""Rank functions for tests/test_dcp_hybrid_bound.py (run inside GlooWorld ranks).

Every rank holds the same full *driver* model and computes the full gradient of the same
batch. Each member's ``GefenMuonHybrid`` (Gefen or ContractedAdamW backup) is either a
single-process hybrid over the driver itself (one member, the implicit layout) or a hybrid
finalized with ``post_sharding`` onto this member's pieces under a codebook scope over the
layout's members: the backup's embedding and head as flattened slices, its bias replicated,
the Muon matrices whole-parameter owners or replicated. After each step the members
all-gather their pieces into the driver (what a data-parallel adapter does), so the driver's
loss is the run's loss.

A case trains the 2-member layout, saves it with ``save_portable_dcp`` (each member writes
its own fragments), then continues four runs from the same checkpointed parameters: the
source itself (uninterrupted), a twin of the source layout loaded with ``load_portable_dcp``
(must be bit-exact), the target layout loaded with ``load_portable_dcp`` (resumed) and the
target layout without the optimizer state (dropped).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from gefen import GefenMuonHybrid
from gefen_contracts import (
    LogicalSlice,
    ParameterIdentity,
    ParameterLayout,
    ParameterRebinding,
    PlacementKind,
    PortableStateLimits,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardingManifest,
    ShardPlacement,
)
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, CodebookProcessGroupBinding
from gefen_dcp import GefenFileSystemWriter, load_portable_dcp, save_portable_dcp
from torch.distributed.checkpoint import FileSystemReader

LIMITS = PortableStateLimits(chunk_bytes=2048)  # several chunks per fragment field
BEFORE = 6
AFTER = 20
AXIS = "dp"
_GROUPS: dict[int, Any] = {}


class Net(torch.nn.Module):
    """Backup: an embedding (2048 elements), a head and a bias; Muon: three hidden matrices.

    Two-member cuts of the flattened backup tensors fall on block boundaries; near-even cuts
    in three do not (the Gefen backup re-blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(64, 32) * 0.5)
        self.a = torch.nn.Parameter(torch.randn(32, 48) * 0.2)
        self.b = torch.nn.Parameter(torch.randn(48, 48) * 0.2)
        self.c = torch.nn.Parameter(torch.randn(48, 32) * 0.2)
        self.lm_head = torch.nn.Parameter(torch.randn(16, 32) * 0.2)
        self.bias = torch.nn.Parameter(torch.zeros(16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        hidden = torch.tanh(torch.tanh(torch.tanh(hidden @ self.a) @ self.b) @ self.c)
        return hidden @ self.lm_head.T + self.bias

    def loss(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(300 + step)
        tokens = torch.randint(0, 64, (8, 5), generator=generator)
        target = torch.randn(8, 16, generator=generator)
        return torch.nn.functional.mse_loss(self(tokens), target)


def driver() -> Net:
    torch.manual_seed(0)
    return Net()


def hybrid(named: Any, backup: str) -> GefenMuonHybrid:
    return GefenMuonHybrid(named, lr=1e-2, weight_decay=0.01, backup_optimizer=backup, fused=False)


# -- layouts -----------------------------------------------------------------------------------------

#: ``(layout, detail)`` per parameter: ``("repl", None)``, ``("flat", cuts)`` or ``("owner", rank)``.
Spec = dict[str, tuple[str, Any]]


def _even(numel: int, members: int) -> tuple[int, ...]:
    size = -(-numel // members)
    return tuple(min(numel, size * r) for r in range(1, members))


def layout(members: int) -> Spec:
    """The backup's embedding and head flattened, its bias replicated; Muon's matrices owned
    (two members: ``a`` by 0, ``b`` by 1, ``c`` replicated; three: ``a`` replicated, ``b`` by 2,
    ``c`` by 1)."""
    backup: Spec = {
        "embed": ("flat", _even(64 * 32, members)),
        "lm_head": ("flat", _even(16 * 32, members)),
        "bias": ("repl", None),
    }
    if members == 2:
        return {**backup, "a": ("owner", 0), "b": ("owner", 1), "c": ("repl", None)}
    return {**backup, "a": ("repl", None), "b": ("owner", 2), "c": ("owner", 1)}


def group(size: int) -> ProcessGroupIdentity:
    return ProcessGroupIdentity(f"tests.hdcp{size}", tuple(f"rank:{r}" for r in range(size)))


def _process_group(size: int) -> Any:
    """One cached gloo group per size over ranks [0, size) (every rank creates every group once)."""
    if not _GROUPS:
        for members in range(2, dist.get_world_size() + 1):
            _GROUPS[members] = dist.new_group(list(range(members)))
    return None if size == 1 else _GROUPS[size]


def checkpoint_binding(rank: int, size: int) -> CheckpointProcessGroupBinding:
    return CheckpointProcessGroupBinding(group(size), f"rank:{rank}", _process_group(size), torch.device("cpu"))


def _shards(name: str, shape: tuple[int, ...], spec: tuple[str, Any], size: int) -> list[ShardIdentity]:
    identity = ParameterIdentity(name, shape)
    kind, detail = spec
    out = []
    for r in range(size):
        owner = None
        if kind == "repl":
            placement = ShardPlacement(AXIS, PlacementKind.REPLICATE, r, size)
            param_layout, extent = ParameterLayout.REPLICATED, LogicalSlice.full(identity)
        elif kind == "flat":
            bounds = (0, *detail, identity.numel)
            placement = ShardPlacement(AXIS, PlacementKind.FLAT_SHARD, r, size)
            param_layout = ParameterLayout.FLATTENED_ELEMENT_SHARD
            extent = LogicalSlice(bounds[r], bounds[r + 1] - bounds[r])
        else:
            placement = ShardPlacement(AXIS, PlacementKind.WHOLE_PARAMETER_OWNER, r, size)
            param_layout, owner = ParameterLayout.WHOLE_PARAMETER_OWNER, f"rank:{detail}"
            extent = LogicalSlice.full(identity) if r == detail else LogicalSlice(0, 0)
        out.append(ShardIdentity(identity, param_layout, extent, (placement,), group(size), f"rank:{r}", owner=owner))
    return out


def _piece(full: torch.Tensor, shard: ShardIdentity) -> torch.Tensor:
    extent = shard.extent
    assert type(extent) is LogicalSlice
    if shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        return full.detach().reshape(-1)[extent.flat_offset : extent.end]
    return full.detach()


class Member:
    """One member's hybrid over the driver: single-process (``size == 1``) or bound."""

    def __init__(self, backup: str, model: Net, rank: int, size: int) -> None:
        self.model, self.size = model, size
        self.pieces: dict[str, tuple[ShardIdentity, torch.Tensor | None]] = {}
        if size == 1:
            self.optimizer = hybrid(model.named_parameters(), backup)
            return
        spec = layout(size)
        named = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in model.named_parameters()]
        self.optimizer = hybrid(named, backup)
        rebindings, shards = [], []
        for name, parameter in named:
            every = _shards(name, tuple(parameter.shape), spec[name], size)
            shards.extend(every)
            mine = every[rank]
            pruned = mine.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not mine.is_owner
            target = None if pruned else torch.nn.Parameter(_piece(parameter, mine).clone())
            self.pieces[name] = (mine, target)
            rebindings.append(ParameterRebinding(parameter, target, mine))
        scope = CodebookProcessGroupBinding(group(size), f"rank:{rank}", _process_group(size), torch.device("cpu"))
        self.optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), scope=scope)

    def train(self, start: int, steps: int) -> list[float]:
        losses = []
        for step in range(start, start + steps):
            self.model.zero_grad(set_to_none=True)
            loss = self.model.loss(step)
            loss.backward()
            for name, parameter in self.model.named_parameters():
                shard, target = self.pieces.get(name, (None, None))
                if target is not None and shard is not None:
                    target.grad = _piece(parameter.grad, shard).clone()  # type: ignore[arg-type]
            self.optimizer.step()
            if self.size > 1:
                self._gather()
            losses.append(float(loss.detach()))
        return losses

    def _gather(self) -> None:
        """Every member's pieces into the driver (the adapter's all-gather after a step)."""
        mine = {name: (shard, t.detach().clone()) for name, (shard, t) in self.pieces.items() if t is not None}
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, mine, group=_process_group(self.size))
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                for pieces in everyone:
                    if name in pieces:
                        shard, value = pieces[name]
                        _piece(parameter, shard).copy_(value)

    def bits(self) -> dict[str, bytes]:
        return {n: p.detach().numpy().tobytes() for n, p in self.model.named_parameters()}

    def load(self, rank: int, path: str, transaction: str) -> None:
        load_portable_dcp(
            self.optimizer,
            checkpoint_process_group=checkpoint_binding(rank, self.size),
            storage_reader=FileSystemReader(path),
            transaction_id=transaction,
            limits=LIMITS,
        )


def _share(value: Any) -> Any:
    """Test plumbing only: every rank receives rank 0's value (weights-only bytes)."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = [buffer.getvalue()]
    dist.broadcast_object_list(payload, src=0)
    return torch.load(io.BytesIO(payload[0]), weights_only=True)


def _at(values: dict[str, torch.Tensor]) -> Net:
    model = driver()
    model.load_state_dict(values)
    return model


def save_and_reshard(rank: int, world: int, backup: str, target_size: int, path: str) -> dict[str, Any]:
    """The case of the module docstring: 2 members -> ``target_size`` members through DCP."""
    _process_group(2)
    in_source, in_target = rank < 2, rank < target_size
    model = driver()
    source = Member(backup, model, rank, 2) if in_source else None
    if source is not None:
        source.train(0, BEFORE)
        save_portable_dcp(
            source.optimizer,
            checkpoint_process_group=checkpoint_binding(rank, 2),
            storage_writer=GefenFileSystemWriter(path),
            transaction_id="save",
            limits=LIMITS,
        )
    checkpoint = _share({n: p.detach().clone() for n, p in model.named_parameters()})
    dist.barrier()
    outcome: dict[str, Any] = {}
    if source is not None:
        twin = Member(backup, _at(checkpoint), rank, 2)
        twin.load(rank, path, "same-layout")
        outcome["uninterrupted"] = source.train(BEFORE, AFTER)
        outcome["twin"] = twin.train(BEFORE, AFTER)
        outcome["twin_bit_exact"] = twin.bits() == source.bits()
    if in_target:
        resumed = Member(backup, _at(checkpoint), rank, target_size)
        resumed.load(rank, path, "reshard")
        outcome["resumed"] = resumed.train(BEFORE, AFTER)
        dropped = Member(backup, _at(checkpoint), rank, target_size)
        outcome["dropped"] = dropped.train(BEFORE, AFTER)
    dist.barrier()
    return outcome

"""Rank functions for tests/test_bound_resharding.py (run inside GlooWorld ranks).

Every rank holds the same full *driver* model and computes the full gradient of the same
batch. A *layout* decides what each member's optimizer holds: a single-process ``Gefen`` over
the driver itself (size 1, the implicit layout), or an optimizer finalized with
``post_sharding`` onto this member's pieces (replicated copies, flattened slices,
whole-parameter owners) under a codebook scope over the layout's members. After each step the
members all-gather their pieces into the driver (what a data-parallel adapter does), so the
driver's loss is the run's loss.

A case trains the source layout, exports its portable state through gefen-portable, then
continues four runs from the same checkpointed parameters: the source itself (uninterrupted),
a twin of the source layout that imported the state (bit-exact), the target layout that
imported it (resumed) and the target layout without it (dropped).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
from gefen_core import Gefen, GefenMuon
from gefen_portable import PortableState, export_portable_state, import_portable_state

LIMITS = PortableStateLimits(chunk_bytes=4096)  # several chunks per field
BEFORE = 6
AFTER = 20
AXIS = "dp"
_GROUPS: dict[int, Any] = {}


# -- models and data ---------------------------------------------------------------------------------


class Net(torch.nn.Module):
    """Gefen's model: an embedding and a bias (replicated), two 4096-element matrices (flattened).
    Cuts at 2048 fall on block boundaries for every period; near-even cuts in three do not."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(16, 32) * 0.5)
        self.up = torch.nn.Parameter(torch.randn(128, 32) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(128, 32) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(32))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        return torch.tanh(hidden @ self.up.T) @ self.down + self.bias

    @staticmethod
    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, 16, (8, 5), generator=generator)
        target = torch.randn(8, 32, generator=generator)
        return torch.nn.functional.mse_loss(model(tokens), target)


class Matrices(torch.nn.Module):
    """GefenMuon's model: three matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(24, 16) * 0.2)
        self.b = torch.nn.Parameter(torch.randn(16, 24) * 0.2)
        self.c = torch.nn.Parameter(torch.randn(24, 24) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ self.c) @ self.a) @ self.b

    @staticmethod
    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(500 + step)
        x = torch.randn(6, 24, generator=generator)
        target = torch.randn(6, 24, generator=generator)
        return torch.nn.functional.mse_loss(model(x), target)


@dataclass(frozen=True)
class Kind:
    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[Any], Any]


KINDS = {
    "gefen": Kind(Net, lambda named: Gefen(named, lr=1e-2, fused=False, factored_v_2d=False)),
    "muon": Kind(Matrices, lambda named: GefenMuon(named, lr=2e-2, fused=False)),
}


def driver(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return KINDS[kind].model()


# -- layouts -----------------------------------------------------------------------------------------

#: ``(layout, detail)`` per parameter: ``("repl", None)``, ``("flat", cuts)`` or ``("owner", rank)``.
Spec = dict[str, tuple[str, Any]]


def _even(numel: int, members: int) -> tuple[int, ...]:
    size = -(-numel // members)
    return tuple(min(numel, size * r) for r in range(1, members))


def gefen_layout(members: int) -> Spec:
    cuts = _even(4096, members)
    return {"embed": ("repl", None), "up": ("flat", cuts), "down": ("flat", cuts), "bias": ("repl", None)}


MUON_LAYOUTS: dict[str, Spec] = {
    "two_owners": {"a": ("owner", 0), "b": ("owner", 1), "c": ("repl", None)},
    "three_owners": {"a": ("repl", None), "b": ("owner", 2), "c": ("owner", 1)},
}


def group(size: int) -> ProcessGroupIdentity:
    return ProcessGroupIdentity(f"tests.bound{size}", tuple(f"rank:{r}" for r in range(size)))


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
    layout, detail = spec
    out = []
    for r in range(size):
        if layout == "repl":
            placement = ShardPlacement(AXIS, PlacementKind.REPLICATE, r, size)
            kind, extent, owner = ParameterLayout.REPLICATED, LogicalSlice.full(identity), None
        elif layout == "flat":
            bounds = (0, *detail, identity.numel)
            placement = ShardPlacement(AXIS, PlacementKind.FLAT_SHARD, r, size)
            kind, extent, owner = (
                ParameterLayout.FLATTENED_ELEMENT_SHARD,
                LogicalSlice(bounds[r], bounds[r + 1] - bounds[r]),
                None,
            )
        else:
            placement = ShardPlacement(AXIS, PlacementKind.WHOLE_PARAMETER_OWNER, r, size)
            extent = LogicalSlice.full(identity) if r == detail else LogicalSlice(0, 0)
            kind, owner = ParameterLayout.WHOLE_PARAMETER_OWNER, f"rank:{detail}"
        out.append(ShardIdentity(identity, kind, extent, (placement,), group(size), f"rank:{r}", owner=owner))
    return out


def _piece(full: torch.Tensor, shard: ShardIdentity) -> torch.Tensor:
    extent = shard.extent
    assert type(extent) is LogicalSlice
    if shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        return full.detach().reshape(-1)[extent.flat_offset : extent.end]
    return full.detach()


class Runner:
    """One member's optimizer over the driver: single-process (``size == 1``) or bound."""

    def __init__(self, kind: str, model: torch.nn.Module, rank: int, size: int, spec: Spec | None) -> None:
        self.kind, self.model, self.size = kind, model, size
        self.pieces: dict[str, tuple[ShardIdentity, torch.Tensor | None]] = {}
        if size == 1:
            self.optimizer = KINDS[kind].optimizer(model.named_parameters())
            return
        assert spec is not None
        named = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in model.named_parameters()]
        self.optimizer = KINDS[kind].optimizer(named)
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
            loss = KINDS[self.kind].model.loss(self.model, step)  # type: ignore[attr-defined]
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


def _share(value: Any) -> Any:
    """Test plumbing only: every rank receives rank 0's value (weights-only bytes)."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = [buffer.getvalue()]
    dist.broadcast_object_list(payload, src=0)
    return torch.load(io.BytesIO(payload[0]), weights_only=True)


def _at(kind: str, values: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = driver(kind)
    model.load_state_dict(values)
    return model


def _import(runner: Runner, state: Any, rank: int, size: int, transaction: str) -> None:
    import_portable_state(
        runner.optimizer,
        state,
        checkpoint_process_group=checkpoint_binding(rank, size),
        transaction_id=transaction,
        limits=LIMITS,
    )


def reshard(rank: int, world: int, kind: str, source: tuple[int, str], target: tuple[int, str]) -> dict[str, Any]:
    """The case of the module docstring: ``source`` and ``target`` are ``(members, layout name)``
    (``gefen_layout(members)`` for Gefen; a name of :data:`MUON_LAYOUTS` for GefenMuon)."""
    _process_group(2)

    def spec(members: int, name: str) -> Spec | None:
        if members == 1:
            return None
        return gefen_layout(members) if kind == "gefen" else MUON_LAYOUTS[name]

    (src_size, src_name), (tgt_size, tgt_name) = source, target
    in_source, in_target = rank < src_size, rank < tgt_size
    model = driver(kind)
    src = Runner(kind, model, rank, src_size, spec(src_size, src_name)) if in_source else None
    if src is not None:
        src.train(0, BEFORE)
    checkpoint = _share({n: p.detach().clone() for n, p in model.named_parameters()})
    state: Any = None
    if src is not None and (src_size > 1 or rank == 0):
        state = export_portable_state(
            src.optimizer, checkpoint_process_group=checkpoint_binding(rank, src_size), transaction_id="export",
            limits=LIMITS,
        )  # fmt: skip
    document = None
    if tgt_size == 1 and src is not None and src_size > 1:
        document = state.materialize(checkpoint_binding(rank, src_size), limits=LIMITS)
    catalog = _share(state.catalog_record() if rank == 0 else None)
    if state is None:
        state = PortableState.from_parts(catalog, [], limits=LIMITS)
    outcome: dict[str, Any] = {}
    if in_source:
        twin = Runner(kind, _at(kind, checkpoint), rank, src_size, spec(src_size, src_name))
        _import(twin, state, rank, src_size, "same-layout")
        assert src is not None
        outcome["uninterrupted"] = src.train(BEFORE, AFTER)
        outcome["twin"] = twin.train(BEFORE, AFTER)
        outcome["twin_bit_exact"] = twin.bits() == src.bits()
    if in_target:
        resumed = Runner(kind, _at(kind, checkpoint), rank, tgt_size, spec(tgt_size, tgt_name))
        _import(resumed, document if tgt_size == 1 and document is not None else state, rank, tgt_size, "reshard")
        outcome["resumed"] = resumed.train(BEFORE, AFTER)
        dropped = Runner(kind, _at(kind, checkpoint), rank, tgt_size, spec(tgt_size, tgt_name))
        outcome["dropped"] = dropped.train(BEFORE, AFTER)
    dist.barrier()
    return outcome

"""Shared plumbing of the gloo rank modules that bind optimizers with ``post_sharding``
(tests/bound_ranks.py, tests/hdcp_ranks.py; run inside GlooWorld ranks).

Every rank holds the same full *driver* model and computes the full gradient of the same
batch. A :class:`BoundMember` is one member's optimizer over the driver: single-process
(``size == 1``, the implicit layout) or finalized with ``post_sharding`` onto this member's
pieces (replicated copies, flattened slices, whole-parameter owners) under a codebook scope
over the layout's members. After each step the members all-gather their pieces into the
driver (what a data-parallel adapter does), so the driver's loss is the run's loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import (
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, CodebookProcessGroupBinding

AXIS = "dp"
#: ``(layout, detail)`` per parameter: ``("repl", None)``, ``("flat", cuts)`` or ``("owner", rank)``.
Spec = dict[str, tuple[str, Any]]
_GROUPS: dict[int, Any] = {}


def even_cuts(numel: int, members: int) -> tuple[int, ...]:
    """Cut points of ``numel`` flattened elements into ``members`` near-even slices."""
    size = -(-numel // members)
    return tuple(min(numel, size * r) for r in range(1, members))


def group(prefix: str, size: int) -> ProcessGroupIdentity:
    return ProcessGroupIdentity(f"{prefix}{size}", tuple(f"rank:{r}" for r in range(size)))


def process_group(size: int) -> Any:
    """One cached gloo group per size over ranks [0, size) (every rank creates every group once)."""
    if not _GROUPS:
        for members in range(2, dist.get_world_size() + 1):
            _GROUPS[members] = dist.new_group(list(range(members)))
    return None if size == 1 else _GROUPS[size]


def checkpoint_binding(prefix: str, rank: int, size: int) -> CheckpointProcessGroupBinding:
    return CheckpointProcessGroupBinding(group(prefix, size), f"rank:{rank}", process_group(size), torch.device("cpu"))


def layout_shards(
    name: str, shape: tuple[int, ...], spec: tuple[str, Any], members: ProcessGroupIdentity
) -> list[ShardIdentity]:
    """Every member's shard of parameter ``name`` under ``spec``."""
    identity = ParameterIdentity(name, shape)
    layout, detail = spec
    size = len(members.ordered_members)
    out = []
    for r in range(size):
        owner = None
        if layout == "repl":
            placement = ShardPlacement(AXIS, PlacementKind.REPLICATE, r, size)
            kind, extent = ParameterLayout.REPLICATED, LogicalSlice.full(identity)
        elif layout == "flat":
            bounds = (0, *detail, identity.numel)
            placement = ShardPlacement(AXIS, PlacementKind.FLAT_SHARD, r, size)
            kind = ParameterLayout.FLATTENED_ELEMENT_SHARD
            extent = LogicalSlice(bounds[r], bounds[r + 1] - bounds[r])
        else:
            placement = ShardPlacement(AXIS, PlacementKind.WHOLE_PARAMETER_OWNER, r, size)
            kind, owner = ParameterLayout.WHOLE_PARAMETER_OWNER, f"rank:{detail}"
            extent = LogicalSlice.full(identity) if r == detail else LogicalSlice(0, 0)
        out.append(ShardIdentity(identity, kind, extent, (placement,), members, f"rank:{r}", owner=owner))
    return out


def piece(full: torch.Tensor, shard: ShardIdentity) -> torch.Tensor:
    """The part of ``full`` that ``shard`` holds (a view)."""
    extent = shard.extent
    assert type(extent) is LogicalSlice
    if shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        return full.detach().reshape(-1)[extent.flat_offset : extent.end]
    return full.detach()


class BoundMember:
    """One member's optimizer over the driver (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: Callable[[int], torch.Tensor],
        make_optimizer: Callable[[Iterable[tuple[str, torch.nn.Parameter]]], Any],
        *,
        prefix: str,
        rank: int,
        size: int,
        spec: Spec | None,
    ) -> None:
        self.model, self.loss, self.size = model, loss, size
        self.pieces: dict[str, tuple[ShardIdentity, torch.Tensor | None]] = {}
        if size == 1:
            self.optimizer = make_optimizer(model.named_parameters())
            return
        assert spec is not None
        named = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in model.named_parameters()]
        self.optimizer = make_optimizer(named)
        rebindings, shards = [], []
        for name, parameter in named:
            every = layout_shards(name, tuple(parameter.shape), spec[name], group(prefix, size))
            shards.extend(every)
            mine = every[rank]
            pruned = mine.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not mine.is_owner
            target = None if pruned else torch.nn.Parameter(piece(parameter, mine).clone())
            self.pieces[name] = (mine, target)
            rebindings.append(ParameterRebinding(parameter, target, mine))
        scope = CodebookProcessGroupBinding(
            group(prefix, size), f"rank:{rank}", process_group(size), torch.device("cpu")
        )
        self.optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), scope=scope)

    def train(self, start: int, steps: int) -> list[float]:
        losses = []
        for step in range(start, start + steps):
            self.model.zero_grad(set_to_none=True)
            loss = self.loss(step)
            loss.backward()
            for name, parameter in self.model.named_parameters():
                shard, target = self.pieces.get(name, (None, None))
                if target is not None and shard is not None:
                    target.grad = piece(parameter.grad, shard).clone()  # type: ignore[arg-type]
            self.optimizer.step()
            if self.size > 1:
                self._gather()
            losses.append(float(loss.detach()))
        return losses

    def _gather(self) -> None:
        """Every member's pieces into the driver (the adapter's all-gather after a step)."""
        mine = {name: (shard, t.detach().clone()) for name, (shard, t) in self.pieces.items() if t is not None}
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, mine, group=process_group(self.size))
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                for pieces in everyone:
                    if name in pieces:
                        shard, value = pieces[name]
                        piece(parameter, shard).copy_(value)

    def bits(self) -> dict[str, bytes]:
        return {n: p.detach().numpy().tobytes() for n, p in self.model.named_parameters()}

"""Members of a bound layout inside spawned gloo ranks, for the kit's multi-process checks.

Every rank of a :class:`~gefen_contracts.testing.GlooWorld` builds the same full *driver*
model from the target and computes the full gradient of the same batch. A
:class:`GlooMember` is this rank's optimizer over the driver in one of three layouts:

* ``"single"``: one process, the optimizer built over the driver's own parameters (the
  implicit replicated layout, never bound);
* ``"replicated"``: bound with ``post_sharding`` to a full copy of every parameter, each
  copy a ``REPLICATED`` shard of the member group;
* ``"flattened"``: bound to this member's near-even contiguous slice of every flattened
  parameter (``FLATTENED_ELEMENT_SHARD``, the cuts of
  :func:`~gefen_contracts.testing.checks.plans.flat_slices`);
* ``"owner"``: every parameter whole on one member (``WHOLE_PARAMETER_OWNER``, parameter
  ``i`` on member ``i % size``); the other members hold an empty shard of it and bind nothing.

The member group is ranks ``[0, size)`` (``kit.gloo<size>``, members ``member:<rank>``).
An optimizer whose contract claims ``feature:collective_scope`` is bound with that group as
its scope. After each step the members all-gather their slices (or owned parameters) into the driver
(what a data-parallel adapter does), so every member's driver, and its loss, is the run's.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..capabilities import FEATURE_COLLECTIVE_SCOPE
from ..enums import ParameterLayout, PlacementKind
from ..identity import LogicalSlice, ParameterIdentity, ProcessGroupIdentity, ShardIdentity, ShardPlacement
from ..manifest import ShardingManifest
from ..rebinding import ParameterRebinding
from ..torch_support import CheckpointProcessGroupBinding, CodebookProcessGroupBinding
from .checks.plans import flat_slices
from .checks.twins import named_trainable
from .target import ConformanceTarget

__all__ = ["LAYOUTS", "GlooMember", "checkpoint_binding", "init_member_groups", "member_group", "share"]

#: The layouts a :class:`GlooMember` can take.
LAYOUTS = ("single", "replicated", "flattened", "owner")
_AXIS = "kit"
_CPU = torch.device("cpu")
_GROUPS: dict[int, Any] = {}


def init_member_groups() -> None:
    """Create the gloo group over ranks ``[0, size)`` for every size (once per process).

    Creating a group is a collective of the whole world: a rank function calls this first,
    on every rank, before any rank can skip the case."""
    if not _GROUPS:
        for members in range(2, dist.get_world_size() + 1):
            _GROUPS[members] = dist.new_group(list(range(members)))


def _process_group(size: int) -> Any:
    if size == 1:
        return None
    if not _GROUPS:
        raise RuntimeError("call init_member_groups() on every rank before binding a GlooMember")
    return _GROUPS[size]


def member_group(size: int) -> ProcessGroupIdentity:
    """The identity of the member group over ranks ``[0, size)``."""
    return ProcessGroupIdentity(f"kit.gloo{size}", tuple(f"member:{r}" for r in range(size)))


def checkpoint_binding(rank: int, size: int) -> CheckpointProcessGroupBinding:
    """The checkpoint binding of member ``rank`` of the group over ranks ``[0, size)``."""
    return CheckpointProcessGroupBinding(member_group(size), f"member:{rank}", _process_group(size), _CPU)


def share(value: Any) -> Any:
    """Every rank receives rank 0's ``value`` (through ``torch.save``, loaded weights-only)."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = [buffer.getvalue()]
    dist.broadcast_object_list(payload, src=0)
    return torch.load(io.BytesIO(payload[0]), weights_only=True)


def _shards(
    name: str, parameter: torch.Tensor, layout: str, group: ProcessGroupIdentity, index: int
) -> list[ShardIdentity]:
    identity = ParameterIdentity(name, tuple(parameter.shape))
    size = len(group.ordered_members)
    if layout == "owner":
        owner = group.ordered_members[index % size]
        return [
            ShardIdentity(
                identity,
                ParameterLayout.WHOLE_PARAMETER_OWNER,
                LogicalSlice.full(identity) if r == index % size else LogicalSlice(0, 0),
                (ShardPlacement(_AXIS, PlacementKind.WHOLE_PARAMETER_OWNER, r, size),),
                group,
                group.ordered_members[r],
                owner=owner,
            )
            for r in range(size)
        ]
    if layout == "replicated":
        return [
            ShardIdentity(
                identity,
                ParameterLayout.REPLICATED,
                LogicalSlice.full(identity),
                (ShardPlacement(_AXIS, PlacementKind.REPLICATE, r, size),),
                group,
                group.ordered_members[r],
            )
            for r in range(size)
        ]
    return [
        ShardIdentity(
            identity,
            ParameterLayout.FLATTENED_ELEMENT_SHARD,
            LogicalSlice(offset, length),
            (ShardPlacement(_AXIS, PlacementKind.FLAT_SHARD, r, size),),
            group,
            group.ordered_members[r],
        )
        for r, (offset, length) in enumerate(flat_slices(identity.numel, size))
    ]


def _extent(shard: ShardIdentity) -> tuple[int, int]:
    extent = shard.extent
    assert type(extent) is LogicalSlice
    return extent.flat_offset, extent.length


class GlooMember:
    """This rank's member of a ``layout`` over ranks ``[0, size)`` (module docstring).

    ``values`` (by FQN) replace the driver's initial parameters before the optimizer binds.
    """

    def __init__(
        self, target: ConformanceTarget, layout: str, size: int, *, values: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        if layout not in LAYOUTS or (layout == "single") != (size == 1):
            raise ValueError(f"a GlooMember is 'single' on one member or {LAYOUTS[1:]} on several, got {layout!r}")
        self.target, self.layout, self.size = target, layout, size
        self.rank = dist.get_rank()
        self.model, self.optimizer = target.build(0)
        if values is not None:
            with torch.no_grad():
                for name, parameter in self.model.named_parameters():
                    parameter.copy_(values[name])
        #: FQN -> (every member's shard, this member's bound tensor or None where it owns
        #: nothing); empty when single.
        self.pieces: dict[str, tuple[list[ShardIdentity], nn.Parameter | None]] = {}
        if layout == "single":
            return
        group = member_group(size)
        rebindings, shards = [], []
        for index, (name, tensor) in enumerate(named_trainable(self.model)):
            every = _shards(name, tensor, layout, group, index)
            shards.extend(every)
            mine = every[self.rank]
            if layout == "owner" and not mine.is_owner:
                self.pieces[name] = (every, None)
                rebindings.append(ParameterRebinding(tensor, None, mine))
                continue
            offset, length = _extent(mine)
            flat = tensor.detach().reshape(-1)[offset : offset + length]
            piece = flat if layout == "flattened" else flat.view_as(tensor)
            bound = nn.Parameter(piece.clone(), requires_grad=tensor.requires_grad)
            self.pieces[name] = (every, bound)
            rebindings.append(ParameterRebinding(tensor, bound, mine))
        options: dict[str, Any] = {}
        features = self.optimizer.optimizer_contract().capabilities.features  # type: ignore[attr-defined]
        if FEATURE_COLLECTIVE_SCOPE in features and features[FEATURE_COLLECTIVE_SCOPE].supported:
            options["scope"] = CodebookProcessGroupBinding(group, f"member:{self.rank}", _process_group(size), _CPU)
        self.optimizer.post_sharding(rebindings, manifest=ShardingManifest(tuple(shards)), **options)  # type: ignore[attr-defined]

    @property
    def binding(self) -> CheckpointProcessGroupBinding:
        """This member's checkpoint binding."""
        return checkpoint_binding(self.rank, self.size)

    def train(self, start: int, steps: int) -> list[float]:
        """Steps ``start .. start + steps - 1`` of the target's loss; the driver's losses."""
        losses = []
        for index in range(start, start + steps):
            self.model.zero_grad(set_to_none=True)
            loss = self.target.loss_fn(self.model, index)
            loss.backward()  # type: ignore[no-untyped-call]
            grads = {name: p.grad for name, p in self.model.named_parameters()}
            for name, (every, bound) in self.pieces.items():
                if bound is None:
                    continue
                grad = grads[name]
                offset, length = _extent(every[self.rank])
                bound.grad = None if grad is None else grad.reshape(-1)[offset : offset + length].clone().view_as(bound)
            self.optimizer.step()
            if self.pieces:
                self._gather()
            losses.append(float(loss.detach()))
        return losses

    def _gather(self) -> None:
        mine = {name: bound.detach().clone() for name, (_, bound) in self.pieces.items() if bound is not None}
        everyone: list[Any] = [None] * self.size
        if self.layout == "replicated":
            everyone[self.rank] = mine
        else:
            dist.all_gather_object(everyone, mine, group=_process_group(self.size))
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if name not in self.pieces:
                    continue
                every, _ = self.pieces[name]
                flat = parameter.view(-1)
                for member, values in enumerate(everyone):
                    if values is not None and name in values:
                        offset, length = _extent(every[member])
                        flat[offset : offset + length].copy_(values[name].reshape(-1))

    def parameter_values(self) -> dict[str, torch.Tensor]:
        """Copies of the driver's parameters."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def parameters_bits(self) -> dict[str, bytes]:
        """The driver's parameters, bit for bit."""
        return {
            n: p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for n, p in self.model.named_parameters()
        }

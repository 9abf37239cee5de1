"""A test adopter of the PortableAdapter Protocol for gefen-dcp's portable DCP tests.

``PieceSGD`` is SGD with momentum over the local pieces of a sharding manifest (replicated,
flattened slices or dimension-0 regions). Gradients are a deterministic function of
``(fqn, step)`` and the update is elementwise, so every layout is bit-identical to a
replicated run: a checkpoint saved on N members and loaded on M can be compared exactly.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_COMPOSITE,
    FEATURE_PORTABLE_STATE,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    StateValidationError,
    TrainingSupport,
)
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.contract import OptimizerChildContract
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    PlacementKind,
    Precision,
    ProcessGroupScope,
    TopologyChange,
)
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotLayout, PortableSlotState
from gefen_contracts.identity import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.transactions import StagedTransaction

IMPLEMENTATION = "gefen_dcp_test.PieceSGD"
SPECS = {"embed.weight": (12, 4), "head.weight": (5, 4), "head.bias": (5,), "scale": ()}
_LAYOUTS = frozenset(
    {ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD}
)
CONTRACT = OptimizerContract(
    implementation=IMPLEMENTATION,
    state_layout=OptimizerStateLayout(fields=(), parameter_variants=()),
    capabilities=OptimizerCapabilities(
        training=tuple(TrainingSupport(layout, ProcessGroupScope.ADAPTER_DEFINED) for layout in sorted(_LAYOUTS)),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.CANONICAL_GLOBAL,
                _LAYOUTS,
                ProcessGroupScope.ADAPTER_DEFINED,
                LoadAtomicity.GROUP_VOTED,
                transitions=(TopologyTransition(_LAYOUTS, _LAYOUTS, frozenset({TopologyChange.PLACEMENT_RESHARD})),),
                requires_collective=True,
            ),
        ),
        precisions=frozenset({Precision.FLOAT32}),
        supported_parameter_ranks=None,
        features={FEATURE_PORTABLE_STATE: FeatureStatus.yes()},
    ),
)


def group(size: int) -> ProcessGroupIdentity:
    return ProcessGroupIdentity("dp", tuple(f"rank:{r}" for r in range(size)))


def cuts(total: int, parts: int, uneven: bool) -> list[int]:
    if uneven and parts > 1 and total > parts:
        first = total // parts + 1
        rest = [(total - first) * i // (parts - 1) for i in range(parts)]
        return [0] + [first + r for r in rest]
    return [total * i // parts for i in range(parts + 1)]


def manifest(kind: str, size: int, *, uneven: bool = False, only: frozenset[str] | None = None) -> ShardingManifest:
    """``replicated`` (ungrouped when ``size == 1``), ``flat`` slices or dimension-0 ``region``s
    (of the parameters in ``only``, default all)."""
    shards = []
    pg = group(size)
    for fqn, shape in SPECS.items():
        if only is not None and fqn not in only:
            continue
        identity = ParameterIdentity(fqn, shape)
        if kind == "replicated" and size == 1:
            shards.append(ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity)))
            continue
        for coordinate, member in enumerate(pg.ordered_members):
            if kind == "replicated" or (kind == "region" and not shape):
                layout = (
                    ParameterLayout.REPLICATED if kind == "replicated" else ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
                )
                extent: Any = LogicalSlice.full(identity) if kind == "replicated" else LogicalRegion.full(identity)
                placement = ShardPlacement("dp", PlacementKind.REPLICATE, coordinate, size)
            elif kind == "flat":
                bounds = cuts(identity.numel, size, uneven)
                layout = ParameterLayout.FLATTENED_ELEMENT_SHARD
                extent = LogicalSlice(bounds[coordinate], bounds[coordinate + 1] - bounds[coordinate])
                placement = ShardPlacement("dp", PlacementKind.FLAT_SHARD, coordinate, size)
            else:
                bounds = cuts(shape[0], size, uneven)
                layout = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
                lengths = (bounds[coordinate + 1] - bounds[coordinate], *shape[1:])
                extent = LogicalRegion((bounds[coordinate], *([0] * (len(shape) - 1))), lengths)
                placement = ShardPlacement("dp", PlacementKind.DIMENSION_SHARD, coordinate, size, parameter_dimension=0)
            shards.append(ShardIdentity(identity, layout, extent, (placement,), pg, member))
    return ShardingManifest(tuple(shards))


def piece_of(full: torch.Tensor, shard: ShardIdentity) -> torch.Tensor:
    extent = shard.extent
    if isinstance(extent, LogicalSlice):
        if shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
            return full.reshape(-1)[extent.flat_offset : extent.end].clone()
        return full.clone()
    view = full
    for axis, (offset, length) in enumerate(zip(extent.offsets, extent.lengths)):
        view = view.narrow(axis, offset, length)
    return view.clone()


def gradient(fqn: str, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(fqn.encode()) + 7919 * step)
    return torch.randn(SPECS[fqn], generator=generator)


def initial_values() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {fqn: torch.randn(shape, generator=generator) for fqn, shape in SPECS.items()}


class PieceSGD(torch.optim.Optimizer):
    """Elementwise SGD with momentum over this member's pieces (see the module docstring)."""

    def __init__(
        self, layout: ShardingManifest, member: str | None, *, lr: float = 0.05, momentum: float = 0.9
    ) -> None:
        self.layout_manifest = layout
        self.shards = {s.fqn: s for s in layout.shards if s.process_group is None or s.local_member == member}
        values = initial_values()
        self.pieces = {fqn: piece_of(values[fqn], shard) for fqn, shard in self.shards.items()}
        super().__init__(list(self.pieces.values()), {"lr": lr, "momentum": momentum})
        self._version = 0

    def optimizer_contract(self) -> OptimizerContract:
        return CONTRACT

    @torch.no_grad()
    def train(self, start: int, count: int) -> None:
        group = self.param_groups[0]
        for step in range(start, start + count):
            for fqn, piece in self.pieces.items():
                grad = piece_of(gradient(fqn, step), self.shards[fqn])
                state = self.state[piece]
                buffer = grad if not state else state["momentum_buffer"] * group["momentum"] + grad
                state["momentum_buffer"] = buffer
                state["step"] = state.get("step", 0) + 1
                piece.add_(buffer * -group["lr"])
        self._version += 1

    def momentum(self) -> dict[str, torch.Tensor | None]:
        return {
            fqn: self.state[p]["momentum_buffer"].clone() if self.state.get(p) else None
            for fqn, p in self.pieces.items()
        }

    def _options(self) -> dict[str, object]:
        return {k: self.param_groups[0][k] for k in ("lr", "momentum")}

    def portable_layout(self) -> PortableLayout:
        fqns = sorted(self.shards)
        slots = tuple(PortableSlotLayout(self.shards[fqn], (0, i), fqn) for i, fqn in enumerate(fqns))
        return PortableLayout(IMPLEMENTATION, self.layout_manifest, slots)

    def portable_export(self) -> PortableExport:
        slots = []
        for slot in self.portable_layout().slots:
            state = self.state.get(self.pieces[slot.fqn])
            if not state:
                slots.append(PortableSlotState(slot, self._options(), "pristine"))
                continue
            slots.append(
                PortableSlotState(
                    slot,
                    self._options(),
                    "momentum",
                    {"step": state["step"]},
                    element_fields={"momentum": state["momentum_buffer"].clone()},
                )
            )
        return PortableExport(IMPLEMENTATION, {"schema": 1}, {}, self.layout_manifest, tuple(slots))

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        if implementation != IMPLEMENTATION or dict(policy) != {"schema": 1} or dict(common):
            raise StateValidationError("another implementation, policy or common state")
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for slot in slots:
            piece = self.pieces[slot.fqn]
            if dict(slot.options) != self._options():
                raise StateValidationError(f"options of {slot.fqn!r} differ")
            if slot.variant == "pristine":
                continue
            buffer = slot.element_fields["momentum"]
            if not isinstance(buffer, torch.Tensor) or buffer.shape != piece.shape:
                raise StateValidationError(f"momentum of {slot.fqn!r} has the wrong shape")
            new_state[piece] = {"momentum_buffer": buffer.clone(), "step": slot.counters["step"]}
        return StagedTransaction(self, kind="portable_import", token=self._version, payload=new_state)

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        payload = staged.claim(self, kind="portable_import", current_token=self._version)
        # torch's state is a defaultdict(dict): a parameter without saved state gets an entry at its step
        self.state = defaultdict(dict, payload)
        self._version += 1


ROLES = {"first": frozenset({"embed.weight", "scale"}), "second": frozenset({"head.weight", "head.bias"})}
COMPOSITE_IMPLEMENTATION = "gefen_dcp_test.PieceComposite"


class PieceComposite:
    """Two PieceSGD children (a ``Composite``) splitting the parameters by :data:`ROLES`."""

    def __init__(self, kind: str, size: int, member: str | None, *, uneven: bool = False) -> None:
        self.children = {
            role: PieceSGD(manifest(kind, size, uneven=uneven, only=fqns), member) for role, fqns in ROLES.items()
        }

    def child_optimizers(self) -> Mapping[str, PieceSGD]:
        return dict(self.children)

    def parameter_routing(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((fqn, role) for role, fqns in ROLES.items() for fqn in fqns))

    def optimizer_contract(self) -> OptimizerContract:
        roles = tuple(self.children)
        return OptimizerContract(
            implementation=COMPOSITE_IMPLEMENTATION,
            state_layout=OptimizerStateLayout((), (), composite_namespaces=roles),
            capabilities=OptimizerCapabilities(
                training=(TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.ADAPTER_DEFINED),),
                checkpoints=(),
                precisions=frozenset({Precision.FLOAT32}),
                supported_parameter_ranks=None,
                features={
                    FEATURE_COMPOSITE: FeatureStatus.yes(),
                    FEATURE_PORTABLE_STATE: FeatureStatus.no("exported child by child through the composite wrapper"),
                },
            ),
            children=tuple(OptimizerChildContract(role, IMPLEMENTATION, CONTRACT) for role in roles),
        )

    def train(self, start: int, count: int) -> None:
        for child in self.children.values():
            child.train(start, count)

    def momentum(self) -> dict[str, torch.Tensor | None]:
        return {fqn: m for child in self.children.values() for fqn, m in child.momentum().items()}


def reference_momentum(steps: int) -> dict[str, torch.Tensor]:
    """The full momentum after ``steps`` of a replicated run (every layout matches it)."""
    optimizer = PieceSGD(manifest("replicated", 1), None)
    optimizer.train(0, steps)
    return {k: v for k, v in optimizer.momentum().items() if v is not None}

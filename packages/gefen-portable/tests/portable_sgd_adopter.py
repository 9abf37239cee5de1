"""Test adopters of the portable Protocol: SGD with momentum over pieces of a manifest, and a
two-child composite of them. Importable by spawned gloo ranks (module-level names only).

``PortableSGD`` keeps, per local piece, ``momentum_buffer`` (dense, shaped like the piece:
an element field) and ``step`` (a counter), and with ``scaled=True`` also ``lr_scale``, a
one-element tensor that depends only on the step and is therefore identical on every
replica (a replica field). It trains on any manifest layout: each piece takes its slice of
the full gradient. Elementwise updates make every layout bit-identical to a replicated
reference.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateValidationError,
    StateVariant,
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
    StateExtent,
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

IMPLEMENTATION = "gefen_test.PortableSGD"
COMPOSITE_IMPLEMENTATION = "gefen_test.PortableComposite"
_LAYOUTS = frozenset(
    {
        ParameterLayout.REPLICATED,
        ParameterLayout.FLATTENED_ELEMENT_SHARD,
        ParameterLayout.WHOLE_PARAMETER_OWNER,
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
    }
)
_RESHARDABLE = frozenset(
    {ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD}
)
_AXIS = "dp"

STATE_LAYOUT = OptimizerStateLayout(
    fields=(
        StateField("momentum_buffer", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),
        StateField("step", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
        StateField("lr_scale", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
    ),
    parameter_variants=(
        StateVariant("pristine", (), _LAYOUTS, StateExtent.METADATA_ONLY, initialized=False),
        StateVariant("momentum", ("momentum_buffer", "step"), _LAYOUTS, StateExtent.LOCAL_STORAGE),
        StateVariant("momentum_scaled", ("momentum_buffer", "step", "lr_scale"), _LAYOUTS, StateExtent.LOCAL_STORAGE),
    ),
)


def _contract(portable: bool) -> OptimizerContract:
    grouped = ProcessGroupScope.ADAPTER_DEFINED
    checkpoints = ()
    if portable:
        checkpoints = (
            CheckpointSupport(
                CheckpointTransport.CANONICAL_GLOBAL,
                _LAYOUTS,
                grouped,
                LoadAtomicity.GROUP_VOTED,
                transitions=(
                    TopologyTransition(_RESHARDABLE, _RESHARDABLE, frozenset({TopologyChange.PLACEMENT_RESHARD})),
                    TopologyTransition(
                        frozenset({ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER}),
                        frozenset({ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER}),
                        frozenset({TopologyChange.WORLD_SIZE_OWNER_REDISTRIBUTION}),
                    ),
                ),
                requires_collective=True,
            ),
        )
    no = FeatureStatus.no
    return OptimizerContract(
        implementation=IMPLEMENTATION,
        state_layout=STATE_LAYOUT,
        capabilities=OptimizerCapabilities(
            training=tuple(TrainingSupport(layout, grouped) for layout in sorted(_LAYOUTS)),
            checkpoints=checkpoints,
            precisions=frozenset({Precision.FLOAT32}),
            supported_parameter_ranks=None,
            features={
                FEATURE_STAGED_NATIVE_LOAD: no("the test adopter has no staged native load"),
                FEATURE_POST_SHARDING: no("pieces are given at construction"),
                FEATURE_CANONICAL_IDENTITY: no("post_sharding is not implemented"),
                FEATURE_CANONICAL_LOCAL_STATE: no("only portable state"),
                FEATURE_PORTABLE_STATE: FeatureStatus.yes() if portable else no("disabled for this test"),
                FEATURE_PARAMETER_SHAPED_STATE: no("its state is not declared parameter-shaped"),
                FEATURE_COLLECTIVE_SCOPE: no("it learns nothing collectively"),
                FEATURE_COMPOSITE: no("it has no children"),
            },
        ),
    )


CONTRACT = _contract(True)
CONTRACT_WITHOUT_PORTABLE = _contract(False)


# -- layouts ------------------------------------------------------------------------------


def group(size: int, name: str = "dp") -> ProcessGroupIdentity:
    return ProcessGroupIdentity(name, tuple(f"rank:{r}" for r in range(size)))


def replicated_manifest(specs: Mapping[str, tuple[int, ...]], pg: ProcessGroupIdentity | None) -> ShardingManifest:
    shards = []
    for fqn, shape in specs.items():
        identity = ParameterIdentity(fqn, shape)
        if pg is None:
            shards.append(ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity)))
            continue
        n = len(pg.ordered_members)
        for coordinate, member in enumerate(pg.ordered_members):
            placement = ShardPlacement(_AXIS, PlacementKind.REPLICATE, coordinate, n)
            shards.append(
                ShardIdentity(
                    identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity), (placement,), pg, member
                )
            )
    return ShardingManifest(tuple(shards))


def even_cuts(numel: int, parts: int) -> list[int]:
    base, extra = divmod(numel, parts)
    cuts = [0]
    for index in range(parts):
        cuts.append(cuts[-1] + base + (1 if index < extra else 0))
    return cuts


def flattened_manifest(
    specs: Mapping[str, tuple[int, ...]],
    pg: ProcessGroupIdentity,
    cuts: Mapping[str, Sequence[int]] | None = None,
) -> ShardingManifest:
    shards = []
    n = len(pg.ordered_members)
    for fqn, shape in specs.items():
        identity = ParameterIdentity(fqn, shape)
        bounds = list((cuts or {}).get(fqn) or even_cuts(identity.numel, n))
        for coordinate, member in enumerate(pg.ordered_members):
            start, end = bounds[coordinate], bounds[coordinate + 1]
            placement = ShardPlacement(_AXIS, PlacementKind.FLAT_SHARD, coordinate, n)
            shards.append(
                ShardIdentity(
                    identity,
                    ParameterLayout.FLATTENED_ELEMENT_SHARD,
                    LogicalSlice(start, end - start),
                    (placement,),
                    pg,
                    member,
                )
            )
    return ShardingManifest(tuple(shards))


def owner_manifest(
    specs: Mapping[str, tuple[int, ...]], pg: ProcessGroupIdentity, owners: Mapping[str, int]
) -> ShardingManifest:
    shards = []
    n = len(pg.ordered_members)
    for fqn, shape in specs.items():
        identity = ParameterIdentity(fqn, shape)
        owner = pg.ordered_members[owners[fqn]]
        for coordinate, member in enumerate(pg.ordered_members):
            placement = ShardPlacement(_AXIS, PlacementKind.WHOLE_PARAMETER_OWNER, coordinate, n)
            extent = LogicalSlice.full(identity) if member == owner else LogicalSlice(0, 0)
            shards.append(
                ShardIdentity(identity, ParameterLayout.WHOLE_PARAMETER_OWNER, extent, (placement,), pg, member, owner)
            )
    return ShardingManifest(tuple(shards))


def region_manifest(
    specs: Mapping[str, tuple[int, ...]], pg: ProcessGroupIdentity, cuts: Mapping[str, Sequence[int]] | None = None
) -> ShardingManifest:
    """DTensor-style regions sharded along dimension 0 (scalars are replicated)."""
    shards = []
    n = len(pg.ordered_members)
    for fqn, shape in specs.items():
        identity = ParameterIdentity(fqn, shape)
        bounds = list((cuts or {}).get(fqn) or (even_cuts(shape[0], n) if shape else []))
        for coordinate, member in enumerate(pg.ordered_members):
            if not shape:
                placement = ShardPlacement(_AXIS, PlacementKind.REPLICATE, coordinate, n)
                region = LogicalRegion.full(identity)
            else:
                placement = ShardPlacement(_AXIS, PlacementKind.DIMENSION_SHARD, coordinate, n, parameter_dimension=0)
                start, end = bounds[coordinate], bounds[coordinate + 1]
                region = LogicalRegion((start, *([0] * (len(shape) - 1))), (end - start, *shape[1:]))
            shards.append(
                ShardIdentity(identity, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD, region, (placement,), pg, member)
            )
    return ShardingManifest(tuple(shards))


def piece_of(full: torch.Tensor, shard: ShardIdentity) -> torch.Tensor | None:
    """This shard's piece of a full tensor (a copy), or None for a non-owner."""
    if shard.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not shard.is_owner:
        return None
    extent = shard.extent
    if shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        assert isinstance(extent, LogicalSlice)
        return full.detach().reshape(-1)[extent.flat_offset : extent.end].clone()
    if isinstance(extent, LogicalRegion):
        view = full.detach()
        for axis, (offset, length) in enumerate(zip(extent.offsets, extent.lengths)):
            view = view.narrow(axis, offset, length)
        return view.clone()
    return full.detach().clone()


def local_shards(manifest: ShardingManifest, member: str | None) -> list[ShardIdentity]:
    return [s for s in manifest.shards if s.local_member == member or s.process_group is None]


def initial_values(specs: Mapping[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {fqn: torch.randn(shape, generator=generator) for fqn, shape in specs.items()}


def gradient(fqn: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(fqn.encode()) + 7919 * step)
    return torch.randn(shape, generator=generator)


# -- the optimizer ------------------------------------------------------------------------


class PortableSGD(torch.optim.Optimizer):
    """SGD with momentum over the local pieces of ``manifest`` (see the module docstring)."""

    def __init__(
        self,
        manifest: ShardingManifest,
        member: str | None,
        values: Mapping[str, torch.Tensor],
        *,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.01,
        scaled: bool = False,
        portable: bool = True,
        adopt: bool = False,
    ) -> None:
        self.manifest = manifest
        self.member = member
        self.scaled = scaled
        self.portable = portable
        self.fqns = manifest.fqns
        self.shards = {s.fqn: s for s in local_shards(manifest, member)}
        self.pieces: dict[str, torch.Tensor | None] = {
            fqn: values[fqn] if adopt else piece_of(values[fqn], shard) for fqn, shard in self.shards.items()
        }
        self.names = {id(t): fqn for fqn, t in self.pieces.items() if t is not None}
        params = [t for t in self.pieces.values() if t is not None]
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self.global_step = 0
        self._version = 0

    # -- training -----------------------------------------------------------------------

    def set_gradients(self, step: int) -> None:
        for fqn, piece in self.pieces.items():
            if piece is None:
                continue
            shard = self.shards[fqn]
            full = gradient(fqn, shard.parameter.global_shape, step)
            grad = piece_of(full, shard)
            assert grad is not None
            piece.grad = grad.reshape(piece.shape)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.global_step += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad + group["weight_decay"] * p
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = grad.clone()
                    state["step"] = 0
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(grad)
                state["step"] += 1
                scale = 1.0
                if self.scaled:
                    state["lr_scale"] = torch.tensor([1.0 / (1.0 + 0.1 * state["step"])])
                    scale = float(state["lr_scale"][0])
                p.add_(state["momentum_buffer"] * (-group["lr"] * scale))
        self._version += 1
        return None

    def train_steps(self, start: int, count: int) -> None:
        for index in range(start, start + count):
            self.set_gradients(index)
            self.step()

    def optimizer_contract(self) -> OptimizerContract:
        return CONTRACT if self.portable else CONTRACT_WITHOUT_PORTABLE

    # -- PortableAdapter ----------------------------------------------------------------

    def _policy(self) -> dict[str, object]:
        return {"schema": 1, "scaled": self.scaled}

    def _options(self) -> dict[str, object]:
        group = self.param_groups[0]
        return {k: group[k] for k in ("lr", "momentum", "weight_decay")}

    def portable_layout(self) -> PortableLayout:
        slots = tuple(
            PortableSlotLayout(self.shards[fqn], (0, self.fqns.index(fqn)), fqn.replace(".", "_")) for fqn in self.fqns
        )
        return PortableLayout(IMPLEMENTATION, self.manifest, slots)

    def portable_export(self) -> PortableExport:
        if not self.portable:
            from gefen_contracts import NotSupportedError

            raise NotSupportedError(FEATURE_PORTABLE_STATE, ("disabled for this test",))
        layout = self.portable_layout()
        slots = []
        for slot in layout.slots:
            piece = self.pieces[slot.fqn]
            state = self.state.get(piece, {}) if piece is not None else {}
            if not state:
                slots.append(PortableSlotState(slot, self._options(), "pristine"))
                continue
            replica = {"lr_scale": state["lr_scale"].clone()} if "lr_scale" in state else {}
            slots.append(
                PortableSlotState(
                    slot,
                    self._options(),
                    "momentum_scaled" if replica else "momentum",
                    {"step": state["step"]},
                    element_fields={"momentum": state["momentum_buffer"].clone()},
                    replica_fields=replica,
                )
            )
        return PortableExport(
            IMPLEMENTATION, self._policy(), {"global_step": self.global_step}, self.manifest, tuple(slots)
        )

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        if not self.portable:
            from gefen_contracts import NotSupportedError

            raise NotSupportedError(FEATURE_PORTABLE_STATE, ("disabled for this test",))
        if implementation != IMPLEMENTATION:
            raise StateValidationError(f"implementation {implementation!r} is not {IMPLEMENTATION!r}")
        if dict(policy) != self._policy():
            raise StateValidationError(f"policy {dict(policy)} differs from this optimizer's {self._policy()}")
        if set(common) != {"global_step"} or type(common["global_step"]) is not int or common["global_step"] < 0:
            raise StateValidationError("common must hold exactly an int global_step >= 0")
        layout = self.portable_layout()
        if [s.layout for s in slots] != list(layout.slots):
            raise StateValidationError("slots do not match this optimizer's layout")
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for slot in slots:
            piece = self.pieces[slot.fqn]
            if dict(slot.options) != self._options():
                raise StateValidationError(f"options of {slot.fqn!r} differ from this optimizer's")
            if slot.variant == "pristine" and (slot.element_fields or slot.counters or slot.replica_fields):
                raise StateValidationError(f"a pristine {slot.fqn!r} must carry no fields or counters")
            if piece is None or slot.variant == "pristine":
                if slot.variant not in ("pristine", "momentum", "momentum_scaled"):
                    raise StateValidationError(f"unknown variant {slot.variant!r}")
                continue
            expected_replica = {"lr_scale"} if slot.variant == "momentum_scaled" else set()
            if slot.variant not in ("momentum", "momentum_scaled"):
                raise StateValidationError(f"unknown variant {slot.variant!r} for {slot.fqn!r}")
            if set(slot.element_fields) != {"momentum"} or set(slot.counters) != {"step"}:
                raise StateValidationError(f"{slot.fqn!r} needs element field 'momentum' and counter 'step'")
            step = slot.counters["step"]
            if step < 1:
                raise StateValidationError(f"step of {slot.fqn!r} must be >= 1")
            buffer = slot.element_fields["momentum"]
            if not isinstance(buffer, torch.Tensor) or buffer.shape != piece.shape or buffer.dtype != torch.float32:
                raise StateValidationError(f"momentum of {slot.fqn!r} has the wrong shape or dtype")
            entry: dict[str, Any] = {"momentum_buffer": buffer.clone(), "step": step}
            if piece.numel() and set(slot.replica_fields) != expected_replica:
                raise StateValidationError(f"replica fields of {slot.fqn!r} must be {sorted(expected_replica)}")
            if "lr_scale" in slot.replica_fields:
                scale = slot.replica_fields["lr_scale"]
                assert isinstance(scale, torch.Tensor)
                if scale.shape != (1,) or not math.isfinite(float(scale[0])):
                    raise StateValidationError(f"lr_scale of {slot.fqn!r} must be one finite value")
                entry["lr_scale"] = scale.clone()
            elif slot.variant == "momentum_scaled":
                entry["lr_scale"] = torch.tensor([1.0 / (1.0 + 0.1 * step)])
            new_state[piece] = entry
        payload = (new_state, common["global_step"])
        return StagedTransaction(self, kind="portable_import", token=self._version, payload=payload)

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        payload = staged.claim(self, kind="portable_import", current_token=self._version)
        new_state, global_step = payload  # type: ignore[misc]
        # torch's state is a defaultdict(dict): a parameter without saved state gets an entry at its step
        self.state = defaultdict(dict, new_state)
        self.global_step = global_step
        self._version += 1

    # -- inspection for tests -----------------------------------------------------------

    def dense_state(self) -> dict[str, tuple[torch.Tensor | None, int | None]]:
        out: dict[str, tuple[torch.Tensor | None, int | None]] = {}
        for fqn, piece in self.pieces.items():
            state = self.state.get(piece, {}) if piece is not None else {}
            out[fqn] = (state.get("momentum_buffer"), state.get("step"))
        return out


class PortableComposite:
    """Two PortableSGD children with roles ``first`` and ``second`` (a Composite)."""

    def __init__(self, children: Mapping[str, PortableSGD]) -> None:
        self.children = dict(children)

    def child_optimizers(self) -> Mapping[str, PortableSGD]:
        return dict(self.children)

    def parameter_routing(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((fqn, role) for role, child in self.children.items() for fqn in child.fqns))

    def optimizer_contract(self) -> OptimizerContract:
        roles = tuple(self.children)
        no = FeatureStatus.no
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
                    FEATURE_PORTABLE_STATE: no("exported through the composite wrapper"),
                },
            ),
            children=tuple(
                OptimizerChildContract(role, IMPLEMENTATION, child.optimizer_contract())
                for role, child in self.children.items()
            ),
        )

    def train_steps(self, start: int, count: int) -> None:
        for child in self.children.values():
            child.train_steps(start, count)


def conformance_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> PortableSGD:
    """The kit's factory: an ungrouped replicated PortableSGD over the model's own parameters."""
    specs = {name: tuple(p.shape) for name, p in named_parameters}
    values = dict(named_parameters)
    return PortableSGD(replicated_manifest(specs, None), None, values, scaled=True, adopt=True)


_MULTI = "needs several processes and sharded optimizers (gefen-portable's gloo tests cover it)"


def _multi_process_claims() -> dict[str, str]:
    from gefen_contracts.testing import enumerate_claims

    replicated = ParameterLayout.REPLICATED.value
    return {
        claim: _MULTI
        for claim in enumerate_claims(CONTRACT)
        if (claim.startswith("checkpoint:canonical_global:") or claim.startswith("training:"))
        and not claim.startswith((f"checkpoint:canonical_global:{replicated}", f"training:{replicated}"))
    }


conformance_factory.conformance_waive = {  # type: ignore[attr-defined]
    **_multi_process_claims(),
    # its pieces are keyed by tensor id, per process: the README's PortableSGD is the copyable one
    "training.copies": "keys its shards by tensor id; packages/gefen-portable/README.md's PortableSGD passes the check",
}

"""Shared builders for the contracts tests (a module with a unique name, imported by tests)."""

from __future__ import annotations

from gefen_contracts import (
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
    StateVariant,
    TrainingSupport,
)
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    PlacementKind,
    Precision,
    ProcessGroupScope,
    StateExtent,
)
from gefen_contracts.identity import (
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)

GROUP = ProcessGroupIdentity("dp", ("rank:0", "rank:1"))


def flat_shard(
    fqn: str, shape: tuple[int, ...], offset: int, length: int, member: int, group: ProcessGroupIdentity = GROUP
) -> ShardIdentity:
    return ShardIdentity(
        ParameterIdentity(fqn, shape),
        ParameterLayout.FLATTENED_ELEMENT_SHARD,
        LogicalSlice(offset, length),
        (ShardPlacement("data_parallel", PlacementKind.FLAT_SHARD, member, len(group.ordered_members)),),
        group,
        group.ordered_members[member],
    )


def replicated(fqn: str, shape: tuple[int, ...]) -> ShardIdentity:
    identity = ParameterIdentity(fqn, shape)
    return ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity))


def simple_layout() -> OptimizerStateLayout:
    return OptimizerStateLayout(
        fields=(
            StateField("exp_avg", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),
            StateField("step", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
            StateField("scratch", StateScope.PARAMETER, StateRole.CACHE, StateGeometry.BLOCK),
            StateField("global_step", StateScope.OPTIMIZER_COMMON, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
        ),
        parameter_variants=(
            StateVariant(
                "stepped", ("exp_avg", "step"), frozenset({ParameterLayout.REPLICATED}), StateExtent.GLOBAL_PARAMETER
            ),
        ),
    )


def simple_capabilities(**overrides: object) -> OptimizerCapabilities:
    values: dict[str, object] = {
        "training": (TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),),
        "checkpoints": (
            CheckpointSupport(
                CheckpointTransport.NATIVE_OPTIMIZER,
                frozenset({ParameterLayout.REPLICATED}),
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            ),
        ),
        "precisions": frozenset({Precision.FLOAT32}),
        "supported_parameter_ranks": None,
        "features": {FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes()},
    }
    values.update(overrides)
    return OptimizerCapabilities(**values)  # type: ignore[arg-type]


def simple_contract(**overrides: object) -> OptimizerContract:
    values: dict[str, object] = {
        "implementation": "test.Optimizer",
        "state_layout": simple_layout(),
        "capabilities": simple_capabilities(),
    }
    values.update(overrides)
    return OptimizerContract(**values)  # type: ignore[arg-type]

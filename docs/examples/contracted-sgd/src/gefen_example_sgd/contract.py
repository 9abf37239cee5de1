"""The example adopter's contract: what ContractedSGD supports, and why not the rest."""

from __future__ import annotations

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
    StateVariant,
    TrainingSupport,
)
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
)

IMPLEMENTATION = "gefen_example.ContractedSGD"

STATE_LAYOUT = OptimizerStateLayout(
    fields=(
        StateField("momentum_buffer", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),
        StateField("step", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
    ),
    parameter_variants=(
        StateVariant(
            "momentum",
            ("momentum_buffer", "step"),
            frozenset({ParameterLayout.REPLICATED}),
            StateExtent.GLOBAL_PARAMETER,
        ),
    ),
)

CONTRACT = OptimizerContract(
    implementation=IMPLEMENTATION,
    state_layout=STATE_LAYOUT,
    capabilities=OptimizerCapabilities(
        training=(TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.NATIVE_OPTIMIZER,
                frozenset({ParameterLayout.REPLICATED}),
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            ),
            CheckpointSupport.torch_recipe(frozenset({ParameterLayout.REPLICATED})),
        ),
        precisions=frozenset(Precision),
        supported_parameter_ranks=None,
        features={
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
            FEATURE_POST_SHARDING: FeatureStatus.no("the example keeps no shard identity"),
            FEATURE_CANONICAL_IDENTITY: FeatureStatus.no("post_sharding is not implemented"),
            FEATURE_CANONICAL_LOCAL_STATE: FeatureStatus.no("native state dicts are its only checkpoint format"),
            FEATURE_PORTABLE_STATE: FeatureStatus.no("no portable adapter"),
            FEATURE_PARAMETER_SHAPED_STATE: FeatureStatus.no("its state is not declared parameter-shaped"),
            FEATURE_COLLECTIVE_SCOPE: FeatureStatus.no("it learns nothing collectively"),
            FEATURE_COMPOSITE: FeatureStatus.no("it has no children"),
        },
    ),
)

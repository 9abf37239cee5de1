"""What ``ContractedAdamW`` declares: its state keys, variants, claims and honest negatives."""

from __future__ import annotations

from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_DENSE_SHARD_CODEC,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    CheckpointSupport,
    CheckpointTransport,
    FeatureStatus,
    LoadAtomicity,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateVariant,
    TrainingSupport,
)

__all__ = ["ADAMW_CONTRACT", "ADAMW_IMPLEMENTATION", "ADAMW_STATE_LAYOUT"]

#: The stable implementation name; it never changes when modules move.
ADAMW_IMPLEMENTATION = "gefen.ContractedAdamW"

# AdamW is elementwise: a DTensor (FSDP2) local shard trains exactly like the same elements
# of the full tensor, with no collective, and its state is shaped like the local tensor.
_LAYOUT_ORDER = (ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD)
_LAYOUTS = frozenset(_LAYOUT_ORDER)


def _field(name: str, geometry: StateGeometry, description: str, *, optional: bool = False) -> StateField:
    return StateField(
        name,
        StateScope.PARAMETER,
        StateRole.AUTHORITATIVE,
        geometry,
        optional=optional,
        description=description,
    )


ADAMW_STATE_LAYOUT = OptimizerStateLayout(
    fields=(
        _field("step", StateGeometry.SCALAR, "steps taken by this parameter (0-dim float tensor, integral value)"),
        _field("exp_avg", StateGeometry.PARAMETER, "first moment, dtype and shape of the (local) parameter"),
        _field("exp_avg_sq", StateGeometry.PARAMETER, "second moment, dtype and shape of the (local) parameter"),
        _field(
            "max_exp_avg_sq",
            StateGeometry.PARAMETER,
            "running maximum of the second moment (amsgrad groups only)",
            optional=True,
        ),
    ),
    parameter_variants=(
        StateVariant(
            "adamw",
            ("step", "exp_avg", "exp_avg_sq"),
            _LAYOUTS,
            StateExtent.LOCAL_STORAGE,
            description="a parameter of a group with amsgrad=False that has stepped",
        ),
        StateVariant(
            "adamw_amsgrad",
            ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
            _LAYOUTS,
            StateExtent.LOCAL_STORAGE,
            description="a parameter of a group with amsgrad=True that has stepped",
        ),
    ),
)

_LATER = "added to ContractedAdamW by a later issue"

ADAMW_CONTRACT = OptimizerContract(
    implementation=ADAMW_IMPLEMENTATION,
    state_layout=ADAMW_STATE_LAYOUT,
    capabilities=OptimizerCapabilities(
        training=tuple(TrainingSupport(layout, ProcessGroupScope.NONE) for layout in _LAYOUT_ORDER),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.NATIVE_OPTIMIZER,
                _LAYOUTS,
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            ),
        ),
        precisions=frozenset(Precision),
        supported_parameter_ranks=None,
        features={
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
            FEATURE_POST_SHARDING: FeatureStatus.no(f"post_sharding (identity binding) is {_LATER}"),
            FEATURE_CANONICAL_IDENTITY: FeatureStatus.no(f"canonical identity needs post_sharding, {_LATER}"),
            FEATURE_CANONICAL_LOCAL_STATE: FeatureStatus.no(f"the canonical local state document is {_LATER}"),
            FEATURE_PORTABLE_STATE: FeatureStatus.no(f"the portable adapter is {_LATER}"),
            FEATURE_DENSE_SHARD_CODEC: FeatureStatus.no(f"the dense-shard codec for DCP resharding is {_LATER}"),
            FEATURE_COLLECTIVE_SCOPE: FeatureStatus.no("AdamW learns nothing collectively (no codebook, no scope)"),
            FEATURE_COMPOSITE: FeatureStatus.no("ContractedAdamW has no child optimizers"),
        },
    ),
)

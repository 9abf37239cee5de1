"""What ``ContractedAdamW`` declares: its state keys, variants, claims and honest negatives.

The contract is dynamic: identity, canonical-state, portable-state and parameter-shaped claims
appear only while the live optimizer is ready for them, and every negative says why
(:class:`AdamWReadiness`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
    TopologyChange,
)

__all__ = [
    "ADAMW_CONTRACT",
    "ADAMW_IMPLEMENTATION",
    "ADAMW_STATE_LAYOUT",
    "COLLECTIVE_SCOPE_REASON",
    "PARAMETER_SHAPED_LAYOUTS",
    "PARAMETER_SHAPED_SUPPORT",
    "FRESH_READINESS",
    "PORTABLE_LAYOUTS",
    "PORTABLE_SUPPORT",
    "AdamWReadiness",
    "adamw_contract",
]

#: The stable implementation name; it never changes when modules move.
ADAMW_IMPLEMENTATION = "gefen.ContractedAdamW"

# AdamW is elementwise: a flattened shard or a DTensor (FSDP2) local shard trains exactly like
# the same elements of the full tensor, with no collective, and its state is shaped like the
# local tensor.
_LAYOUT_ORDER = (
    ParameterLayout.REPLICATED,
    ParameterLayout.FLATTENED_ELEMENT_SHARD,
    ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
)
_LAYOUTS = frozenset(_LAYOUT_ORDER)


#: Not float16: torch's AdamW on pure fp16 parameters divides by an ``eps`` that rounds to 0
#: (1e-8) or nearly so, so an embedding row with no gradient becomes NaN or inf within three
#: steps (the kit's ``training.precisions`` check found it); train fp16 models with fp32
#: master weights under ``torch.autocast`` instead.
_PRECISIONS = frozenset({Precision.FLOAT32, Precision.BFLOAT16, Precision.FLOAT64})


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

_NATIVE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})
_TRAINING = tuple(TrainingSupport(layout, ProcessGroupScope.NONE) for layout in _LAYOUT_ORDER)


#: Why a feature is negative when the readiness record did not assess it.
_NOT_ASSESSED = FeatureStatus.no("not assessed for this readiness record")


@dataclass(frozen=True, slots=True)
class AdamWReadiness:
    """The live facts the contract depends on (computed by ``ContractedAdamW`` per query).

    ``post_sharding`` / ``identity`` / ``canonical`` / ``portable`` / ``parameter_shaped`` are
    the statuses of the features ``post_sharding``, ``canonical_identity``,
    ``canonical_local_state``, ``portable_state`` and ``parameter_shaped_state``;
    ``local_layouts`` are the layouts of the finalized local bindings (empty before
    ``post_sharding``). ``portable`` and ``parameter_shaped`` default to negative, so a record
    built with the first four fields only claims neither.
    """

    post_sharding: FeatureStatus
    identity: FeatureStatus
    canonical: FeatureStatus
    local_layouts: frozenset[ParameterLayout] = frozenset()
    portable: FeatureStatus = _NOT_ASSESSED
    parameter_shaped: FeatureStatus = _NOT_ASSESSED


#: A fresh ContractedAdamW built from named parameters: pristine, not finalized, portable
#: through its implicit ungrouped replicated layout, its state shaped like the parameters.
FRESH_READINESS = AdamWReadiness(
    post_sharding=FeatureStatus.yes(),
    identity=FeatureStatus.no("no shard identity is bound yet: call post_sharding first"),
    canonical=FeatureStatus.no("canonical local state is keyed by canonical FQNs: call post_sharding first"),
    portable=FeatureStatus.yes(),
    parameter_shaped=FeatureStatus.yes(),
)

#: Layouts whose portable state ContractedAdamW exports and imports (AdamW is elementwise, so
#: any element of the dense moments can be re-projected onto any piece).
PORTABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD})
#: Layouts whose native state is shaped like the parameters (torch's AdamW state: moments
#: placed like the parameter, ``step`` a plain scalar), so DCP reshards it.
PARAMETER_SHAPED_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})

#: The ``CANONICAL_GLOBAL`` entry while ``portable_state`` is supported: both layouts round
#: trip, and any source layout and member count reshards onto any target layout and member
#: count (a world-size change of replicated or flattened pieces is a placement reshard).
PORTABLE_SUPPORT = CheckpointSupport(
    CheckpointTransport.CANONICAL_GLOBAL,
    PORTABLE_LAYOUTS,
    ProcessGroupScope.ADAPTER_DEFINED,
    LoadAtomicity.GROUP_VOTED,
    transitions=(
        TopologyTransition(PORTABLE_LAYOUTS, PORTABLE_LAYOUTS, frozenset({TopologyChange.PLACEMENT_RESHARD})),
    ),
    requires_collective=True,
)
#: The ``PARAMETER_SHAPED`` entry while ``parameter_shaped_state`` is supported: replicated
#: tensors and DTensor (FSDP2) shards, resharded N -> M ranks by DCP bit for bit.
PARAMETER_SHAPED_SUPPORT = CheckpointSupport(
    CheckpointTransport.PARAMETER_SHAPED,
    PARAMETER_SHAPED_LAYOUTS,
    ProcessGroupScope.DEFAULT_WORLD,
    LoadAtomicity.GROUP_VOTED,
    transitions=(
        TopologyTransition(
            PARAMETER_SHAPED_LAYOUTS, PARAMETER_SHAPED_LAYOUTS, frozenset({TopologyChange.PLACEMENT_RESHARD})
        ),
    ),
    requires_collective=True,
)


@lru_cache(maxsize=64)
def adamw_contract(readiness: AdamWReadiness) -> OptimizerContract:
    """The contract of a ContractedAdamW in the state ``readiness`` describes.

    Static: training ``REPLICATED``, ``FLATTENED_ELEMENT_SHARD`` and ``DTENSOR_1D_DEFAULT_WORLD``
    (elementwise, no collective); atomic native checkpoints for ``REPLICATED`` and DTensor
    layouts, and torch's ``get/set_optimizer_state_dict`` recipe for both until
    ``post_sharding`` binds it; ``staged_native_load``. Dynamic: ``FLATTENED_ELEMENT_SHARD`` joins the native
    entry once flattened shards are bound; the ``CANONICAL_LOCAL`` entry (same-topology over
    the bound local layouts, fail-before-mutation, no collective) exists exactly while
    ``canonical_local_state`` is supported, :data:`PORTABLE_SUPPORT` exactly while
    ``portable_state`` is, and :data:`PARAMETER_SHAPED_SUPPORT` exactly while ``parameter_shaped_state`` is.
    """
    native = _NATIVE_LAYOUTS
    if ParameterLayout.FLATTENED_ELEMENT_SHARD in readiness.local_layouts:
        native = native | {ParameterLayout.FLATTENED_ELEMENT_SHARD}
    checkpoints = [
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER,
            native,
            ProcessGroupScope.NONE,
            LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
        )
    ]
    if not readiness.local_layouts:
        # torch's helpers keep only state and param_groups: a bound optimizer's identity guard would be dropped
        checkpoints.append(CheckpointSupport.torch_recipe(native))
    if readiness.canonical.supported:
        checkpoints.append(
            CheckpointSupport(
                CheckpointTransport.CANONICAL_LOCAL,
                readiness.local_layouts,
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            )
        )
    if readiness.portable.supported:
        checkpoints.append(PORTABLE_SUPPORT)
    if readiness.parameter_shaped.supported:
        checkpoints.append(PARAMETER_SHAPED_SUPPORT)
    return OptimizerContract(
        implementation=ADAMW_IMPLEMENTATION,
        state_layout=ADAMW_STATE_LAYOUT,
        capabilities=OptimizerCapabilities(
            training=_TRAINING,
            checkpoints=tuple(checkpoints),
            precisions=_PRECISIONS,
            supported_parameter_ranks=None,
            features={
                FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
                FEATURE_POST_SHARDING: readiness.post_sharding,
                FEATURE_CANONICAL_IDENTITY: readiness.identity,
                FEATURE_CANONICAL_LOCAL_STATE: readiness.canonical,
                FEATURE_PORTABLE_STATE: readiness.portable,
                FEATURE_PARAMETER_SHAPED_STATE: readiness.parameter_shaped,
                FEATURE_COLLECTIVE_SCOPE: FeatureStatus.no(COLLECTIVE_SCOPE_REASON),
                FEATURE_COMPOSITE: FeatureStatus.no("ContractedAdamW has no child optimizers"),
            },
        ),
    )


#: Why ContractedAdamW has no collective scope (also the refusal of a ``scope`` argument).
COLLECTIVE_SCOPE_REASON = "AdamW learns nothing collectively (no codebook, no scope)"

#: The contract of a fresh ContractedAdamW built from named parameters (pristine, not finalized).
ADAMW_CONTRACT = adamw_contract(FRESH_READINESS)

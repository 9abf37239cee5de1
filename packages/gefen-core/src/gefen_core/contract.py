"""Gefen's contract: what one ``Gefen`` instance supports today, and why not the rest.

Built from the instance's options and its identity readiness (:mod:`gefen_core.identity_claims`;
no tensors read, no collectives) and memoised per option set, so ``optimizer_contract()`` is
cheap, pure and equal for equal optimizers.
"""

from __future__ import annotations

from functools import lru_cache

from gefen_contracts import (
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
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

from . import native_format as F
from .codebook_scope import STEADY_STEP_BUDGET
from .identity import IdentityReadiness
from .identity_claims import FRESH, canonical_local_entry, identity_features, training_scope
from .momentum_codec import CODEBOOK_SIZE
from .ops import OPS
from .param_state import (
    BLOCK,
    BLOCK_KEYS,
    ELEMENT,
    ELEMENT_KEYS,
    FACTORED,
    FACTORED_KEYS,
    PARAMETER_FIELDS,
)
from .periods import FALLBACK_PERIOD_CAP
from .reference_ops import HISTOGRAM_BINS

__all__ = [
    "CANONICAL_LAYOUTS",
    "parameter_shaped_support",
    "parameter_shaped_status",
    "IMPLEMENTATION",
    "IMPLICIT_PORTABLE_SUPPORT",
    "PORTABLE_SUPPORT",
    "STATE_LAYOUT",
    "gefen_contract",
]

IMPLEMENTATION = "gefen.Gefen"

_REPL = ParameterLayout.REPLICATED
_FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD
_DTENSOR = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
#: Layouts whose state a canonical local document covers.
CANONICAL_LAYOUTS = frozenset({_REPL, _FLAT})


def _common(name: str, geometry: StateGeometry, description: str, optional: bool = False) -> StateField:
    return StateField(
        name, StateScope.OPTIMIZER_COMMON, StateRole.AUTHORITATIVE, geometry, optional=optional, description=description
    )


STATE_LAYOUT = OptimizerStateLayout(
    fields=(
        _common(F.FORMAT_VERSION, StateGeometry.SCALAR, "native format version (int)"),
        _common(F.GLOBAL_STEP, StateGeometry.SCALAR, "completed step() calls (int)"),
        _common(F.CODEBOOK, StateGeometry.TABLE, "shared fp32[256] momentum codebook (zeros before learning)"),
        _common(F.CODEBOOK_LEARNED, StateGeometry.SCALAR, "whether the codebook has been learned (bool)"),
        _common(F.DETERMINISTIC, StateGeometry.SCALAR, "the deterministic policy the state was produced under"),
        _common(
            F.STATE_DIGEST,
            StateGeometry.SCALAR,
            "SHA-256 digests of the record and every parameter's state ({layout, content})",
        ),
        StateField(
            F.GROUP_MIRROR,
            StateScope.CHECKPOINT_CARRIER,
            StateRole.TRANSPORT,
            StateGeometry.OPAQUE,
            optional=True,
            description="param-group copy of the optimizer-common record (survives torch DCP state-dict helpers)",
        ),
        *PARAMETER_FIELDS.values(),
    ),
    parameter_variants=(
        StateVariant(
            BLOCK,
            BLOCK_KEYS,
            frozenset({_REPL, _FLAT, _DTENSOR}),
            StateExtent.LOCAL_STORAGE,
            description="block-shared second moment (non-2-D parameters, flattened shards, or factored_v_2d=False)",
        ),
        StateVariant(
            FACTORED,
            FACTORED_KEYS,
            frozenset({_REPL}),
            StateExtent.GLOBAL_PARAMETER,
            parameter_ranks=(2,),
            description="factored second moment of a complete 2-D parameter",
        ),
        StateVariant(
            "factored_row_sharded",
            FACTORED_KEYS,
            frozenset({_DTENSOR}),
            StateExtent.LOCAL_STORAGE,
            parameter_ranks=(2,),
            description="factored second moment of a row-sharded 2-D DTensor: local v_row, replicated v_col",
        ),
        StateVariant(
            ELEMENT,
            ELEMENT_KEYS,
            frozenset({_REPL, _DTENSOR}),
            StateExtent.LOCAL_STORAGE,
            parameter_ranks=(2,),
            description="per-element second moment of a matrix narrower than min_dim_size_to_factor",
        ),
    ),
)

_NOT_ASSESSED = FeatureStatus.no("not assessed for this contract query")

_PORTABLE_LAYOUTS = frozenset({_REPL, _FLAT})
_PLACEMENT = frozenset({TopologyChange.PLACEMENT_RESHARD})
#: The ``update_rtol`` of every portable transition onto or from flattened shards: their cuts
#: split blocks, so the momentum codes are re-quantised onto the target's blocks and block
#: ``v`` is re-averaged (a factored ``v`` becomes block ``v`` and back). Measured through the
#: conformance kit's round trips on its small model (there and back, the next update moved
#: 0.10-0.19 relative L2); replicated copies on any member count move bit for bit.
RESHARD_UPDATE_RTOL = 0.125
#: The ``CANONICAL_GLOBAL`` entry while ``portable_state`` is supported and no sealed
#: ``post_sharding`` layout is bound: the implicit layout (one ``REPLICATED`` shard per named
#: parameter, one member) round trips, and takes the state of a bound layout of any member
#: count (replicated copies and flattened shards re-blocked onto whole parameters).
IMPLICIT_PORTABLE_SUPPORT = CheckpointSupport(
    CheckpointTransport.CANONICAL_GLOBAL,
    frozenset({_REPL}),
    ProcessGroupScope.ADAPTER_DEFINED,
    LoadAtomicity.GROUP_VOTED,
    transitions=(
        TopologyTransition(frozenset({_REPL}), frozenset({_REPL}), _PLACEMENT),
        TopologyTransition(frozenset({_FLAT}), frozenset({_REPL}), _PLACEMENT, RESHARD_UPDATE_RTOL),
    ),
    requires_collective=True,
)
#: The ``CANONICAL_GLOBAL`` entry while ``portable_state`` is supported over a sealed
#: ``post_sharding`` layout: replicated and flattened layouts round trip, and any of them on
#: any member count re-blocks onto any of them on any member count (gefen_core.reblocking).
PORTABLE_SUPPORT = CheckpointSupport(
    CheckpointTransport.CANONICAL_GLOBAL,
    _PORTABLE_LAYOUTS,
    ProcessGroupScope.ADAPTER_DEFINED,
    LoadAtomicity.GROUP_VOTED,
    transitions=(
        TopologyTransition(frozenset({_REPL}), frozenset({_REPL}), _PLACEMENT),
        TopologyTransition(_PORTABLE_LAYOUTS, frozenset({_FLAT}), _PLACEMENT, RESHARD_UPDATE_RTOL),
        TopologyTransition(frozenset({_FLAT}), frozenset({_REPL}), _PLACEMENT, RESHARD_UPDATE_RTOL),
    ),
    requires_collective=True,
)
_SHAPED_LAYOUTS = frozenset({_REPL, _DTENSOR})
_RESHARD = frozenset({TopologyChange.PLACEMENT_RESHARD})


def parameter_shaped_support(period_one_1d: bool) -> CheckpointSupport:
    """The ``PARAMETER_SHAPED`` entry while ``parameter_shaped_state`` is supported: the native
    state of plain tensors and DTensor (FSDP2) parameters, every state tensor shaped by
    :mod:`gefen_core.state_placement` and placed like its parameter (``v_col`` replicated, the
    codebook a plain tensor), so DCP reshards it N -> M ranks bit for bit: each declared
    transition is exact (nothing is re-quantised; FSDP2 learns one codebook per mesh).

    DTensor -> DTensor (any world size), DTensor -> replicated and replicated -> replicated
    always hold. Replicated -> DTensor holds when every group uses FSDP2's rule for 1-D
    parameters (``period_one_1d``: ``force_1d_period_one=True``), since a sharded 1-D parameter
    keeps one block per element; otherwise move that state as portable state (it re-blocks).
    Through torch's stock recipe, whose load template the loading optimizer builds, DTensor ->
    replicated needs that rule too for a model with 1-D parameters (``GefenDCPState`` does not).
    """
    transitions = [
        TopologyTransition(frozenset({_DTENSOR}), _SHAPED_LAYOUTS, _RESHARD),
        TopologyTransition(frozenset({_REPL}), frozenset({_REPL, _DTENSOR} if period_one_1d else {_REPL}), _RESHARD),
    ]
    return CheckpointSupport(
        CheckpointTransport.PARAMETER_SHAPED,
        _SHAPED_LAYOUTS,
        ProcessGroupScope.DEFAULT_WORLD,
        LoadAtomicity.GROUP_VOTED,
        transitions=tuple(transitions),
        mesh_dimensions=(1,),
        requires_collective=True,
    )


def parameter_shaped_status(readiness: IdentityReadiness) -> FeatureStatus:
    """``parameter_shaped_state``: yes unless ``post_sharding`` bound flattened element shards."""
    if readiness.finalized and _FLAT in readiness.layouts:
        return FeatureStatus.no(
            "flattened element shards hold state for a slice of the flattened parameter, which no DTensor "
            "describes; checkpoint them as portable state (gefen_dcp.save_portable_dcp)"
        )
    return FeatureStatus.yes()


def _training(readiness: IdentityReadiness) -> tuple[TrainingSupport, ...]:
    if readiness.finalized:
        scope = training_scope(readiness)
        return tuple(TrainingSupport(layout, scope) for layout in sorted(readiness.layouts))
    training = [
        TrainingSupport(_REPL, ProcessGroupScope.NONE),
        TrainingSupport(_DTENSOR, ProcessGroupScope.INFERRED_DEVICE_MESH, mesh_dimensions=(1,)),
    ]
    if readiness.post_sharding.supported:  # reachable through post_sharding
        training.append(TrainingSupport(_FLAT, ProcessGroupScope.NONE))
    return tuple(training)


def _checkpoints(readiness: IdentityReadiness, canonical: FeatureStatus) -> tuple[CheckpointSupport, ...]:
    native = readiness.layouts if readiness.finalized else frozenset({_REPL, _DTENSOR})
    rank_local = frozenset({_REPL, _DTENSOR})
    if readiness.finalized:
        # torch's DCP helpers keep only state and param_groups, so the shard-identity guard is
        # dropped: positions suffice only for ungrouped replicated parameters without a scope.
        rank_local = frozenset({_REPL}) if readiness.layouts == {_REPL} and not readiness.scoped else frozenset()
    entries = [
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER,
            native,
            ProcessGroupScope.NONE,
            LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
        )
    ]
    if rank_local:
        entries.append(CheckpointSupport.torch_recipe(rank_local))
    return (*entries, *canonical_local_entry(readiness, canonical, CANONICAL_LAYOUTS))


_UNBOUND = FeatureStatus.no("the optimizer is not finalized: call post_sharding with a ShardingManifest")


@lru_cache(maxsize=64)
def gefen_contract(
    *,
    readiness: IdentityReadiness = FRESH,
    canonical: FeatureStatus = _UNBOUND,
    deterministic: bool,
    stochastic_round: bool,
    capturable: bool,
    codebook_refresh_every: int,
    fused: bool | None,
    factored_v_2d: tuple[bool, ...],
    portable: FeatureStatus = _NOT_ASSESSED,
    portable_sealed: bool = False,
    period_one_1d: bool = False,
) -> OptimizerContract:
    """The contract of a Gefen instance with these options and this identity readiness
    (memoised, immutable).

    ``portable`` is the live status of ``portable_state``; its entry is declared exactly while
    it is supported: :data:`PORTABLE_SUPPORT` over a sealed ``post_sharding`` layout
    (``portable_sealed``), else :data:`IMPLICIT_PORTABLE_SUPPORT`. Likewise
    :func:`parameter_shaped_support` while :func:`parameter_shaped_status` is positive.
    """
    portable_entry = PORTABLE_SUPPORT if portable_sealed else IMPLICIT_PORTABLE_SUPPORT
    shaped = parameter_shaped_status(readiness)
    transports = ((portable_entry,) if portable.supported else ()) + (
        (parameter_shaped_support(period_one_1d),) if shaped.supported else ()
    )
    capabilities = OptimizerCapabilities(
        training=_training(readiness),
        checkpoints=(*_checkpoints(readiness, canonical), *transports),
        precisions=frozenset(Precision),
        supported_parameter_ranks=None,
        features={
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
            **identity_features(readiness, canonical),
            FEATURE_PORTABLE_STATE: portable,
            FEATURE_PARAMETER_SHAPED_STATE: shaped,
            FEATURE_COMPOSITE: FeatureStatus.no("Gefen has no child optimizers"),
        },
    )
    extensions: dict[str, object] = {
        "gefen.codebook_size": CODEBOOK_SIZE,
        "gefen.histogram_bins": HISTOGRAM_BINS,
        "gefen.codebook_scope": "process_group" if readiness.scoped else "rank_local",
        "gefen.scope_collective_budget": STEADY_STEP_BUDGET,
        "gefen.period_rule": "shape_rows",
        "gefen.period_fallback_cap": FALLBACK_PERIOD_CAP,
        "gefen.native_format": F.FORMAT_NAME,
        "gefen.native_format_version": F.VERSION,
        "gefen.ops": sorted(OPS),
        "gefen.fused": "auto" if fused is None else ("required" if fused else "reference"),
        "gefen.deterministic": deterministic,
        "gefen.stochastic_round": stochastic_round,
        "gefen.capturable": capturable,
        "gefen.codebook_refresh_every": codebook_refresh_every,
        "gefen.factored_v_2d": list(factored_v_2d),
        "gefen.row_sharded_factored_v": "local v_row, replicated v_col, one all_reduce per mesh per step",
        "gefen.transport_variants": ["pristine", "block", "factored", "element"],
        "gefen.reblocking": "exact_structure_then_reinfer_v1",
    }
    return OptimizerContract(IMPLEMENTATION, STATE_LAYOUT, capabilities, extensions=extensions)

"""Gefen's contract: what one ``Gefen`` instance supports today, and why not the rest.

Built from the instance's options and its identity readiness (:mod:`gefen_core.identity_claims`;
no tensors read, no collectives) and memoised per option set, so ``optimizer_contract()`` is
cheap, pure and equal for equal optimizers.
"""

from __future__ import annotations

from functools import lru_cache

from gefen_contracts import (
    FEATURE_COMPOSITE,
    FEATURE_DENSE_SHARD_CODEC,
    FEATURE_PORTABLE_STATE,
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

from . import native_format as F
from .codebook_scope import STEADY_STEP_BUDGET
from .identity import IdentityReadiness
from .identity_claims import FRESH, canonical_local_entry, identity_features, training_scope
from .momentum_codec import CODEBOOK_SIZE
from .ops import OPS
from .param_state import (
    BLOCK,
    BLOCK_KEYS,
    FACTORED,
    FACTORED_KEYS,
    FACTORED_STEP,
    INDICES,
    MAGNITUDE,
    PERIOD,
    STEP,
    V_COL,
    V_ROW,
    VMEAN,
    VMEAN_STEP,
)
from .periods import FALLBACK_PERIOD_CAP
from .reference_ops import HISTOGRAM_BINS

__all__ = ["CANONICAL_LAYOUTS", "IMPLEMENTATION", "STATE_LAYOUT", "gefen_contract"]

IMPLEMENTATION = "gefen.Gefen"

_REPL = ParameterLayout.REPLICATED
_FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD
_DTENSOR = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
#: Layouts whose state a canonical local document covers.
CANONICAL_LAYOUTS = frozenset({_REPL, _FLAT})


def _param(name: str, geometry: StateGeometry, description: str) -> StateField:
    return StateField(name, StateScope.PARAMETER, StateRole.AUTHORITATIVE, geometry, description=description)


def _common(name: str, geometry: StateGeometry, description: str, optional: bool = False) -> StateField:
    return StateField(
        name, StateScope.OPTIMIZER_COMMON, StateRole.AUTHORITATIVE, geometry, optional=optional, description=description
    )


STATE_LAYOUT = OptimizerStateLayout(
    fields=(
        _common(F.FORMAT_VERSION, StateGeometry.SCALAR, "native format version (int)"),
        _common(F.GLOBAL_STEP, StateGeometry.SCALAR, "completed step() calls (int)"),
        _common(F.CODEBOOK, StateGeometry.TABLE, "shared fp32[256] momentum codebook, or None before learning"),
        _common(F.DETERMINISTIC, StateGeometry.SCALAR, "the deterministic policy the state was produced under"),
        _common(F.TOPOLOGY, StateGeometry.OPAQUE, "per-slot DTensor topology records, None without DTensors"),
        StateField(
            F.GROUP_MIRROR,
            StateScope.CHECKPOINT_CARRIER,
            StateRole.TRANSPORT,
            StateGeometry.OPAQUE,
            optional=True,
            description="param-group copy of the optimizer-common record (survives torch DCP state-dict helpers)",
        ),
        _param(PERIOD, StateGeometry.SCALAR, "block period P (int)"),
        _param(STEP, StateGeometry.SCALAR, "the parameter's update count"),
        _param(INDICES, StateGeometry.PARAMETER, "uint8 [B, P] codeword indices of the momentum"),
        _param(MAGNITUDE, StateGeometry.BLOCK, "fp32 [B, 1] per-block momentum scale"),
        _param(VMEAN, StateGeometry.BLOCK, "fp32 [B, 1] EMA of the block mean of g^2"),
        _param(VMEAN_STEP, StateGeometry.SCALAR, "age of vmean"),
        _param(V_ROW, StateGeometry.ROW, "fp32 [rows] EMA of row means of g^2 (local rows when row-sharded)"),
        _param(V_COL, StateGeometry.COLUMN, "fp32 [cols] EMA of column means of g^2 (replicated)"),
        _param(FACTORED_STEP, StateGeometry.SCALAR, "age of v_row and v_col"),
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
    ),
)

_NOT_YET = "not implemented in gefen-core yet"


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
        entries.append(
            CheckpointSupport(
                CheckpointTransport.PYTORCH_RANK_LOCAL,
                rank_local,
                ProcessGroupScope.NONE,
                # torch's set_optimizer_state_dict steps a stateless optimizer once with zero
                # gradients before it calls load_state_dict, so a failed load is not a no-op.
                LoadAtomicity.NONE,
            )
        )
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
) -> OptimizerContract:
    """The contract of a Gefen instance with these options and this identity readiness
    (memoised, immutable)."""
    capabilities = OptimizerCapabilities(
        training=_training(readiness),
        checkpoints=_checkpoints(readiness, canonical),
        precisions=frozenset(Precision),
        supported_parameter_ranks=None,
        features={
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
            **identity_features(readiness, canonical),
            FEATURE_PORTABLE_STATE: FeatureStatus.no(f"the portable-state adapter is {_NOT_YET}"),
            FEATURE_DENSE_SHARD_CODEC: FeatureStatus.no(f"the dense-shard codec for DCP resharding is {_NOT_YET}"),
            FEATURE_COMPOSITE: FeatureStatus.no("Gefen has no child optimizers"),
        },
    )
    extensions: dict[str, object] = {
        "gefen.codebook_size": CODEBOOK_SIZE,
        "gefen.histogram_bins": HISTOGRAM_BINS,
        "gefen.codebook_scope": "process_group" if readiness.scoped else "rank_local",
        "gefen.scope_collective_budget": STEADY_STEP_BUDGET,
        "gefen.period_search": "within_block_spread_drop",
        "gefen.period_fallback_cap": FALLBACK_PERIOD_CAP,
        "gefen.native_format": F.FORMAT_NAME,
        "gefen.native_format_version": F.VERSION,
        "gefen.op_ids": sorted(OPS),
        "gefen.fused": "auto" if fused is None else ("required" if fused else "reference"),
        "gefen.deterministic": deterministic,
        "gefen.stochastic_round": stochastic_round,
        "gefen.capturable": capturable,
        "gefen.codebook_refresh_every": codebook_refresh_every,
        "gefen.factored_v_2d": list(factored_v_2d),
        "gefen.row_sharded_factored_v": "local v_row, replicated v_col, one all_reduce per mesh per step",
    }
    return OptimizerContract(IMPLEMENTATION, STATE_LAYOUT, capabilities, extensions=extensions)

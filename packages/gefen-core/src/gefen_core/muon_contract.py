"""GefenMuon's contract: what one instance supports for its live ``sharded_mode`` set, and why
not the rest.

Built from the instance's options only (no tensors, no collectives) and memoised, so
``optimizer_contract()`` is cheap, pure and equal for equal optimizers. Per live mode ``m``:

* training: complete 2-D matrices (``REPLICATED``), and ``Shard(0)`` DTensors on a 1-D mesh
  tagged ``gefen.muon.sharded_mode=m`` (the exact and distributed modes work on the complete
  logical matrix, approx on local rows);
* native checkpoints of complete matrices, and of DTensors: ``"exact"`` and
  ``"distributed"`` state is whole-matrix (every rank, or the owner then consolidated), so
  those checkpoints also load under another world size, one process included
  (``WORLD_SIZE_OWNER_REDISTRIBUTION``); ``"approx"`` state is rank-local and loads only into
  the same topology. Loads are fail-before-mutation on each process;
* state variants: ``quantized_muon`` (+ ``normuon``) for complete matrices, and per DTensor
  mode ``_global`` (exact), ``_local`` (approx) or ``_owner`` (distributed; non-owners hold no
  state), selected by :meth:`GefenMuon.state_mode_tags`.
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
    ParameterStateRole,
    Precision,
    ProcessGroupScope,
    StateExtent,
    TopologyChange,
)

from .codebook_scope import STEADY_STEP_BUDGET
from .identity import IdentityReadiness
from .identity_claims import FRESH, canonical_local_entry, identity_features, training_scope
from .momentum_codec import CODEBOOK_SIZE
from .muon_distributed import APPROX, DISTRIBUTED, EXACT
from .muon_native_state import FORMAT, OWNERSHIP
from .muon_state import MUON_KEYS, NORMUON_KEYS, NORMUON_STEP, NORMUON_V
from .native_records import GROUP_MIRROR
from .newton_schulz import SCHEDULE_NAMES
from .ops import MUON_DISPATCHED_OPS
from .param_state import INDICES, MAGNITUDE, STEP
from .reference_ops import HISTOGRAM_BINS

__all__ = [
    "IMPLEMENTATION",
    "MODE_TAG_PREFIX",
    "MUON_IMPLICIT_PORTABLE_SUPPORT",
    "MUON_PORTABLE_SUPPORT",
    "REPLICATED_STATE_LAYOUT",
    "mode_tag",
    "muon_contract",
]

IMPLEMENTATION = "gefen.GefenMuon"
MODE_TAG_PREFIX = "gefen.muon.sharded_mode="

_REPL = ParameterLayout.REPLICATED
_OWNER = ParameterLayout.WHOLE_PARAMETER_OWNER
_DTENSOR = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD
_EXTENTS = {EXACT: ("global", StateExtent.GLOBAL_PARAMETER), APPROX: ("local", StateExtent.LOCAL_STORAGE)}
_EXTENTS[DISTRIBUTED] = ("owner", StateExtent.OWNER_PARAMETER)


def mode_tag(mode: str) -> str:
    """The state/claim tag of a ``sharded_mode`` (``"gefen.muon.sharded_mode=exact"``)."""
    return MODE_TAG_PREFIX + mode


def _common(name: str, geometry: StateGeometry, description: str) -> StateField:
    return StateField(name, StateScope.OPTIMIZER_COMMON, StateRole.AUTHORITATIVE, geometry, description=description)


def _param(name: str, geometry: StateGeometry, dtype: str, description: str) -> StateField:
    return StateField(
        name, StateScope.PARAMETER, StateRole.AUTHORITATIVE, geometry, dtype=dtype, description=description
    )


_FIELDS = (
    _common("gefen_format_version", StateGeometry.SCALAR, "native format version (int)"),
    _common("gefen_global_step", StateGeometry.SCALAR, "completed step() calls (int)"),
    _common("gefen_codebook", StateGeometry.TABLE, "shared fp32[256] momentum codebook (zeros before learning)"),
    _common("gefen_codebook_learned", StateGeometry.SCALAR, "whether the codebook has been learned (bool)"),
    _common("gefen_deterministic", StateGeometry.SCALAR, "the deterministic policy the state was produced under"),
    _common("gefen_topology", StateGeometry.OPAQUE, "per-slot topology records of approx DTensors, else None"),
    _common("gefen_muon_owners", StateGeometry.OPAQUE, "owner manifest of distributed-mode matrices, else None"),
    _common(
        "gefen_state_digest",
        StateGeometry.SCALAR,
        "SHA-256 digests of the record and every parameter's state ({layout, content})",
    ),
    StateField(
        GROUP_MIRROR,
        StateScope.CHECKPOINT_CARRIER,
        StateRole.TRANSPORT,
        StateGeometry.OPAQUE,
        optional=True,
        description="param-group copy of the optimizer-common record (survives torch DCP state-dict helpers)",
    ),
    _param(STEP, StateGeometry.SCALAR, "int", "the matrix's update count"),
    _param(INDICES, StateGeometry.PARAMETER, "uint8", "[B, P] codeword indices of the momentum"),
    _param(MAGNITUDE, StateGeometry.BLOCK, "float32", "[B, 1] per-block momentum scale"),
    _param(NORMUON_V, StateGeometry.ROW, "float32", "[rows, 1] EMA of squared row norms / cols (NorMuon)"),
    _param(NORMUON_STEP, StateGeometry.SCALAR, "int", "age of normuon_v"),
)


def _variants(modes: tuple[str, ...]) -> tuple[StateVariant, ...]:
    kinds = (("quantized_muon", MUON_KEYS, "momentum"), ("quantized_normuon", (*MUON_KEYS, *NORMUON_KEYS), "NorMuon"))
    variants = []
    for prefix, fields, what in kinds:
        variants.append(
            StateVariant(
                prefix,
                fields,
                frozenset({_REPL}),
                StateExtent.GLOBAL_PARAMETER,
                parameter_ranks=(2,),
                description=f"quantized {what} state of a complete matrix",
            )
        )
        variants.append(
            StateVariant(
                f"{prefix}_whole_owner",
                fields,
                frozenset({_OWNER}),
                StateExtent.OWNER_PARAMETER,
                role=ParameterStateRole.OWNER,
                parameter_ranks=(2,),
                description=f"quantized {what} state of a whole-parameter-owner matrix, on its owner only",
            )
        )
        for mode in modes:
            suffix, extent = _EXTENTS[mode]
            variants.append(
                StateVariant(
                    f"{prefix}_{suffix}",
                    fields,
                    frozenset({_DTENSOR}),
                    extent,
                    parameter_ranks=(2,),
                    mode_tags=frozenset({mode_tag(mode)}),
                    description=f"quantized {what} state of a Shard(0) DTensor under sharded_mode={mode!r}",
                )
            )
    return tuple(variants)


_NOT_ASSESSED = FeatureStatus.no("not assessed for this contract query")
_OWNER = ParameterLayout.WHOLE_PARAMETER_OWNER
_PORTABLE_LAYOUTS = frozenset({_REPL, _OWNER})
_MOVES = frozenset({TopologyChange.PLACEMENT_RESHARD, TopologyChange.WORLD_SIZE_OWNER_REDISTRIBUTION})
#: The ``CANONICAL_GLOBAL`` entry while ``portable_state`` is supported and no sealed
#: ``post_sharding`` layout is bound: the implicit layout (one ``REPLICATED`` shard per named
#: matrix, one member) round trips, and takes the state of bound replicated matrices and
#: whole-parameter owners on any member count (whole matrices keep their blocks).
MUON_IMPLICIT_PORTABLE_SUPPORT = CheckpointSupport(
    CheckpointTransport.CANONICAL_GLOBAL,
    frozenset({_REPL}),
    ProcessGroupScope.ADAPTER_DEFINED,
    LoadAtomicity.GROUP_VOTED,
    transitions=(TopologyTransition(_PORTABLE_LAYOUTS, frozenset({_REPL}), _MOVES),),
    requires_collective=True,
)
#: The ``CANONICAL_GLOBAL`` entry while ``portable_state`` is supported over a sealed
#: ``post_sharding`` layout: replicated matrices and whole-parameter owners round trip, and
#: move between those layouts, member counts and owners (whole matrices keep their blocks, so
#: the move is exact).
MUON_PORTABLE_SUPPORT = CheckpointSupport(
    CheckpointTransport.CANONICAL_GLOBAL,
    _PORTABLE_LAYOUTS,
    ProcessGroupScope.ADAPTER_DEFINED,
    LoadAtomicity.GROUP_VOTED,
    transitions=(TopologyTransition(_PORTABLE_LAYOUTS, _PORTABLE_LAYOUTS, _MOVES),),
    requires_collective=True,
)
_SHAPED_LAYOUTS = frozenset({_REPL, _DTENSOR})


def _shaped_support(tags: frozenset[str]) -> CheckpointSupport:
    """The ``PARAMETER_SHAPED`` entry while ``parameter_shaped_state`` is supported (plain
    matrices and ``"exact"`` DTensors, whose state describes the whole matrix as a plain
    tensor equal on every rank: DCP stores it once and every rank reads it whole, so every
    transition is exact)."""
    return CheckpointSupport(
        CheckpointTransport.PARAMETER_SHAPED,
        _SHAPED_LAYOUTS,
        ProcessGroupScope.DEFAULT_WORLD,
        LoadAtomicity.GROUP_VOTED,
        transitions=(
            TopologyTransition(_SHAPED_LAYOUTS, _SHAPED_LAYOUTS, frozenset({TopologyChange.PLACEMENT_RESHARD})),
        ),
        mesh_dimensions=(1,),
        mode_tags=tags,
        requires_collective=True,
    )


_UNBOUND = FeatureStatus.no("the optimizer is not finalized: call post_sharding with a ShardingManifest")

#: The state layout of matrices bound by post_sharding (complete matrices, no DTensor modes).
REPLICATED_STATE_LAYOUT = OptimizerStateLayout(_FIELDS, _variants(()))


def _bound_training(readiness: IdentityReadiness, whole_owner_blocker: str | None) -> list[TrainingSupport]:
    scope = training_scope(readiness)
    training = []
    if _REPL in readiness.layouts:
        training.append(TrainingSupport(_REPL, scope, requires_complete_logical_matrix=True))
    if _OWNER in readiness.layouts and whole_owner_blocker is None:
        training.append(
            TrainingSupport(
                _OWNER,
                ProcessGroupScope.ADAPTER_DEFINED,
                requires_complete_parameter_storage=True,
                requires_complete_logical_matrix=True,
                requires_post_step_parameter_sync=True,
            )
        )
    return training


@lru_cache(maxsize=64)
def muon_contract(
    *,
    readiness: IdentityReadiness = FRESH,
    canonical: FeatureStatus = _UNBOUND,
    whole_owner_blocker: str | None = None,
    modes: tuple[str, ...],
    normuon: tuple[bool, ...],
    deterministic: bool,
    stochastic_round: bool,
    fused: bool | None,
    portable: FeatureStatus = _NOT_ASSESSED,
    parameter_shaped: FeatureStatus = _NOT_ASSESSED,
    portable_sealed: bool = False,
) -> OptimizerContract:
    """The contract of a GefenMuon with these live ``sharded_mode`` values, options and identity
    readiness (after ``post_sharding``: exactly the bound layouts).

    ``portable`` and ``parameter_shaped`` are the live statuses of ``portable_state`` and
    ``parameter_shaped_state``; their checkpoint entries are declared exactly while supported
    (:data:`MUON_PORTABLE_SUPPORT` over a sealed ``post_sharding`` layout, else
    :data:`MUON_IMPLICIT_PORTABLE_SUPPORT`).
    """
    portable_entry = MUON_PORTABLE_SUPPORT if portable_sealed else MUON_IMPLICIT_PORTABLE_SUPPORT
    tags = frozenset(mode_tag(mode) for mode in modes)
    if readiness.finalized:
        return _bound_contract(
            readiness,
            canonical,
            whole_owner_blocker,
            modes,
            normuon,
            deterministic,
            stochastic_round,
            fused,
            (portable, parameter_shaped),
        )
    training = [TrainingSupport(_REPL, ProcessGroupScope.NONE, requires_complete_logical_matrix=True)]
    for mode in modes:
        training.append(
            TrainingSupport(
                _DTENSOR,
                ProcessGroupScope.INFERRED_DEVICE_MESH,
                mesh_dimensions=(1,),
                mode_tags=frozenset({mode_tag(mode)}),
                requires_complete_logical_matrix=mode != APPROX,
            )
        )
    global_state = set(modes) <= {EXACT, DISTRIBUTED}
    checkpoints = (
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER,
            frozenset({_REPL}),
            ProcessGroupScope.NONE,
            LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            mode_tags=tags,
        ),
        CheckpointSupport.torch_recipe(frozenset({_REPL}), tags),  # on replicated matrices
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER,
            frozenset({_DTENSOR}),
            ProcessGroupScope.INFERRED_DEVICE_MESH,
            LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            transitions=(
                (
                    TopologyTransition(
                        frozenset({_DTENSOR}),
                        frozenset({_DTENSOR, _REPL}),
                        frozenset({TopologyChange.WORLD_SIZE_OWNER_REDISTRIBUTION}),
                    ),
                )
                if global_state
                else ()
            ),
            mesh_dimensions=(1,),
            mode_tags=tags,
            requires_collective=DISTRIBUTED in modes,
        ),
        *((portable_entry,) if portable.supported else ()),
        *((_shaped_support(tags),) if parameter_shaped.supported else ()),
    )
    return _assemble(
        tuple(training),
        checkpoints,
        OptimizerStateLayout(_FIELDS, _variants(modes)),
        readiness,
        canonical,
        modes,
        normuon,
        deterministic,
        stochastic_round,
        fused,
        (portable, parameter_shaped),
    )


def _bound_contract(
    readiness: IdentityReadiness,
    canonical: FeatureStatus,
    whole_owner_blocker: str | None,
    modes: tuple[str, ...],
    normuon: tuple[bool, ...],
    deterministic: bool,
    stochastic_round: bool,
    fused: bool | None,
    transports: tuple[FeatureStatus, FeatureStatus],
) -> OptimizerContract:
    """After ``post_sharding``: complete matrices only (replicated, whole-parameter owner)."""
    native = CheckpointSupport(
        CheckpointTransport.NATIVE_OPTIMIZER,
        readiness.layouts,
        ProcessGroupScope.NONE,
        LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
    )
    # parameter_shaped_state is negative for every bound layout (muon_native_state.parameter_shaped_status).
    portable = (MUON_PORTABLE_SUPPORT,) if transports[0].supported else ()
    checkpoints = (native, *canonical_local_entry(readiness, canonical, frozenset({_REPL})), *portable)
    return _assemble(
        tuple(_bound_training(readiness, whole_owner_blocker)),
        checkpoints,
        REPLICATED_STATE_LAYOUT,
        readiness,
        canonical,
        modes,
        normuon,
        deterministic,
        stochastic_round,
        fused,
        transports,
    )


def _assemble(
    training: tuple[TrainingSupport, ...],
    checkpoints: tuple[CheckpointSupport, ...],
    layout: OptimizerStateLayout,
    readiness: IdentityReadiness,
    canonical: FeatureStatus,
    modes: tuple[str, ...],
    normuon: tuple[bool, ...],
    deterministic: bool,
    stochastic_round: bool,
    fused: bool | None,
    transports: tuple[FeatureStatus, FeatureStatus],
) -> OptimizerContract:
    portable, parameter_shaped = transports
    capabilities = OptimizerCapabilities(
        training=training,
        checkpoints=checkpoints,
        precisions=frozenset(Precision),
        supported_parameter_ranks=(2,),
        features={
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
            **identity_features(readiness, canonical),
            FEATURE_PORTABLE_STATE: portable,
            FEATURE_PARAMETER_SHAPED_STATE: parameter_shaped,
            FEATURE_COMPOSITE: FeatureStatus.no("GefenMuon has no child optimizers"),
        },
    )
    extensions: dict[str, object] = {
        "gefen.codebook_size": CODEBOOK_SIZE,
        "gefen.histogram_bins": HISTOGRAM_BINS,
        "gefen.native_format": FORMAT.name,
        "gefen.native_format_version": FORMAT.version,
        "gefen.ops": sorted(MUON_DISPATCHED_OPS),
        "gefen.fused": "auto" if fused is None else ("required" if fused else "reference"),
        "gefen.deterministic": deterministic,
        "gefen.stochastic_round": stochastic_round,
        "gefen.muon.sharded_modes": list(modes),
        "gefen.muon.normuon": list(normuon),
        "gefen.muon.ownership": OWNERSHIP,
        "gefen.muon.ns_schedules": list(SCHEDULE_NAMES),
        "gefen.codebook_scope": "process_group" if readiness.scoped else "mesh_or_rank_local",
        "gefen.scope_collective_budget": STEADY_STEP_BUDGET,
        "gefen.transport_variants": ["pristine", "muon", "normuon"],
        "gefen.reblocking": "exact_structure_then_reinfer_v1",
    }
    return OptimizerContract(IMPLEMENTATION, layout, capabilities, extensions=extensions)

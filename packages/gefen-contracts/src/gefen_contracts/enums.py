"""Closed enumerations of the convention.

Every enum is a ``(str, Enum)`` whose value is the lowercase member name; validators
require the member itself (``type(x) is Enum``), never its raw string value. Codecs
write the value string.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "CheckpointTransport",
    "LoadAtomicity",
    "ParameterLayout",
    "ParameterStateRole",
    "PlacementKind",
    "Precision",
    "ProcessGroupScope",
    "StateExtent",
    "StateGeometry",
    "StateKeyMatch",
    "StateRole",
    "StateScope",
    "TopologyChange",
]


class StateScope(StrEnum):
    """Where a declared state key lives.

    ``PARAMETER``: a key of a per-parameter state dict. ``OPTIMIZER_COMMON``: a top-level
    key of the native state dict holding one value per optimizer. ``CHECKPOINT_CARRIER``:
    a key (per-parameter or top-level) that only carries transport data in checkpoints.
    """

    OPTIMIZER_COMMON = "optimizer_common"
    PARAMETER = "parameter"
    CHECKPOINT_CARRIER = "checkpoint_carrier"


class StateRole(StrEnum):
    """What a declared state key means (replaces the reference's overloaded ``DERIVED``).

    ``AUTHORITATIVE``: algorithm state that must survive a checkpoint. ``CACHE``: rebuildable
    from authoritative state, never checkpointed. ``TRANSPORT``: written into checkpoints to
    carry metadata, never read by the algorithm. ``LEGACY``: accepted on load, ignored.
    """

    AUTHORITATIVE = "authoritative"
    CACHE = "cache"
    TRANSPORT = "transport"
    LEGACY = "legacy"


class StateGeometry(StrEnum):
    """Logical shape family of a state field, independent of local vs global extent.

    ``TABLE`` is a fixed-size table independent of parameter shapes (e.g. a codebook).
    """

    SCALAR = "scalar"
    TABLE = "table"
    PARAMETER = "parameter"
    BLOCK = "block"
    ROW = "row"
    COLUMN = "column"
    OPAQUE = "opaque"


class StateKeyMatch(StrEnum):
    """Whether a declared field name must equal a key or be a prefix of it."""

    EXACT = "exact"
    PREFIX = "prefix"


class StateExtent(StrEnum):
    """How much of the logical parameter a variant's tensors describe."""

    METADATA_ONLY = "metadata_only"
    LOCAL_STORAGE = "local_storage"
    GLOBAL_PARAMETER = "global_parameter"
    OWNER_PARAMETER = "owner_parameter"


class ParameterStateRole(StrEnum):
    """On which ownership role a state variant may appear."""

    ANY = "any"
    OWNER = "owner"
    NON_OWNER = "non_owner"


class ParameterLayout(StrEnum):
    """Concrete placement of a parameter's local tensor.

    ``REPLICATED``: the complete parameter. ``FLATTENED_ELEMENT_SHARD``: a contiguous run of
    the row-major flattened parameter. ``WHOLE_PARAMETER_OWNER``: the complete parameter on
    one owner member, nothing elsewhere. ``DTENSOR_1D_DEFAULT_WORLD``: a DTensor local shard
    on a 1-D mesh spanning the default world.
    """

    REPLICATED = "replicated"
    FLATTENED_ELEMENT_SHARD = "flattened_element_shard"
    WHOLE_PARAMETER_OWNER = "whole_parameter_owner"
    DTENSOR_1D_DEFAULT_WORLD = "dtensor_1d_default_world"


class PlacementKind(StrEnum):
    """Framework-neutral placement along one mesh axis."""

    REPLICATE = "replicate"
    FLAT_SHARD = "flat_shard"
    DIMENSION_SHARD = "dimension_shard"
    WHOLE_PARAMETER_OWNER = "whole_parameter_owner"


class ProcessGroupScope(StrEnum):
    """Where a code path gets its collective process group."""

    NONE = "none"
    DEFAULT_WORLD = "default_world"
    INFERRED_DEVICE_MESH = "inferred_device_mesh"
    ADAPTER_DEFINED = "adapter_defined"


class CheckpointTransport(StrEnum):
    """Checkpoint mechanisms whose topology support is declared separately.

    ``NATIVE_OPTIMIZER``: ``state_dict()``/``load_state_dict()``. ``PYTORCH_RANK_LOCAL``: torch's
    rank-local (DCP ``get/set_optimizer_state_dict``) path. ``COMPOSITE_NATIVE``: a composite's
    nested native state dict. ``CANONICAL_LOCAL``: the FQN-keyed local document.
    ``CANONICAL_GLOBAL``: the topology-neutral portable document. ``PARAMETER_SHAPED``: the
    native state dict whose tensors follow their parameters' placements, resharded by DCP
    (plain ``dcp.save``, torch's ``get/set_optimizer_state_dict``, ``gefen_dcp.GefenDCPState``).
    """

    NATIVE_OPTIMIZER = "native_optimizer"
    PYTORCH_RANK_LOCAL = "pytorch_rank_local"
    COMPOSITE_NATIVE = "composite_native"
    CANONICAL_LOCAL = "canonical_local"
    CANONICAL_GLOBAL = "canonical_global"
    PARAMETER_SHAPED = "parameter_shaped"


class TopologyChange(StrEnum):
    """Kinds of topology change a checkpoint transition tolerates.

    ``WORLD_SIZE_OWNER_REDISTRIBUTION``: the member count changes but every parameter stays
    whole on one owner (``WHOLE_PARAMETER_OWNER`` to ``WHOLE_PARAMETER_OWNER``); only which
    member owns which parameter moves. ``PLACEMENT_RESHARD``: the cut of a parameter's
    elements changes (replicated to flattened, flattened on N members to flattened on M,
    one DTensor placement to another), so state moves between members piece by piece. A
    transition is declared per ``(source layout, target layout, kind)``: flattened 2 -> 3
    members is the ``FLATTENED_ELEMENT_SHARD -> FLATTENED_ELEMENT_SHARD`` transition of kind
    ``PLACEMENT_RESHARD`` and must be declared as such (the same-topology claim covers only
    a reload on the same cut).
    """

    WORLD_SIZE_OWNER_REDISTRIBUTION = "world_size_owner_redistribution"
    PLACEMENT_RESHARD = "placement_reshard"


class LoadAtomicity(StrEnum):
    """What a checkpoint load promises when it fails.

    ``NONE``: a failed load may leave the optimizer partially changed.
    ``LOCAL_FAIL_BEFORE_MUTATION``: on this process, a failed load raises before anything
    observable (state, groups, tensors, counters, caches) changes; user hooks excluded.
    ``GROUP_VOTED``: additionally, every member of the process group votes before commit,
    so either every member publishes or none does (short of process death).
    """

    NONE = "none"
    LOCAL_FAIL_BEFORE_MUTATION = "local_fail_before_mutation"
    GROUP_VOTED = "group_voted"


class Precision(StrEnum):
    """Parameter/gradient storage dtypes an optimizer accepts."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT64 = "float64"

"""Capability descriptors: what an optimizer supports, and why not when it does not."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .enums import CheckpointTransport, LoadAtomicity, ParameterLayout, Precision, ProcessGroupScope, TopologyChange
from .errors import ContractError, ContractTypeError
from .frozen import FrozenMap
from .validation import (
    exact_bool,
    exact_enum,
    exact_float,
    frozen_enum_set,
    frozen_str_set,
    identity_name,
    int_tuple,
    str_tuple,
)

__all__ = [
    "FEATURE_CANONICAL_IDENTITY",
    "FEATURE_CANONICAL_LOCAL_STATE",
    "FEATURE_COLLECTIVE_SCOPE",
    "FEATURE_COMPOSITE",
    "FEATURE_PARAMETER_SHAPED_STATE",
    "FEATURE_PORTABLE_STATE",
    "FEATURE_POST_SHARDING",
    "FEATURE_STAGED_NATIVE_LOAD",
    "STANDARD_FEATURES",
    "CheckpointSupport",
    "FeatureStatus",
    "OptimizerCapabilities",
    "TopologyTransition",
    "TrainingSupport",
]

FEATURE_STAGED_NATIVE_LOAD = "staged_native_load"
FEATURE_POST_SHARDING = "post_sharding"
FEATURE_CANONICAL_IDENTITY = "canonical_identity"
FEATURE_CANONICAL_LOCAL_STATE = "canonical_local_state"
FEATURE_PORTABLE_STATE = "portable_state"
FEATURE_PARAMETER_SHAPED_STATE = "parameter_shaped_state"
FEATURE_COLLECTIVE_SCOPE = "collective_scope"
FEATURE_COMPOSITE = "composite"

#: The features of the convention, one per Protocol (plus ``canonical_identity``).
STANDARD_FEATURES: tuple[str, ...] = (
    FEATURE_STAGED_NATIVE_LOAD,
    FEATURE_POST_SHARDING,
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
)

#: Features whose support must agree with the presence of a checkpoint entry.
_TRANSPORT_FEATURES = {
    FEATURE_CANONICAL_LOCAL_STATE: CheckpointTransport.CANONICAL_LOCAL,
    FEATURE_PORTABLE_STATE: CheckpointTransport.CANONICAL_GLOBAL,
    FEATURE_PARAMETER_SHAPED_STATE: CheckpointTransport.PARAMETER_SHAPED,
}


def _mesh(value: object, field_name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    return int_tuple(value, field_name, minimum=1, unique=True)


@dataclass(frozen=True, slots=True)
class TrainingSupport:
    """A parameter layout the optimizer can train, and what it needs from the adapter."""

    layout: ParameterLayout
    process_group_scope: ProcessGroupScope
    mesh_dimensions: tuple[int, ...] | None = None
    mode_tags: frozenset[str] = field(default_factory=frozenset)
    requires_complete_parameter_storage: bool = False
    requires_complete_logical_matrix: bool = False
    requires_post_step_parameter_sync: bool = False

    def __post_init__(self) -> None:
        exact_enum(self.layout, ParameterLayout, "TrainingSupport.layout")
        exact_enum(self.process_group_scope, ProcessGroupScope, "TrainingSupport.process_group_scope")
        object.__setattr__(self, "mesh_dimensions", _mesh(self.mesh_dimensions, "TrainingSupport.mesh_dimensions"))
        object.__setattr__(self, "mode_tags", frozen_str_set(self.mode_tags, "TrainingSupport.mode_tags"))
        exact_bool(self.requires_complete_parameter_storage, "TrainingSupport.requires_complete_parameter_storage")
        exact_bool(self.requires_complete_logical_matrix, "TrainingSupport.requires_complete_logical_matrix")
        exact_bool(self.requires_post_step_parameter_sync, "TrainingSupport.requires_post_step_parameter_sync")


@dataclass(frozen=True, slots=True)
class TopologyTransition:
    """A checkpoint saved under any of ``source_layouts`` on N members can be loaded under
    any of ``target_layouts`` on M members, for the listed ``kinds`` of change.

    ``update_rtol`` states how exactly the state follows the transition. ``0.0`` (the
    default): bit for bit, so a transition and its reverse return the very same state. A
    positive value: the state is re-quantised or re-blocked; after the transition and its
    reverse, the next update (same parameters, same gradient, the source layout) differs
    from the uninterrupted run's by at most the two transitions' ``update_rtol`` added, as a
    relative L2 distance. The conformance kit holds either promise.
    """

    source_layouts: frozenset[ParameterLayout]
    target_layouts: frozenset[ParameterLayout]
    kinds: frozenset[TopologyChange]
    update_rtol: float = 0.0

    def __post_init__(self) -> None:
        for name in ("source_layouts", "target_layouts"):
            value = frozen_enum_set(getattr(self, name), ParameterLayout, f"TopologyTransition.{name}")
            if not value:
                raise ContractError(f"TopologyTransition.{name} must not be empty")
            object.__setattr__(self, name, value)
        kinds = frozen_enum_set(self.kinds, TopologyChange, "TopologyTransition.kinds")
        if not kinds:
            raise ContractError("TopologyTransition.kinds must not be empty")
        object.__setattr__(self, "kinds", kinds)
        rtol = exact_float(self.update_rtol, "TopologyTransition.update_rtol")
        if not 0.0 <= rtol < 1.0:
            raise ContractError(f"TopologyTransition.update_rtol must be in [0, 1), got {rtol!r}")
        object.__setattr__(self, "update_rtol", rtol + 0.0)  # -0.0 is 0.0: one record, one digest

    def allows(self, source: ParameterLayout, target: ParameterLayout, kind: TopologyChange | None = None) -> bool:
        return source in self.source_layouts and target in self.target_layouts and (kind is None or kind in self.kinds)


@dataclass(frozen=True, slots=True)
class CheckpointSupport:
    """A checkpoint transport, the layouts it round-trips unchanged, and the explicit
    source -> target transitions it supports across topology changes.

    ``atomicity`` documents what a failed load leaves behind (see :class:`LoadAtomicity`).
    Consumers key entries by ``(transport, layout)``; a layout appears in ``same_topology`` of
    at most one entry per transport.
    """

    transport: CheckpointTransport
    same_topology: frozenset[ParameterLayout]
    process_group_scope: ProcessGroupScope
    atomicity: LoadAtomicity
    transitions: tuple[TopologyTransition, ...] = ()
    mesh_dimensions: tuple[int, ...] | None = None
    mode_tags: frozenset[str] = field(default_factory=frozenset)
    requires_collective: bool = False

    def __post_init__(self) -> None:
        exact_enum(self.transport, CheckpointTransport, "CheckpointSupport.transport")
        same = frozen_enum_set(self.same_topology, ParameterLayout, "CheckpointSupport.same_topology")
        object.__setattr__(self, "same_topology", same)
        exact_enum(self.process_group_scope, ProcessGroupScope, "CheckpointSupport.process_group_scope")
        exact_enum(self.atomicity, LoadAtomicity, "CheckpointSupport.atomicity")
        transitions = _typed(self.transitions, TopologyTransition, "CheckpointSupport.transitions")
        object.__setattr__(self, "transitions", transitions)
        if not same and not transitions:
            raise ContractError("CheckpointSupport must list same_topology layouts or transitions")
        object.__setattr__(self, "mesh_dimensions", _mesh(self.mesh_dimensions, "CheckpointSupport.mesh_dimensions"))
        object.__setattr__(self, "mode_tags", frozen_str_set(self.mode_tags, "CheckpointSupport.mode_tags"))
        exact_bool(self.requires_collective, "CheckpointSupport.requires_collective")

    @classmethod
    def torch_recipe(
        cls, layouts: frozenset[ParameterLayout], mode_tags: frozenset[str] = frozenset()
    ) -> CheckpointSupport:
        """The claim of torch's ``get/set_optimizer_state_dict`` recipe (``PYTORCH_RANK_LOCAL``)
        on ``layouts``: no collective of the optimizer's own, and never atomic, since
        ``set_optimizer_state_dict`` steps a stateless optimizer once with zero gradients before
        it calls ``load_state_dict``. The kit's ``checkpoint.torch_recipe`` runs it."""
        return cls(
            CheckpointTransport.PYTORCH_RANK_LOCAL,
            layouts,
            ProcessGroupScope.NONE,
            LoadAtomicity.NONE,
            mode_tags=mode_tags,
        )

    @property
    def atomic_load(self) -> bool:
        """True when a failed load changes nothing locally (reference field name)."""
        return self.atomicity is not LoadAtomicity.NONE

    def allows_transition(
        self, source: ParameterLayout, target: ParameterLayout, kind: TopologyChange | None = None
    ) -> bool:
        return any(t.allows(source, target, kind) for t in self.transitions)


@dataclass(frozen=True, slots=True)
class FeatureStatus:
    """Whether a feature is supported now; an unsupported feature always says why."""

    supported: bool
    reasons: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        exact_bool(self.supported, "FeatureStatus.supported")
        reasons = str_tuple(self.reasons, "FeatureStatus.reasons")
        if any(not r.strip() for r in reasons):
            raise ContractError("FeatureStatus.reasons must not contain blank reasons")
        if self.supported and reasons:
            raise ContractError("a supported FeatureStatus must not carry reasons")
        if not self.supported and not reasons:
            raise ContractError("an unsupported FeatureStatus must say why (reasons)")
        object.__setattr__(self, "reasons", reasons)

    @classmethod
    def yes(cls) -> FeatureStatus:
        return cls(True)

    @classmethod
    def no(cls, *reasons: str) -> FeatureStatus:
        return cls(False, tuple(reasons))


def _typed(value: object, item_type: type, field_name: str) -> tuple:  # type: ignore[type-arg]
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ContractTypeError(f"{field_name} must be a sequence of {item_type.__name__}")
    items = tuple(value)
    for index, item in enumerate(items):
        if type(item) is not item_type:
            raise ContractTypeError(f"{field_name}[{index}] must be a {item_type.__name__}, got {type(item).__name__}")
    return items


@dataclass(frozen=True, slots=True)
class OptimizerCapabilities:
    """Everything an optimizer instance supports right now.

    ``features`` maps names from :data:`STANDARD_FEATURES` (and namespaced extra names such
    as ``"vendor.thing"``) to a :class:`FeatureStatus`. An omitted feature is unsupported,
    but an optimizer that implements a feature's Protocol must state its status explicitly
    (the conformance kit enforces this). Support for
    ``canonical_local_state``, ``portable_state`` and ``parameter_shaped_state`` must agree with
    the presence of a ``CANONICAL_LOCAL``, ``CANONICAL_GLOBAL`` or ``PARAMETER_SHAPED``
    checkpoint entry; ``staged_native_load`` requires an atomic native entry.
    """

    training: tuple[TrainingSupport, ...]
    checkpoints: tuple[CheckpointSupport, ...]
    precisions: frozenset[Precision]
    supported_parameter_ranks: tuple[int, ...] | None
    features: Mapping[str, FeatureStatus]

    def __post_init__(self) -> None:
        object.__setattr__(self, "training", _typed(self.training, TrainingSupport, "OptimizerCapabilities.training"))
        checkpoints = _typed(self.checkpoints, CheckpointSupport, "OptimizerCapabilities.checkpoints")
        object.__setattr__(self, "checkpoints", checkpoints)
        precisions = frozen_enum_set(self.precisions, Precision, "OptimizerCapabilities.precisions")
        if not precisions:
            raise ContractError("OptimizerCapabilities.precisions must not be empty")
        object.__setattr__(self, "precisions", precisions)
        if self.supported_parameter_ranks is not None:
            object.__setattr__(
                self,
                "supported_parameter_ranks",
                int_tuple(
                    self.supported_parameter_ranks, "OptimizerCapabilities.supported_parameter_ranks", unique=True
                ),
            )
        if not isinstance(self.features, Mapping):
            raise ContractTypeError("OptimizerCapabilities.features must be a mapping of name -> FeatureStatus")
        features: dict[str, FeatureStatus] = {}
        for name, status in self.features.items():
            identity_name(name, "OptimizerCapabilities.features key")
            if name not in STANDARD_FEATURES and "." not in name:
                raise ContractError(
                    f"feature {name!r} is not standard; extra features must be namespaced like 'vendor.{name}'"
                )
            if type(status) is not FeatureStatus:
                raise ContractTypeError(f"OptimizerCapabilities.features[{name!r}] must be a FeatureStatus")
            features[name] = status
        object.__setattr__(self, "features", FrozenMap(features))
        self._check_consistency()

    def _check_consistency(self) -> None:
        seen: set[tuple[CheckpointTransport, ParameterLayout]] = set()
        for entry in self.checkpoints:
            for layout in entry.same_topology:
                key = (entry.transport, layout)
                if key in seen:
                    raise ContractError(
                        f"checkpoint transport {entry.transport.value} lists layout {layout.value} twice"
                    )
                seen.add(key)
        transports = {entry.transport for entry in self.checkpoints}
        for feature, transport in _TRANSPORT_FEATURES.items():
            if self.supports(feature) != (transport in transports):
                raise ContractError(
                    f"feature {feature!r} support must agree with the presence of a {transport.value} checkpoint entry"
                )
        if self.supports(FEATURE_STAGED_NATIVE_LOAD):
            natives = [
                e
                for e in self.checkpoints
                if e.transport in (CheckpointTransport.NATIVE_OPTIMIZER, CheckpointTransport.COMPOSITE_NATIVE)
            ]
            if not natives or not all(e.atomic_load for e in natives):
                raise ContractError("staged_native_load support requires every native checkpoint entry to be atomic")
        if self.supports(FEATURE_CANONICAL_IDENTITY) and not self.supports(FEATURE_POST_SHARDING):
            raise ContractError("canonical_identity support requires post_sharding support")

    def feature(self, name: str) -> FeatureStatus:
        """The status of ``name``; an undeclared feature is unsupported ("not declared")."""
        status = self.features.get(name)
        return status if status is not None else FeatureStatus.no("not declared by the optimizer")

    def supports(self, name: str) -> bool:
        status = self.features.get(name)
        return status is not None and status.supported

    def checkpoint_support(self, transport: CheckpointTransport, layout: ParameterLayout) -> CheckpointSupport | None:
        """The entry for ``(transport, layout)`` in same-topology use, if any."""
        for entry in self.checkpoints:
            if entry.transport is transport and layout in entry.same_topology:
                return entry
        return None

    def supports_training(self, layout: ParameterLayout, *, mode_tags: Iterable[str] = ()) -> bool:
        tags = frozenset(mode_tags)
        return any(t.layout is layout and t.mode_tags <= tags for t in self.training)

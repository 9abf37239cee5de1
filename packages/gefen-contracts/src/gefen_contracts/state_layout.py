"""State-layout descriptors: which keys an optimizer's state may hold, and which
combinations of per-parameter keys (variants) are legal.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from .enums import ParameterLayout, ParameterStateRole, StateExtent, StateGeometry, StateKeyMatch, StateRole, StateScope
from .errors import ContractError, ContractTypeError, StateValidationError
from .validation import (
    exact_bool,
    exact_enum,
    exact_str,
    frozen_enum_set,
    frozen_str_set,
    identity_name,
    int_tuple,
    str_tuple,
)

__all__ = [
    "STATE_DTYPES",
    "OptimizerStateLayout",
    "StateField",
    "StateVariant",
    "follows_parameter_placement",
    "match_variants",
    "parameter_state_shape",
]

#: The dtype names a :class:`StateField` may declare (``""``: not declared; ``"int"``: a
#: counter, a Python int or an integer tensor in checkpoints).
STATE_DTYPES = frozenset({"", "uint8", "int8", "bfloat16", "float16", "float32", "float64", "int", "bool"})


@dataclass(frozen=True, slots=True)
class StateField:
    """One declared state key.

    ``scope`` says where the key lives, ``role`` what it means (authoritative state, a
    rebuildable cache, a checkpoint transport carrier, or an inert legacy key), ``geometry``
    how a per-parameter tensor's shape follows its parameter's (:func:`parameter_state_shape`)
    and ``dtype`` what it holds (one of :data:`STATE_DTYPES`). Only keys of native state dicts
    are declared; Python attributes of the optimizer object never are.
    """

    name: str
    scope: StateScope
    role: StateRole
    geometry: StateGeometry
    key_match: StateKeyMatch = StateKeyMatch.EXACT
    optional: bool = False
    mode_tags: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    dtype: str = ""

    def __post_init__(self) -> None:
        identity_name(self.name, "StateField.name")
        if self.dtype not in STATE_DTYPES:
            raise ContractError(
                f"StateField {self.name!r} dtype must be one of {sorted(STATE_DTYPES)}, got {self.dtype!r}"
            )
        exact_enum(self.scope, StateScope, "StateField.scope")
        exact_enum(self.role, StateRole, "StateField.role")
        exact_enum(self.geometry, StateGeometry, "StateField.geometry")
        exact_enum(self.key_match, StateKeyMatch, "StateField.key_match")
        exact_bool(self.optional, "StateField.optional")
        object.__setattr__(self, "mode_tags", frozen_str_set(self.mode_tags, "StateField.mode_tags"))
        exact_str(self.description, "StateField.description")

    @property
    def authoritative(self) -> bool:
        return self.role is StateRole.AUTHORITATIVE

    @property
    def checkpointed(self) -> bool:
        """Caches are never checkpointed; every other role is."""
        return self.role is not StateRole.CACHE

    def matches(self, key: object) -> bool:
        if type(key) is not str:
            return False
        if self.key_match is StateKeyMatch.EXACT:
            return key == self.name
        return key.startswith(self.name)


@dataclass(frozen=True, slots=True)
class StateVariant:
    """One legal combination of authoritative per-parameter state keys.

    A live per-parameter state matches when its authoritative keys are exactly ``fields``,
    the parameter's layout is in ``layouts``, its rank passes ``parameter_ranks`` /
    ``excluded_parameter_ranks``, its ownership role fits ``role`` and the live mode tags
    include ``mode_tags``. ``mode_tags`` replace the reference's ``sharded_mode`` string.
    """

    name: str
    fields: tuple[str, ...]
    layouts: frozenset[ParameterLayout]
    extent: StateExtent
    role: ParameterStateRole = ParameterStateRole.ANY
    initialized: bool = True
    parameter_ranks: tuple[int, ...] | None = None
    excluded_parameter_ranks: tuple[int, ...] = ()
    mode_tags: frozenset[str] = field(default_factory=frozenset)
    inactive_fields: tuple[str, ...] = ()
    migration_only: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        identity_name(self.name, "StateVariant.name")
        fields = str_tuple(self.fields, "StateVariant.fields", unique=True, names=True)
        object.__setattr__(self, "fields", fields)
        layouts = frozen_enum_set(self.layouts, ParameterLayout, "StateVariant.layouts")
        if not layouts:
            raise ContractError(f"StateVariant {self.name!r} must name at least one layout")
        object.__setattr__(self, "layouts", layouts)
        exact_enum(self.extent, StateExtent, "StateVariant.extent")
        exact_enum(self.role, ParameterStateRole, "StateVariant.role")
        exact_bool(self.initialized, "StateVariant.initialized")
        if self.parameter_ranks is not None:
            object.__setattr__(
                self, "parameter_ranks", int_tuple(self.parameter_ranks, "StateVariant.parameter_ranks", unique=True)
            )
        excluded = int_tuple(self.excluded_parameter_ranks, "StateVariant.excluded_parameter_ranks", unique=True)
        object.__setattr__(self, "excluded_parameter_ranks", excluded)
        if self.parameter_ranks is not None and set(self.parameter_ranks) & set(excluded):
            raise ContractError(f"StateVariant {self.name!r} both requires and excludes a parameter rank")
        object.__setattr__(self, "mode_tags", frozen_str_set(self.mode_tags, "StateVariant.mode_tags"))
        inactive = str_tuple(self.inactive_fields, "StateVariant.inactive_fields", unique=True, names=True)
        if not set(inactive) <= set(fields):
            raise ContractError(f"StateVariant {self.name!r} inactive_fields must be a subset of fields")
        object.__setattr__(self, "inactive_fields", inactive)
        exact_bool(self.migration_only, "StateVariant.migration_only")
        exact_str(self.description, "StateVariant.description")

    def accepts(
        self,
        *,
        layout: ParameterLayout,
        parameter_rank: int,
        role: ParameterStateRole,
        mode_tags: Collection[str],
    ) -> bool:
        """Whether this variant applies to a parameter with these properties (keys aside)."""
        if layout not in self.layouts:
            return False
        if self.parameter_ranks is not None and parameter_rank not in self.parameter_ranks:
            return False
        if parameter_rank in self.excluded_parameter_ranks:
            return False
        if self.role is not ParameterStateRole.ANY and self.role is not role:
            return False
        return self.mode_tags <= frozenset(mode_tags)


@dataclass(frozen=True, slots=True)
class OptimizerStateLayout:
    """Every state key an optimizer may produce, and its legal per-parameter variants.

    ``composite_namespaces`` lists a composite's child roles, in order (empty otherwise).
    Every name in a variant's ``fields`` must be a declared ``PARAMETER``-scope,
    ``AUTHORITATIVE`` field.
    """

    fields: tuple[StateField, ...]
    parameter_variants: tuple[StateVariant, ...]
    composite_namespaces: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        fields = _typed_tuple(self.fields, StateField, "OptimizerStateLayout.fields")
        variants = _typed_tuple(self.parameter_variants, StateVariant, "OptimizerStateLayout.parameter_variants")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ContractError("OptimizerStateLayout.fields must have unique names")
        variant_names = [v.name for v in variants]
        if len(set(variant_names)) != len(variant_names):
            raise ContractError("OptimizerStateLayout.parameter_variants must have unique names")
        by_name = {f.name: f for f in fields}
        for variant in variants:
            for name in variant.fields:
                declared = by_name.get(name)
                if declared is None or declared.scope is not StateScope.PARAMETER or not declared.authoritative:
                    raise ContractError(
                        f"StateVariant {variant.name!r} field {name!r} must be a declared authoritative "
                        f"per-parameter field"
                    )
        namespaces = str_tuple(
            self.composite_namespaces, "OptimizerStateLayout.composite_namespaces", unique=True, names=True
        )
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "parameter_variants", variants)
        object.__setattr__(self, "composite_namespaces", namespaces)

    def fields_for_scope(self, scope: StateScope) -> tuple[StateField, ...]:
        return tuple(f for f in self.fields if f.scope is scope)

    def field(self, key: str) -> StateField:
        """The first declared field matching ``key`` (``KeyError`` when undeclared)."""
        for candidate in self.fields:
            if candidate.matches(key):
                return candidate
        raise KeyError(key)

    def variant(self, name: str) -> StateVariant:
        for candidate in self.parameter_variants:
            if candidate.name == name:
                return candidate
        raise KeyError(name)


def _typed_tuple(value: object, item_type: type, field_name: str) -> tuple:  # type: ignore[type-arg]
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ContractTypeError(f"{field_name} must be a sequence of {item_type.__name__}")
    items = tuple(value)
    for index, item in enumerate(items):
        if type(item) is not item_type:
            raise ContractTypeError(f"{field_name}[{index}] must be a {item_type.__name__}, got {type(item).__name__}")
    return items


def match_variants(
    layout: OptimizerStateLayout,
    state_keys: Iterable[str],
    *,
    parameter_layout: ParameterLayout,
    parameter_rank: int,
    role: ParameterStateRole = ParameterStateRole.ANY,
    mode_tags: Collection[str] = frozenset(),
) -> tuple[StateVariant, ...]:
    """Return every declared variant that a live per-parameter state matches.

    Every key must resolve to a declared per-parameter or checkpoint-carrier field,
    otherwise ``StateValidationError`` names the undeclared key. Only authoritative
    per-parameter keys take part in matching; caches, carriers and legacy keys may be
    present or absent. A conforming declaration yields exactly one match for every
    reachable state.
    """
    present: set[str] = set()
    for key in state_keys:
        try:
            declared = layout.field(key)
        except KeyError:
            raise StateValidationError(f"per-parameter state key {key!r} is not declared in the state layout") from None
        if declared.scope is StateScope.OPTIMIZER_COMMON:
            raise StateValidationError(f"key {key!r} is declared optimizer-common but found in per-parameter state")
        # caches and carriers may come and go; only authoritative keys say which variant this is
        if declared.scope is StateScope.PARAMETER and declared.authoritative:
            present.add(declared.name)
    return tuple(
        v
        for v in layout.parameter_variants
        if set(v.fields) == present
        and v.accepts(layout=parameter_layout, parameter_rank=parameter_rank, role=role, mode_tags=mode_tags)
    )


def parameter_state_shape(geometry: StateGeometry, shape: Sequence[int], period: int = 1) -> tuple[int, ...] | None:
    """The shape of a per-parameter state tensor of ``geometry`` for a parameter (global or local)
    of ``shape``, with blocks of ``period`` elements; ``None`` for geometries that are not a
    tensor shaped by its parameter (scalars, tables, opaque values).

    * ``PARAMETER``: the parameter's shape;
    * ``ROW``: ``[shape[0]]``, one value per row along the first dimension (any rank but 0: it
      shards with the rows under FSDP2's ``Shard(0)``);
    * ``COLUMN``: ``[columns]`` (two-dimensional parameters only);
    * ``BLOCK``: one value per block of ``period`` elements along the last dimensions:
      ``[rows, row_length / period]`` when the blocks tile every row (so they shard with the rows),
      ``[ceil(numel / period)]`` otherwise (one-dimensional parameters, and blocks that cross
      rows; the last block is shorter when ``period`` does not divide ``numel``, as in a
      portable block field).
    """
    dims = tuple(int(d) for d in shape)
    if geometry is StateGeometry.PARAMETER:
        return dims
    if geometry is StateGeometry.ROW:
        if not dims:
            raise ContractError("a ROW state needs a parameter of at least one dimension, got a scalar")
        return (dims[0],)
    if geometry is StateGeometry.COLUMN:
        if len(dims) != 2:
            raise ContractError(f"a COLUMN state needs a two-dimensional parameter, got shape {dims}")
        return (dims[1],)
    if geometry is StateGeometry.BLOCK:
        if period < 1:
            raise ContractError(f"a BLOCK state needs a period >= 1, got {period}")
        numel = math.prod(dims)
        if len(dims) >= 2:
            row = math.prod(dims[1:])
            # blocks inside rows: a row shard (FSDP2 Shard(0)) then holds whole blocks and their values
            if row % period == 0:
                return (dims[0], row // period)
        # ceil without floats; the last block of a ragged cut is shorter
        return (-(-numel // period),)
    return None


def follows_parameter_placement(geometry: StateGeometry) -> bool:
    """Whether a state tensor of ``geometry`` is sharded like its parameter (row-sharded with it).
    ``COLUMN`` statistics span every row, so a row-sharded parameter keeps them replicated."""
    # BLOCK too: for a row-sharded parameter the blocks tile its rows, so they shard with them
    return geometry in (StateGeometry.PARAMETER, StateGeometry.ROW, StateGeometry.BLOCK)

"""The one canonical primitive codec for every descriptor of the convention.

``to_primitive`` turns a descriptor into a JSON-safe and ``torch.load(weights_only=True)``
safe tree of ``dict`` (str keys), ``list``, ``str``, ``int``, ``float``, ``bool`` and
``None``. Every record carries a ``"record"`` discriminator. ``from_primitive`` is strict:
exact key sets, exact primitive types (``bool`` is never an ``int``), lists only, it
rebuilds the descriptor so every invariant runs again, and it accepts only the canonical
form (re-encoding the result must reproduce the input exactly: sorted manifests, sorted
sets, sorted placements), so one descriptor has exactly one record and one digest. The same encoding feeds
:func:`gefen_contracts.digest.canonical_digest`, and it is the only serialization of a
``ShardIdentity`` anywhere in the project (the reference had three).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar, Union

from .capabilities import CheckpointSupport, FeatureStatus, OptimizerCapabilities, TopologyTransition, TrainingSupport
from .contract import OptimizerChildContract, OptimizerContract
from .errors import CodecError, ContractError
from .frozen import FrozenMap, exact_form, freeze_primitive, thaw_primitive
from .identity import (
    LogicalRegion,
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from .limits import PortableStateLimits
from .manifest import ShardingManifest
from .rebinding import LogicalSlotBinding
from .state_layout import OptimizerStateLayout, StateField, StateVariant

__all__ = ["RECORD_TYPES", "from_primitive", "to_primitive"]

T = TypeVar("T")

#: Record name -> descriptor class, for every type the codec knows.
RECORD_TYPES: dict[str, type] = {
    "parameter_identity": ParameterIdentity,
    "process_group_identity": ProcessGroupIdentity,
    "shard_placement": ShardPlacement,
    "logical_slice": LogicalSlice,
    "logical_region": LogicalRegion,
    "shard_identity": ShardIdentity,
    "sharding_manifest": ShardingManifest,
    "logical_slot_binding": LogicalSlotBinding,
    "state_field": StateField,
    "state_variant": StateVariant,
    "optimizer_state_layout": OptimizerStateLayout,
    "training_support": TrainingSupport,
    "topology_transition": TopologyTransition,
    "checkpoint_support": CheckpointSupport,
    "feature_status": FeatureStatus,
    "optimizer_capabilities": OptimizerCapabilities,
    "optimizer_child_contract": OptimizerChildContract,
    "optimizer_contract": OptimizerContract,
    "portable_state_limits": PortableStateLimits,
}
_RECORD_NAMES = {cls: name for name, cls in RECORD_TYPES.items()}
# Fields holding free-form primitive trees rather than typed values.
_PRIMITIVE_FIELDS = {(OptimizerContract, "extensions")}


def to_primitive(value: object) -> dict[str, Any]:
    """Encode a descriptor as a primitive record (see the module docstring)."""
    if type(value) not in _RECORD_NAMES:
        raise CodecError(f"to_primitive needs a descriptor of the convention, got {type(value).__name__}")
    encoded = _encode(value)
    assert isinstance(encoded, dict)
    return encoded


def _encode(value: object) -> object:
    cls = type(value)
    if cls in _RECORD_NAMES:
        out: dict[str, object] = {"record": _RECORD_NAMES[cls]}
        for spec in dataclasses.fields(value):  # type: ignore[arg-type]
            item = getattr(value, spec.name)
            if (cls, spec.name) in _PRIMITIVE_FIELDS:
                out[spec.name] = thaw_primitive(item)
            else:
                out[spec.name] = _encode(item)
        return out
    if isinstance(value, Enum):
        return value.value
    if value is None or cls in (bool, int, float, str):
        return value
    if cls is frozenset:
        return sorted((_encode(v) for v in value), key=_sort_key)  # type: ignore[attr-defined]
    if cls is tuple:
        return [_encode(v) for v in value]  # type: ignore[attr-defined]
    if isinstance(value, FrozenMap):
        return {k: _encode(v) for k, v in value.items()}
    raise CodecError(f"cannot encode a value of type {cls.__name__}")


def _sort_key(item: object) -> str:
    return item if isinstance(item, str) else repr(item)


def from_primitive(data: object, expected: type[T] | None = None) -> T:
    """Decode a primitive record back into its descriptor (strictly; see the module docstring).

    ``expected`` (optional) requires a specific descriptor type.
    """
    if type(data) is not dict:
        raise CodecError(f"a primitive record must be a dict, got {type(data).__name__}")
    name = data.get("record")
    cls = RECORD_TYPES.get(name) if type(name) is str else None
    if cls is None:
        raise CodecError(f"unknown record discriminator {name!r}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected a {expected.__name__} record, got {name!r}")
    assert isinstance(name, str)
    try:
        value = _decode_record(cls, data, name)
    except CodecError:
        raise
    except (ContractError, TypeError) as exc:
        raise CodecError(f"invalid {name} record: {exc}") from exc
    if exact_form(_encode(value)) != exact_form(data):  # bit for bit: 1.0 is not 1, -0.0 not 0.0
        raise CodecError(f"{name} record is not in canonical form (re-encoding it gives a different record)")
    return value  # type: ignore[return-value]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _decode_record(cls: type, data: dict[str, object], where: str) -> object:
    specs = dataclasses.fields(cls)
    expected_keys = {"record"} | {s.name for s in specs}
    if set(data) != expected_keys:
        extra = sorted(set(data) - expected_keys)
        missing = sorted(expected_keys - set(data))
        raise CodecError(f"{where} record has wrong keys (missing {missing}, unexpected {extra})")
    hints = _hints(cls)
    kwargs: dict[str, object] = {}
    for spec in specs:
        path = f"{where}.{spec.name}"
        raw = data[spec.name]
        if (cls, spec.name) in _PRIMITIVE_FIELDS:
            try:
                kwargs[spec.name] = freeze_primitive(raw, path)
            except (ContractError, TypeError) as exc:
                raise CodecError(str(exc)) from exc
        else:
            kwargs[spec.name] = _decode(hints[spec.name], raw, path)
    return cls(**kwargs)


def _decode(hint: Any, raw: object, path: str) -> object:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _decode(options[0], raw, path)
        if type(raw) is dict:
            name = raw.get("record")
            for option in options:
                if _RECORD_NAMES.get(option) == name:
                    return _decode(option, raw, path)
        raise CodecError(f"{path}: value matches none of {[getattr(o, '__name__', o) for o in options]}")
    if hint in _RECORD_NAMES:
        if type(raw) is not dict or raw.get("record") != _RECORD_NAMES[hint]:
            raise CodecError(f"{path}: expected a {_RECORD_NAMES[hint]} record")
        return _decode_record(hint, raw, path)
    if isinstance(hint, type) and issubclass(hint, Enum):
        if type(raw) is not str:
            raise CodecError(f"{path}: expected a {hint.__name__} value string, got {type(raw).__name__}")
        try:
            return hint(raw)
        except ValueError:
            raise CodecError(f"{path}: {raw!r} is not a {hint.__name__} value") from None
    if hint in (bool, int, float, str):
        if type(raw) is not hint:
            raise CodecError(f"{path}: expected {hint.__name__}, got {type(raw).__name__}")
        return raw
    if origin in (tuple, frozenset):
        if type(raw) is not list:
            raise CodecError(f"{path}: expected a list, got {type(raw).__name__}")
        item_hint = args[0]
        items = [_decode(item_hint, item, f"{path}[{i}]") for i, item in enumerate(raw)]
        if origin is frozenset:
            encoded = [_encode(v) for v in items]
            if encoded != sorted(encoded, key=_sort_key) or len(set(items)) != len(items):
                raise CodecError(f"{path}: set members must be unique and sorted")
            return frozenset(items)
        return tuple(items)
    if origin in (Mapping, dict) or hint is Mapping:
        if type(raw) is not dict:
            raise CodecError(f"{path}: expected a dict, got {type(raw).__name__}")
        value_hint = args[1] if args else Any
        out: dict[str, object] = {}
        for key, item in raw.items():
            if type(key) is not str:
                raise CodecError(f"{path}: keys must be str")
            out[key] = _decode(value_hint, item, f"{path}.{key}")
        return FrozenMap(out)
    raise CodecError(f"{path}: the codec has no rule for type {hint!r}")

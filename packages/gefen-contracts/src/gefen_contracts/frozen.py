"""Immutable containers used inside descriptors (hashable, deep-frozen)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TypeVar

from .errors import ContractError, ContractTypeError

__all__ = ["FrozenMap", "exact_form", "freeze_primitive", "thaw_primitive"]

V = TypeVar("V")


def exact_form(value: object) -> object:
    """``value`` with every primitive tagged by its exact type, floats by their bits: what two
    values must share to encode to one record and one digest (Python's ``==`` has ``1 == True ==
    1.0`` and ``0.0 == -0.0``; the digest grammar does not). Other objects stand for themselves."""
    kind = type(value)
    if kind is float:
        return ("float", value.hex())  # type: ignore[attr-defined]
    if kind is bool or kind is int:
        return (kind.__name__, value)
    if kind is tuple or kind is list:
        return (kind.__name__, tuple(exact_form(item) for item in value))  # type: ignore[attr-defined]
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((str(key), exact_form(item)) for key, item in value.items())))
    return value


class FrozenMap(Mapping[str, V]):
    """A hashable, read-only mapping with ``str`` keys kept in sorted order; equal (and hashed)
    by :func:`exact_form`, so maps that digest differently never compare equal."""

    __slots__ = ("_exact", "_index", "_items")

    def __init__(self, items: Mapping[str, V] | None = None) -> None:
        source = {} if items is None else items
        if not isinstance(source, Mapping):
            raise ContractTypeError(f"expected a mapping, got {type(source).__name__}")
        for key in source:
            if type(key) is not str:
                raise ContractTypeError(f"mapping keys must be str, got {type(key).__name__}")
        self._items: tuple[tuple[str, V], ...] = tuple(sorted(source.items()))
        self._index = dict(self._items)
        self._exact = exact_form(self._index)

    def __getitem__(self, key: str) -> V:
        return self._index[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._exact)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return bool(self._exact == other._exact)
        if isinstance(other, Mapping):
            return bool(self._exact == exact_form(other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self._items)!r})"

    def __setattr__(self, name: str, value: object) -> None:
        if name in self.__slots__ and not hasattr(self, name):
            object.__setattr__(self, name, value)
            return
        raise AttributeError("FrozenMap is immutable")


def freeze_primitive(value: object, field: str, depth: int = 0) -> object:
    """Deep-freeze a JSON-like primitive tree (dict -> FrozenMap, list -> tuple).

    Accepted leaves: None, bool, int, finite float, str (exact types). Raises naming ``field``.
    """
    if depth > 64:
        raise ContractError(f"{field} is nested deeper than 64 levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise ContractError(f"{field} holds a non-finite float")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(freeze_primitive(v, f"{field}[{i}]", depth + 1) for i, v in enumerate(value))
    if isinstance(value, (dict, FrozenMap)):
        out: dict[str, object] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise ContractTypeError(f"{field} has a non-str key {key!r}")
            out[key] = freeze_primitive(item, f"{field}.{key}", depth + 1)
        return FrozenMap(out)
    raise ContractTypeError(f"{field} holds a non-primitive value of type {kind.__name__}")


def thaw_primitive(value: object) -> object:
    """Inverse of :func:`freeze_primitive` (FrozenMap -> dict, tuple -> list)."""
    if isinstance(value, FrozenMap):
        return {k: thaw_primitive(v) for k, v in value.items()}
    if type(value) is tuple:
        return [thaw_primitive(v) for v in value]
    return value

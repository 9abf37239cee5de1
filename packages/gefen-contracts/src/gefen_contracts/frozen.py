"""Immutable containers used inside descriptors (hashable, deep-frozen)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TypeVar

from .errors import ContractError, ContractTypeError

__all__ = ["FrozenMap", "freeze_primitive", "thaw_primitive"]

V = TypeVar("V")


class FrozenMap(Mapping[str, V]):
    """A hashable, read-only mapping with ``str`` keys kept in sorted order."""

    __slots__ = ("_index", "_items")

    def __init__(self, items: Mapping[str, V] | None = None) -> None:
        source = {} if items is None else items
        if not isinstance(source, Mapping):
            raise ContractTypeError(f"expected a mapping, got {type(source).__name__}")
        for key in source:
            if type(key) is not str:
                raise ContractTypeError(f"mapping keys must be str, got {type(key).__name__}")
        self._items: tuple[tuple[str, V], ...] = tuple(sorted(source.items()))
        self._index = dict(self._items)

    def __getitem__(self, key: str) -> V:
        return self._index[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenMap):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other)
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

"""Exact-type validation helpers shared by every descriptor of the convention.

The rules are strict on purpose: ``bool`` is never accepted as an ``int``, subclasses of
``str``/``int``/``float`` are rejected, and every element of a collection is checked.
Each helper names the field in its error message. The helpers are public so that
adopters and sibling packages validate exactly the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import Enum
from typing import TypeVar

from .errors import ContractError, ContractTypeError

__all__ = [
    "exact_bool",
    "exact_enum",
    "exact_float",
    "exact_int",
    "exact_str",
    "frozen_enum_set",
    "frozen_str_set",
    "identity_name",
    "int_tuple",
    "nonempty_str",
    "str_tuple",
    "tuple_of",
]

E = TypeVar("E", bound=Enum)
T = TypeVar("T")


def _tname(value: object) -> str:
    return type(value).__name__


def exact_int(value: object, field: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` if it is exactly an ``int`` within ``[minimum, maximum]``."""
    if type(value) is not int:
        raise ContractTypeError(f"{field} must be an int (bool and subclasses rejected), got {_tname(value)}")
    if minimum is not None and value < minimum:
        raise ContractError(f"{field} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ContractError(f"{field} must be <= {maximum}, got {value}")
    return value


def exact_bool(value: object, field: str) -> bool:
    """Return ``value`` if it is exactly ``True`` or ``False``."""
    if type(value) is not bool:
        raise ContractTypeError(f"{field} must be a bool, got {_tname(value)}")
    return value


def exact_float(value: object, field: str, *, finite: bool = True) -> float:
    """Return ``value`` if it is exactly a ``float`` (finite unless ``finite=False``)."""
    if type(value) is not float:
        raise ContractTypeError(f"{field} must be a float, got {_tname(value)}")
    if finite and not math.isfinite(value):
        raise ContractError(f"{field} must be finite, got {value!r}")
    return value


def exact_str(value: object, field: str) -> str:
    """Return ``value`` if it is exactly a ``str`` (subclasses rejected)."""
    if type(value) is not str:
        raise ContractTypeError(f"{field} must be a str (subclasses rejected), got {_tname(value)}")
    return value


def nonempty_str(value: object, field: str) -> str:
    """An exact ``str`` that is not empty."""
    text = exact_str(value, field)
    if not text:
        raise ContractError(f"{field} must not be empty")
    return text


def identity_name(value: object, field: str) -> str:
    """An exact, non-empty ``str`` without outer whitespace or NUL characters."""
    text = nonempty_str(value, field)
    if text != text.strip():
        raise ContractError(f"{field} must not have leading or trailing whitespace, got {text!r}")
    if "\x00" in text:
        raise ContractError(f"{field} must not contain NUL characters")
    return text


def exact_enum(value: E | object, enum_type: type[E], field: str) -> E:
    """Return ``value`` if it is a member of ``enum_type`` (its raw string value is rejected)."""
    if type(value) is not enum_type:
        raise ContractTypeError(f"{field} must be a {enum_type.__name__} member, got {_tname(value)}")
    return value


def _as_sequence(value: object, field: str) -> tuple[object, ...]:
    if isinstance(value, (str, bytes, bytearray, dict)):
        raise ContractTypeError(f"{field} must be a sequence or set, not {_tname(value)}")
    if not isinstance(value, Iterable):
        raise ContractTypeError(f"{field} must be iterable, got {_tname(value)}")
    return tuple(value)


def tuple_of(value: object, item_type: type[T], field: str) -> tuple[T, ...]:
    """Copy ``value`` into a tuple whose every element is exactly ``item_type``."""
    items = _as_sequence(value, field)
    for index, item in enumerate(items):
        if type(item) is not item_type:
            raise ContractTypeError(f"{field}[{index}] must be a {item_type.__name__}, got {_tname(item)}")
    return items  # type: ignore[return-value]


def int_tuple(value: object, field: str, *, minimum: int = 0, unique: bool = False) -> tuple[int, ...]:
    """Copy ``value`` into a tuple of exact ints ``>= minimum`` (optionally unique)."""
    items = _as_sequence(value, field)
    for index, item in enumerate(items):
        exact_int(item, f"{field}[{index}]", minimum=minimum)
    if unique and len(set(items)) != len(items):
        raise ContractError(f"{field} must not contain duplicates, got {items}")
    return items  # type: ignore[return-value]


def str_tuple(value: object, field: str, *, unique: bool = False, names: bool = False) -> tuple[str, ...]:
    """Copy ``value`` into a tuple of exact strs (identity names when ``names``)."""
    items = _as_sequence(value, field)
    check = identity_name if names else exact_str
    for index, item in enumerate(items):
        check(item, f"{field}[{index}]")
    if unique and len(set(items)) != len(items):
        raise ContractError(f"{field} must not contain duplicates")
    return items  # type: ignore[return-value]


def frozen_enum_set(value: object, enum_type: type[E], field: str) -> frozenset[E]:
    """Copy ``value`` into a frozenset whose every element is a member of ``enum_type``."""
    items = _as_sequence(value, field)
    for index, item in enumerate(items):
        exact_enum(item, enum_type, f"{field}[{index}]")
    return frozenset(items)  # type: ignore[arg-type]


def frozen_str_set(value: object, field: str) -> frozenset[str]:
    """Copy ``value`` into a frozenset of non-empty exact strs."""
    items = _as_sequence(value, field)
    for index, item in enumerate(items):
        identity_name(item, f"{field}[{index}]")
    return frozenset(items)  # type: ignore[arg-type]

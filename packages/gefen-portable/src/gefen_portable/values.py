"""Primitive records: the plain values a portable document may hold outside dense fields.

Adapters hand over options and policies as frozen mappings (``FrozenMap``, tuples); a
document holds plain ``dict`` / ``list`` trees instead, so it survives
``torch.load(weights_only=True)`` and hashes the same everywhere. These helpers convert and
validate those trees with exact types and name the offending path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .errors import PortableStateError
from .tensors import DTYPE_CODES, check_finite, is_tight_cpu, owned_cpu_copy

__all__ = ["check_name", "clone_tree", "plain_common", "plain_primitive"]

_MAX_DEPTH = 64


def check_name(value: object, where: str) -> str:
    """A non-empty exact ``str`` without outer whitespace or NUL (field, counter and variant names)."""
    if type(value) is not str:
        raise PortableStateError(f"{where} must be a str, got {type(value).__name__}")
    if not value or value != value.strip() or "\x00" in value:
        raise PortableStateError(f"{where} {value!r} must be non-empty, trimmed and free of NUL")
    return value


def plain_primitive(value: object, where: str, *, tensors: bool = False, depth: int = 0) -> object:
    """A fresh plain tree (``dict``/``list``/primitives) equal to ``value``.

    Mappings (``dict``, ``FrozenMap``) become ``dict`` with ``str`` keys; lists and tuples
    become ``list``; ``None``, ``bool``, ``int``, finite ``float`` and ``str`` (exact types)
    pass through. With ``tensors``, exact CPU-copyable tensors of a wire dtype are accepted
    and returned as tight, finite CPU tensors (copied unless already tight).
    """
    if depth > _MAX_DEPTH:
        raise PortableStateError(f"{where} is nested deeper than {_MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):  # type: ignore[arg-type]
            raise PortableStateError(f"{where} is a non-finite float")
        return value
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise PortableStateError(f"{where} has a non-str key {key!r}")
            out[key] = plain_primitive(item, f"{where}[{key!r}]", tensors=tensors, depth=depth + 1)
        return out
    if kind in (list, tuple):
        items: list[object] | tuple[object, ...] = value  # type: ignore[assignment]
        return [
            plain_primitive(item, f"{where}[{index}]", tensors=tensors, depth=depth + 1)
            for index, item in enumerate(items)
        ]
    if tensors and isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor:
            raise PortableStateError(f"{where} must be exactly torch.Tensor, got {kind.__name__}")
        if value.layout is not torch.strided or value.is_meta or value.dtype not in DTYPE_CODES:
            raise PortableStateError(f"{where} must be a strided tensor of a wire dtype, got {value.dtype}")
        tight = value if (is_tight_cpu(value) and not value.requires_grad) else owned_cpu_copy(value)
        check_finite(tight, where)
        return tight
    raise PortableStateError(f"{where} holds a value of type {kind.__name__}, which a portable record cannot hold")


def plain_common(value: object, where: str) -> dict[str, object]:
    """An optimizer-common record: a mapping of names to primitives or tensors."""
    if not isinstance(value, Mapping):
        raise PortableStateError(f"{where} must be a mapping, got {type(value).__name__}")
    for key in value:
        check_name(key, f"{where} key")
    plain = plain_primitive(value, where, tensors=True)
    assert isinstance(plain, dict)
    return plain


def clone_tree(value: object) -> object:
    """A copy of a plain tree with fresh containers and cloned tensors."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) is dict:
        return {key: clone_tree(item) for key, item in value.items()}
    if type(value) is list:
        return [clone_tree(item) for item in value]
    return value

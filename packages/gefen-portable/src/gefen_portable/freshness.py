"""Freshness tokens: did the optimizer change between two points of a protocol?

The token walks what ``torch.optim.Optimizer`` exposes (``param_groups``, ``state``,
``defaults``; a composite's children) and records, for every container, its identity and
keys, for every tensor its identity, autograd version counter, storage address, shape,
dtype and device, and for every primitive its value. Any ``step()``, in-place update,
``load_state_dict`` or container swap changes it. It is O(number of tensors), reads no
tensor data and runs no collective. Tensors without a version counter (inference-mode
tensors) are covered by identity and address only.

The same walk lists the storage addresses of the live tensors, so an export can refuse to
keep references into them (:func:`live_storages`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts import CompositeOptimizer

__all__ = ["live_storages", "optimizer_token"]

_MAX_DEPTH = 16


def _version(tensor: torch.Tensor) -> int:
    try:
        return int(tensor._version)
    except (RuntimeError, AttributeError):
        return -1


def _tensor_token(tensor: torch.Tensor) -> tuple[object, ...]:
    address = -1 if tensor.is_meta or tensor.layout is not torch.strided else tensor.data_ptr()
    return ("tensor", id(tensor), _version(tensor), address, tuple(tensor.shape), str(tensor.dtype), str(tensor.device))


def _token(value: object, depth: int) -> object:
    if isinstance(value, torch.Tensor):
        return _tensor_token(value)
    if value is None or type(value) in (bool, int, str):
        return ("value", type(value).__name__, value)
    if type(value) is float:
        number: float = value
        return ("float", number.hex() if math.isfinite(number) else repr(number))
    if depth > _MAX_DEPTH:
        return ("deep", type(value).__qualname__, id(value))
    if isinstance(value, Mapping):
        return (
            "mapping",
            type(value).__qualname__,
            id(value),
            tuple(
                (_token(key, depth + 1) if isinstance(key, torch.Tensor) else repr(key), _token(item, depth + 1))
                for key, item in value.items()
            ),
        )
    if isinstance(value, (list, tuple)):
        return ("sequence", type(value).__qualname__, id(value), tuple(_token(item, depth + 1) for item in value))
    return ("object", type(value).__qualname__, id(value))


def optimizer_token(optimizer: Any) -> tuple[object, ...]:
    """A hashable token that changes whenever the optimizer's groups, state or tensors change."""
    if isinstance(optimizer, CompositeOptimizer):
        children = optimizer.child_optimizers()
        return ("composite", id(optimizer), tuple((role, optimizer_token(child)) for role, child in children.items()))
    parts: list[object] = ["optimizer", id(optimizer), type(optimizer).__qualname__]
    for name in ("param_groups", "state", "defaults"):
        value = getattr(optimizer, name, None)
        parts.append((name, _token(value, 0)))
    return tuple(parts)


def _collect(value: object, out: set[int], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        if not value.is_meta and value.layout is torch.strided:
            out.add(value.untyped_storage().data_ptr())
        return
    if depth > _MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _collect(key, out, depth + 1)
            _collect(item, out, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, out, depth + 1)


def live_storages(optimizer: Any) -> frozenset[int]:
    """Storage addresses of every tensor reachable from the optimizer's groups and state."""
    out: set[int] = set()
    if isinstance(optimizer, CompositeOptimizer):
        for child in optimizer.child_optimizers().values():
            out |= live_storages(child)
        return frozenset(out)
    for name in ("param_groups", "state"):
        _collect(getattr(optimizer, name, None), out, 0)
    out.discard(0)
    return frozenset(out)

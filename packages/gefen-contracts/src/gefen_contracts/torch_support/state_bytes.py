"""Optimizer-state bytes, counted as the unique tensor storages reachable from an optimizer.

Counting what the optimizer *holds* (rather than what its ``state_dict`` would serialize
or what its docs promise) catches caches, scratch buffers, per-device copies and views
that keep a larger storage alive. The walk starts at ``optimizer.state``, the non-``params``
entries of ``param_groups`` and every other instance attribute, and follows dicts,
lists, tuples, sets and plain objects (``__dict__`` and ``__slots__``). Each storage is
counted once, at its full size, attributed to the first path that reached it. Parameter
and gradient storages are excluded, as are ``nn.Module`` objects (an optimizer that keeps
a model reference would otherwise be charged for the model's buffers). Tensor subclasses
that wrap inner tensors (torchao's quantized states, DTensor) are opened through
``__tensor_flatten__``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import FunctionType, MethodType, ModuleType
from typing import Any

import torch

__all__ = ["StateBytes", "count_state_bytes", "parameter_count"]

_MAX_DEPTH = 64


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Unique storage bytes reachable from an optimizer, with where each storage was found."""

    total: int
    parameters: int
    by_path: Mapping[str, int] = field(default_factory=dict)

    def by_kind(self) -> dict[str, int]:
        """Bytes grouped by the last component of the path (a state key or an attribute name)."""
        grouped: dict[str, int] = {}
        for path, nbytes in self.by_path.items():
            kind = path.rsplit(".", 1)[-1].split("[", 1)[0]
            grouped[kind] = grouped.get(kind, 0) + nbytes
        return grouped


def _storage_key(tensor: torch.Tensor) -> tuple[str, int, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if storage.nbytes() == 0 or tensor.device.type == "meta":
        return None
    return (tensor.device.type, tensor.device.index or 0, storage.data_ptr())


def _leaf_tensors(tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """The plain tensors behind ``tensor`` (itself, or a subclass's inner tensors)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        yield "", tensor
        return
    names, _ = flatten(tensor)
    for name in names:
        inner = getattr(tensor, name)
        if not isinstance(inner, torch.Tensor):  # a DTensor also names its device mesh
            continue
        for suffix, leaf in _leaf_tensors(inner):
            yield f".{name}{suffix}", leaf


def parameter_count(optimizer: torch.optim.Optimizer) -> int:
    """Number of parameter elements the optimizer manages (each tensor once)."""
    seen: set[int] = set()
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _excluded_storages(optimizer: torch.optim.Optimizer) -> set[tuple[str, int, int]]:
    excluded: set[tuple[str, int, int]] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            for tensor in (p, p.grad):
                if tensor is None:
                    continue
                for _, leaf in _leaf_tensors(tensor):
                    key = _storage_key(leaf)
                    if key is not None:
                        excluded.add(key)
    return excluded


class _Walker:
    def __init__(self, excluded: set[tuple[str, int, int]], param_names: Mapping[int, str]) -> None:
        self.excluded = excluded
        self.param_names = param_names
        self.seen_objects: set[int] = set()
        self.seen_storages: set[tuple[str, int, int]] = set()
        self.by_path: dict[str, int] = {}

    def tensor(self, tensor: torch.Tensor, path: str) -> None:
        for suffix, leaf in _leaf_tensors(tensor):
            key = _storage_key(leaf)
            if key is None or key in self.excluded or key in self.seen_storages:
                continue
            self.seen_storages.add(key)
            where = path + suffix
            self.by_path[where] = self.by_path.get(where, 0) + leaf.untyped_storage().nbytes()

    def visit(self, obj: Any, path: str, depth: int = 0) -> None:
        if depth > _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, complex, bool)):
            return
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, path)
            return
        if isinstance(obj, (type, ModuleType, FunctionType, MethodType, torch.nn.Module, torch.device, torch.dtype)):
            return
        if id(obj) in self.seen_objects:
            return
        self.seen_objects.add(id(obj))
        if isinstance(obj, Mapping):
            for key, value in obj.items():
                if isinstance(key, torch.Tensor):
                    label = self.param_names.get(id(key), "param")
                    self.visit(value, f"{path}[{label}]", depth + 1)
                else:
                    self.visit(value, f"{path}.{key}", depth + 1)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for index, value in enumerate(obj):
                self.visit(value, f"{path}[{index}]", depth + 1)
            return
        attributes = getattr(obj, "__dict__", None)
        if isinstance(attributes, dict):
            for name, value in attributes.items():
                self.visit(value, f"{path}.{name}", depth + 1)
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                self.visit(getattr(obj, slot), f"{path}.{slot}", depth + 1)


def count_state_bytes(
    optimizer: torch.optim.Optimizer, *, parameter_names: Mapping[int, str] | None = None
) -> StateBytes:
    """Unique storage bytes reachable from ``optimizer``, excluding parameters and gradients.

    ``parameter_names`` maps ``id(parameter)`` to a name used in :attr:`StateBytes.by_path`
    (unnamed parameters are called ``param<i>`` in ``param_groups`` order).
    """
    names: dict[int, str] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            names.setdefault(id(p), f"param{len(names)}")
    names.update(parameter_names or {})
    walker = _Walker(_excluded_storages(optimizer), names)
    walker.visit(optimizer.state, "state")
    for index, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                walker.visit(value, f"param_groups[{index}].{key}")
    for name, value in vars(optimizer).items():
        if name not in ("state", "param_groups"):
            walker.visit(value, name)
    return StateBytes(sum(walker.by_path.values()), parameter_count(optimizer), dict(walker.by_path))

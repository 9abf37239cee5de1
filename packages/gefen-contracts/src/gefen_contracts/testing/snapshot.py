"""The "changed nothing" oracle: a deep snapshot of everything reachable from an optimizer.

A snapshot records, for every reachable container, object and tensor, its identity and
(for tensors, including parameters and their gradients) its exact bytes, dtype, shape,
stride, device and ``requires_grad``, plus the key order of every dict and the contents of
byte arrays, arrays, numpy arrays and torch generators (their RNG state). Two snapshots are equal only when no
container was replaced or edited in place and no tensor changed a bit.
"""

from __future__ import annotations

import array
import collections
import types
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..torch_support.tensors import is_dtensor, local_tensor

__all__ = ["Snapshot", "deep_snapshot", "snapshot_diff"]

_MAX_NODES = 500_000
_OPAQUE_MODULE_PREFIXES = ("builtins", "torch", "typing", "functools", "threading", "weakref", "_thread", "enum")


@dataclass(frozen=True)
class Snapshot:
    entries: dict[str, object]


def deep_snapshot(*roots: Any) -> Snapshot:
    """Snapshot everything reachable from ``roots`` (optimizers, models, tensors...)."""
    walker = _Walker()
    for index, root in enumerate(roots):
        walker.visit(root, f"root{index}", 0)
    return Snapshot(walker.entries)


def snapshot_diff(before: Snapshot, after: Snapshot | Any, *roots: Any, limit: int = 12) -> list[str]:
    """Paths whose token differs between two snapshots (empty when nothing changed).

    ``after`` may be a Snapshot or, with ``roots``, the first root to snapshot now.
    """
    if not isinstance(after, Snapshot):
        after = deep_snapshot(after, *roots)
    diffs: list[str] = []
    keys = list(before.entries) + [k for k in after.entries if k not in before.entries]
    for key in keys:
        a, b = before.entries.get(key, "<absent>"), after.entries.get(key, "<absent>")
        if a != b:
            diffs.append(f"{key}: {_short(a)} -> {_short(b)}")
            if len(diffs) >= limit:
                diffs.append("...")
                break
    return diffs


def _short(token: object) -> str:
    text = repr(token)
    return text if len(text) < 120 else text[:117] + "..."


def _tensor_token(tensor: torch.Tensor) -> tuple[object, ...]:
    local = local_tensor(tensor) if is_dtensor(tensor) else None
    if local is not None:
        # A tensor subclass has no .numpy(): record the global metadata and the local shard.
        placements = repr(tuple(tensor.placements))  # type: ignore[attr-defined]
        return ("dtensor", id(tensor), str(tensor.dtype), tuple(tensor.shape), placements, _tensor_token(local)[2:])
    if tensor.is_meta or tensor.layout is not torch.strided:
        return ("tensor", id(tensor), str(tensor.dtype), tuple(tensor.shape), str(tensor.layout), str(tensor.device))
    data = tensor.detach()
    if data.is_conj():
        data = data.resolve_conj()
    if data.is_neg():
        data = data.resolve_neg()
    cpu = data.to("cpu").contiguous().reshape(-1)  # a 0-dim tensor cannot be viewed as bytes
    raw = cpu.view(torch.uint8) if cpu.dtype is not torch.bool else cpu.to(torch.uint8)
    return (
        "tensor",
        id(tensor),
        str(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        str(tensor.device),
        tensor.requires_grad,
        raw.numpy().tobytes(),
    )


def _buffer_token(value: object) -> tuple[object, ...] | None:
    """The contents of the mutable buffers the walker cannot descend into (``None``: not one)."""
    if isinstance(value, bytearray):
        return ("bytearray", id(value), bytes(value))
    if isinstance(value, array.array):
        return ("array", id(value), value.typecode, value.tobytes())
    if isinstance(value, torch.Generator):
        return ("generator", id(value), str(value.device), value.get_state().numpy().tobytes())
    kind = type(value)
    if kind.__name__ == "ndarray" and kind.__module__ == "numpy":  # without importing numpy
        return ("ndarray", id(value), str(value.dtype), value.shape, value.tobytes())  # type: ignore[attr-defined]
    return None


class _Walker:
    def __init__(self) -> None:
        self.entries: dict[str, object] = {}
        self.seen: dict[int, str] = {}
        self.keepalive: list[object] = []

    def visit(self, value: Any, path: str, depth: int) -> None:
        if len(self.entries) > _MAX_NODES:
            raise RuntimeError("deep_snapshot: too many reachable objects (more than 500k)")
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            self.entries[path] = ("value", type(value).__name__, repr(value))
            return
        if isinstance(value, (torch.dtype, torch.device, torch.Size)):
            self.entries[path] = ("value", type(value).__name__, repr(value))
            return
        first = self.seen.get(id(value))
        if first is not None:
            self.entries[path] = ("ref", first)
            return
        self.seen[id(value)] = path
        self.keepalive.append(value)
        if isinstance(value, torch.Tensor):
            self.entries[path] = _tensor_token(value)
            grad = value.grad if isinstance(value, torch.nn.Parameter) or value.is_leaf else None
            if grad is not None:
                self.visit(grad, f"{path}.grad", depth + 1)
            return
        if depth > 24:
            self.entries[path] = ("deep", type(value).__name__, id(value))
            return
        if isinstance(value, Mapping):
            keys = list(value.keys())
            self.entries[path] = ("mapping", type(value).__name__, id(value), tuple(_key_token(k) for k in keys))
            for key in keys:
                self.visit(value[key], f"{path}[{_key_token(key)}]", depth + 1)
            return
        buffer = _buffer_token(value)
        if buffer is not None:
            self.entries[path] = buffer
            return
        if isinstance(value, (list, tuple, collections.deque)):
            self.entries[path] = ("sequence", type(value).__name__, id(value), len(value))
            for index, item in enumerate(value):
                self.visit(item, f"{path}[{index}]", depth + 1)
            return
        if isinstance(value, (set, frozenset)):
            self.entries[path] = ("set", type(value).__name__, id(value), tuple(sorted(_key_token(v) for v in value)))
            return
        if isinstance(
            value,
            (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, type, weakref.ref),
        ) or _is_opaque(value):
            self.entries[path] = ("object", type(value).__name__, id(value))
            return
        self.entries[path] = ("object", type(value).__qualname__, id(value))
        attributes = _attributes(value)
        for name in attributes:
            try:
                item = getattr(value, name)
            except AttributeError:
                continue
            self.visit(item, f"{path}.{name}", depth + 1)


def _key_token(key: object) -> str:
    if isinstance(key, torch.Tensor):
        return f"<tensor@{id(key):x}>"
    return repr(key)


def _is_opaque(value: object) -> bool:
    module = type(value).__module__ or ""
    if isinstance(value, (torch.optim.Optimizer, torch.nn.Module)):
        return False
    return module.split(".")[0] in _OPAQUE_MODULE_PREFIXES


def _attributes(value: object) -> list[str]:
    names: list[str] = []
    if hasattr(value, "__dict__"):
        names.extend(vars(value).keys())
    for cls in type(value).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in ("__weakref__", "__dict__") and slot not in names:
                names.append(slot)
    return names

"""A cheap freshness token for prepared transactions: version counters, not content hashes.

A prepare phase records :func:`state_version_token` and the commit compares it again. The
reference hashed every byte of optimizer state twice per import (a device-to-host copy of
all state); this token reads only metadata, in O(parameters + state entries):

* every group: the dict's identity, its ``params`` list's identity, every option value
  (primitives by value, tensors by version), and for every parameter its identity,
  autograd version counter (``_version``), storage address, dtype, shape and device;
* every state entry: the parameter key's identity, the entry dict's identity, and each
  value (tensors by identity, version and storage address, primitives by value).

What it detects: a step or load that writes state or parameters in place (each in-place op
bumps ``_version``), a storage retarget (``p.data = other``), replaced or edited group
dicts, params lists, options and state entries. What it cannot see: writes that bypass
autograd's version counter (through ``tensor.numpy()``, or ``p.data.add_(...)`` which uses
a separate counter) and changes to an optimizer's private attributes; an optimizer adds
its own mutation counter to the token for the latter.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from .tensors import local_tensor

__all__ = ["state_version_token", "tensor_version_token"]


def tensor_version_token(tensor: torch.Tensor) -> tuple[Hashable, ...]:
    """Identity, version counter, storage address, dtype, shape and device of ``tensor``.

    A DTensor is described by its local shard (no collective), with both version counters: an
    in-place op through the DTensor (an FSDP2 parameter's ``copy_``, torch's optimizers) bumps
    the DTensor's own, a write to the local shard the shard's. Inference-mode tensors have no
    version counter; they are immutable outside inference mode, so they use ``-1``.
    """
    local = local_tensor(tensor)
    try:
        version: Hashable = int(local._version) if local is tensor else (int(tensor._version), int(local._version))
    except RuntimeError:  # inference tensors do not track versions
        version = -1
    address = 0
    if local.layout is torch.strided and not local.is_meta:
        address = int(local.untyped_storage().data_ptr()) + int(local.storage_offset()) * local.element_size()
    return (id(tensor), version, address, str(local.dtype), tuple(local.shape), str(local.device))


def _value_token(value: object, depth: int = 0) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", *tensor_version_token(value))
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return (kind.__name__, value)
    if kind is float:
        number: float = value  # type: ignore[assignment]
        # exact bits: two options that print alike but differ in the last bit are different
        return ("float", number.hex() if math.isfinite(number) else repr(number))
    if depth < 8 and kind in (list, tuple):
        return (kind.__name__, tuple(_value_token(v, depth + 1) for v in value))  # type: ignore[attr-defined]
    if depth < 8 and kind is dict:
        # id too: replacing a nested dict by an equal one still counts as a change
        return ("dict", id(value), tuple((repr(k), _value_token(v, depth + 1)) for k, v in value.items()))  # type: ignore[attr-defined]
    # anything else (and nesting past 8) is compared by identity only: cheap and conservative
    return ("object", kind.__qualname__, id(value))


def state_version_token(param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any]) -> tuple[Hashable, ...]:
    """The freshness token of a torch optimizer's public containers (see the module docstring).

    Callers add their own mutation counter (and anything else private that matters) to the
    tuple. Two tokens compare equal only if no group, option, parameter or state entry was
    replaced, edited or written in place in between.
    """
    groups = []
    for group in param_groups:
        params = group["params"]
        options = tuple((key, _value_token(value)) for key, value in group.items() if key != "params")
        # id(params): swapping in an equal list is a change too (post_sharding installs new lists)
        groups.append((id(group), id(params), tuple(tensor_version_token(p) for p in params), options))
    entries = []
    for key, entry in state.items():
        if isinstance(entry, Mapping):
            values: Hashable = tuple((repr(k), _value_token(v)) for k, v in entry.items())
        else:
            values = _value_token(entry)
        entries.append((id(key), id(entry), values))
    return (tuple(groups), tuple(entries))

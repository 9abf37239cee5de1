"""Freshness tokens: did the optimizer change between two points of a protocol?

The token is the contracts' version-counter token of what ``torch.optim.Optimizer`` exposes
(``gefen_contracts.torch_support.state_version_token``: the groups, their options and
parameters, the state entries and their tensors, by identity, version counter and address),
for a composite that of each child, with the optimizer's identity and type. Any ``step()``,
in-place update, ``load_state_dict`` or container swap changes it; it reads no tensor data and
runs no collective.

The same walk lists the storage addresses of the live tensors, so an export can refuse to
keep references into them (:func:`live_storages`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts.protocols import Composite
from gefen_contracts.torch_support import state_version_token

__all__ = ["live_storages", "optimizer_token"]

_MAX_DEPTH = 16


def optimizer_token(optimizer: Any) -> tuple[object, ...]:
    """A hashable token that changes whenever the optimizer's groups, state or tensors change."""
    if isinstance(optimizer, Composite):
        children = optimizer.child_optimizers()
        return ("composite", id(optimizer), tuple((role, optimizer_token(child)) for role, child in children.items()))
    # an adapter need not be a torch optimizer: without groups or state, its identity is the token
    groups, state = getattr(optimizer, "param_groups", ()), getattr(optimizer, "state", {})
    return ("optimizer", id(optimizer), type(optimizer).__qualname__, state_version_token(groups, state))


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
    if isinstance(optimizer, Composite):
        for child in optimizer.child_optimizers().values():
            out |= live_storages(child)
        return frozenset(out)
    for name in ("param_groups", "state"):
        _collect(getattr(optimizer, name, None), out, 0)
    out.discard(0)
    return frozenset(out)

"""The kit's "changed nothing" oracle sees every in-place edit it promises to see."""

from __future__ import annotations

import array
import collections
from typing import Any

import numpy as np
import pytest
import torch
from gefen_contracts.testing import deep_snapshot, snapshot_diff


class Holder:
    pass


EDITS: dict[str, Any] = {
    "deque": (lambda h: collections.deque([1, 2]), lambda v: v.append(3)),
    "bytearray": (lambda h: bytearray(b"ab"), lambda v: v.__setitem__(0, 0)),
    "array": (lambda h: array.array("d", [1.0]), lambda v: v.__setitem__(0, 9.0)),
    "ndarray": (lambda h: np.zeros(3), lambda v: v.__setitem__(0, 5.0)),
    "generator": (lambda h: torch.Generator().manual_seed(0), lambda v: torch.rand(4, generator=v)),
    "requires_grad": (lambda h: torch.nn.Parameter(torch.zeros(2)), lambda v: v.requires_grad_(False)),
    "tensor": (lambda h: torch.zeros(2), lambda v: v.add_(1)),
}


@pytest.mark.parametrize("kind", sorted(EDITS))
def test_an_in_place_edit_is_a_difference(kind: str) -> None:
    """Before, a deque, byte array, array, numpy array or generator was recorded by id only,
    and requires_grad not at all: editing them read as 'changed nothing'."""
    make, edit = EDITS[kind]
    holder = Holder()
    holder.value = make(holder)  # type: ignore[attr-defined]
    before = deep_snapshot(holder)
    assert not snapshot_diff(before, holder)
    edit(holder.value)  # type: ignore[attr-defined]
    assert snapshot_diff(before, holder), kind

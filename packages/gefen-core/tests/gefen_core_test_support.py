"""Shared fixtures for gefen-core's tests (import the fixture name into a test module to use it)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from gefen_contracts.exchange import PortableSlotState
from gefen_contracts.kernels import load_kernel_plugins
from gefen_contracts.torch_support import as_imported
from gefen_core.ops import OPS


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    """Small tensors run far faster on one intra-op thread on a shared 2-core machine (a busy
    second thread stalls every parallel op); results do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def imported_slots(slots: Sequence[PortableSlotState]) -> list[PortableSlotState]:
    """What an import onto the same pieces receives: block fields expanded per element."""
    out = []
    for slot in slots:
        codes = slot.element_fields.get("momentum_codes")
        out.append(as_imported(slot, tuple(codes.shape)) if isinstance(codes, torch.Tensor) else slot)
    return out


def dense_momentum(slot: PortableSlotState, codebook: torch.Tensor) -> torch.Tensor:
    """An exported slot's momentum ``C[code] * scale``, shaped like its piece."""
    codes = slot.element_fields["momentum_codes"]
    assert isinstance(codes, torch.Tensor)
    scale = as_imported(slot, tuple(codes.shape)).element_fields["momentum_scale"]
    assert isinstance(scale, torch.Tensor)
    return codebook[codes.long()] * scale


@contextmanager
def counting_kernels(ops: tuple[str, ...] = tuple(OPS)) -> Iterator[dict[str, int]]:
    """CPU kernels for ``ops`` that count their calls and run the reference (registered
    through ``torch.library`` over whatever is there; withdrawn on exit, which restores it)."""
    load_kernel_plugins()  # first, so the counting kernels are the latest registration
    calls: dict[str, int] = {}
    library = torch.library.Library("gefen", "IMPL")

    def counting(op: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls[op] = calls.get(op, 0) + 1
            return OPS[op].reference(*args, **kwargs)

        return run

    for op in ops:
        library.impl(op.split("::")[1], counting(op), "CPU")
    try:
        yield calls
    finally:
        library._destroy()


MIRROR = "_gefen_checkpoint_metadata"


def mirror_of(group: dict[str, Any]) -> dict[str, Any]:
    """A group's mirror of the optimizer-wide record, parsed (its codebook a list of floats)."""
    record: dict[str, Any] = json.loads(group[MIRROR])
    return record


def edit_mirror(group: dict[str, Any], **fields: Any) -> None:
    """Set record fields in a group's JSON mirror (a tensor as its list of values), re-encoded
    as ``state_dict()`` writes it."""
    record = mirror_of(group)
    record.update({key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in fields.items()})
    group[MIRROR] = json.dumps(record, sort_keys=True, separators=(",", ":"))


def edit_mirrors(state_dict: dict[str, Any], **fields: Any) -> None:
    """:func:`edit_mirror` on every group of a native state dict."""
    for group in state_dict["param_groups"]:
        edit_mirror(group, **fields)

"""Shared fixtures for gefen-core's tests (import the fixture name into a test module to use it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from gefen_contracts import PortableSlotState
from gefen_contracts.torch_support import as_imported


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

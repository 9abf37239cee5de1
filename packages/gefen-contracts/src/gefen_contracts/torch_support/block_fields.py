"""Block fields of a portable record (:class:`~gefen_contracts.exchange.PortableSlotState`).

A block field holds one value per run of ``block_period`` consecutive elements of a piece
(row-major order, the last run may be shorter). An import receives it expanded per
element; :func:`expand_blocks` is that expansion (the portable projection uses it), and
:func:`as_imported` turns an exported record into what an import onto the same piece
receives, so an adapter can be exercised without the portable driver.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..errors import ContractError
from ..exchange import PortableSlotState

__all__ = ["as_imported", "block_count", "expand_blocks"]


def block_count(numel: int, period: int) -> int:
    """How many runs of ``period`` elements (the last may be shorter) cover ``numel`` elements."""
    # integer ceil: exact for sizes beyond float precision
    return -(-numel // period)


def expand_blocks(values: torch.Tensor, period: int, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of ``shape`` whose row-major element ``i`` is ``values[i // period]``.

    ``ContractError`` unless ``values`` is 1-D with :func:`block_count` values.
    """
    numel = math.prod(shape)
    expected = (block_count(numel, period),) if period >= 1 else None
    if expected is None or tuple(values.shape) != expected:
        raise ContractError(
            f"a block field of {numel} elements in runs of {period} needs shape {expected}, got {tuple(values.shape)}"
        )
    # a run longer than the piece is one run of the piece's length (same content): never expand
    # more than twice numel, whatever period a document names; the slice drops the part of a
    # ragged last run that lies past the piece
    return values.repeat_interleave(min(period, max(numel, 1)))[:numel].reshape(tuple(shape))


def as_imported(slot: PortableSlotState, shape: Sequence[int]) -> PortableSlotState:
    """``slot`` with its block fields expanded into element fields of the piece's ``shape``."""
    expanded = {
        name: expand_blocks(value, slot.block_period, shape)
        for name, value in slot.block_fields.items()
        if isinstance(value, torch.Tensor)
    }
    if len(expanded) != len(slot.block_fields):
        raise ContractError(f"the block fields of {slot.fqn!r} must be tensors")
    # block_period 0 with no block fields: the record now reads as the element form adapters expect
    return dataclasses.replace(
        slot, element_fields={**slot.element_fields, **expanded}, block_fields={}, block_period=0
    )

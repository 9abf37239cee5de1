"""Block periods: how many contiguous elements share one second moment and one momentum scale.

A parameter of ``n`` elements (flattened row-major) is cut into ``ceil(n / P)`` blocks of
``P`` elements, ``P`` being its *period*; only :data:`RAGGED_PERIOD` leaves a shorter last block. Since 0.2 the period follows from the parameter's
shape alone (:func:`shape_period`), never from its data, so the state a first step makes
has the same shapes whatever the gradient was: a zero-gradient step (the template step of
``torch.distributed.checkpoint.state_dict``) makes the state a checkpoint loads into, and
every rank of a sharded parameter chooses the same blocks.

The rule
--------
* a tensor of two or more dimensions is cut along its rows (dim 0): ``P`` is the largest
  divisor of the row length ``prod(shape[1:])`` not above :data:`FALLBACK_PERIOD_CAP`
  (2048); a row without such a divisor of at least :data:`MIN_ROW_PERIOD` (a prime row
  length, say) is one block. Blocks never cross a row, so a row-sharded piece (FSDP2
  ``Shard(0)``) holds whole blocks and its state shards with the rows;
* a 1-D tensor, or a piece whose size is not a multiple of that (a flattened element
  shard), takes the memory-safe fallback on its own size: the largest divisor not above
  2048 when that is at least :data:`MIN_ROW_PERIOD` (or the whole piece, up to 2048
  elements), else **ragged blocks** of :data:`RAGGED_PERIOD` (2048) elements, the last one
  shorter (a near-even third of a flattened matrix is often ``2 x prime``: without them its
  state would be per element, 9 bytes a parameter); a piece of fewer than
  :data:`MIN_BLOCK_PERIOD` elements has period 1;
* a row-sharded (FSDP2 ``Shard(0)``) DTensor takes the rule on its *global* shape, so every
  rank, whatever its share of the rows (none included), chooses the same blocks; a 1-D one
  has period 1 (its elements, not blocks, are what the mesh splits, so its state shards
  and reshards with them);
* the user's overrides force ``P = 1`` (:class:`PeriodPolicy`; 1-D parameters by default).

Gefen 0.1 searched the first gradient for block structure (the reference's "largest drop of
within-block spread"). The quality ladder measured that search against
this rule (``ladder-gefen`` against ``ladder-gefen-row``, ``gefen bench quality``) and found
no difference outside the seed noise, while the search made the state's shapes depend on
the data, which torch's DCP state-dict recipe cannot load into. It is gone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gefen_contracts.torch_support import block_count

__all__ = [
    "period_policy",
    "FALLBACK_PERIOD_CAP",
    "MIN_BLOCK_PERIOD",
    "MIN_ROW_PERIOD",
    "RAGGED_PERIOD",
    "PeriodPolicy",
    "aligned_period",
    "cuts",
    "largest_divisor_at_most",
    "memory_safe_fallback",
    "period_from_blocks",
    "shape_period",
]

#: Largest block the shape rule and the memory-safe fallback choose.
FALLBACK_PERIOD_CAP = 2048
#: A fallback block below this means "per-element state" (period 1).
MIN_BLOCK_PERIOD = 8
#: A row whose largest divisor up to the cap is shorter than this is one block; a flat piece
#: whose largest divisor up to the cap is shorter than this takes ragged blocks.
MIN_ROW_PERIOD = 256
#: The period of ragged blocks: the only period that may leave a shorter last block, so a
#: checkpoint's block count gives the period back (:func:`period_from_blocks`).
RAGGED_PERIOD = FALLBACK_PERIOD_CAP


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` (``n`` itself allowed) that is ``<= cap``."""
    if n <= cap:
        return n
    best = 1
    d = 1
    while d * d <= n:
        if n % d == 0:
            if d <= cap:
                best = max(best, d)
            if n // d <= cap:
                best = max(best, n // d)
        d += 1
    return best


def memory_safe_fallback(numel: int, shape: Sequence[int] | None) -> int:
    """The coarse block of a piece the row rule does not cut (and the re-blocking cap).

    ``numel < 8`` gives 1; otherwise the larger of ``shape[-1]`` (when ``shape`` has at least
    two dimensions, ``shape[-1] >= 8`` and it divides ``numel``) and the largest divisor of
    ``numel`` not above :data:`FALLBACK_PERIOD_CAP` (when that is ``numel`` itself or at least
    :data:`MIN_ROW_PERIOD`); :data:`RAGGED_PERIOD` (ragged blocks) if neither.
    """
    if numel < MIN_BLOCK_PERIOD:
        return 1
    candidates = []
    if shape is not None and len(shape) >= 2 and shape[-1] >= MIN_BLOCK_PERIOD and numel % shape[-1] == 0:
        candidates.append(int(shape[-1]))
    capped = largest_divisor_at_most(numel, FALLBACK_PERIOD_CAP)
    if capped == numel or capped >= MIN_ROW_PERIOD:
        candidates.append(capped)
    return max(candidates) if candidates else RAGGED_PERIOD


def aligned_period(logical: int, offset: int, numel: int, local: int, total: int) -> int:
    """The period of a flattened element shard of ``numel`` elements at flat ``offset`` of a
    parameter of ``total`` elements: the parameter's own (``logical``) period when the piece
    starts and ends on its block boundaries, else the rule on the piece alone (``local``).
    The parameter's end is a block boundary too: the last piece of a parameter with ragged
    blocks keeps its shorter last block, as one process does."""
    starts = offset % logical == 0
    return logical if starts and (numel % logical == 0 or offset + numel == total) else local


def cuts(numel: int, period: int) -> bool:
    """Whether ``period`` cuts ``numel`` elements into blocks: it tiles them, or it is
    :data:`RAGGED_PERIOD` (the last block shorter)."""
    return period >= 1 and (numel % period == 0 or period == RAGGED_PERIOD)


def period_from_blocks(numel: int, blocks: int) -> int | None:
    """The period that cuts ``numel`` elements into ``blocks`` blocks: ``numel / blocks`` when
    that tiles, else :data:`RAGGED_PERIOD` when its ragged blocks number ``blocks``; ``None``
    when neither. Unique, because ragged blocks are chosen only for a piece with no divisor in
    ``[MIN_ROW_PERIOD, RAGGED_PERIOD]``, and a tiling ``numel / blocks`` with
    ``blocks = ceil(numel / RAGGED_PERIOD) >= 2`` would be such a divisor."""
    if blocks < 1:
        return None
    if numel % blocks == 0:
        return numel // blocks
    return RAGGED_PERIOD if block_count(numel, RAGGED_PERIOD) == blocks else None


def shape_period(shape: Sequence[int], local_numel: int) -> int:
    """The period of a piece of ``local_numel`` elements of a parameter of global ``shape`` (module docstring)."""
    if local_numel <= 1:
        return 1
    if len(shape) >= 2:
        row = math.prod(int(d) for d in shape[1:])
        period = largest_divisor_at_most(row, FALLBACK_PERIOD_CAP) if row else 1
        if period < MIN_ROW_PERIOD:
            period = row
        if period >= 1 and local_numel % period == 0:
            return period
    return memory_safe_fallback(local_numel, None)


@dataclass(frozen=True, slots=True)
class PeriodPolicy:
    """The user's period overrides for one parameter group.

    Checked in order: ``force_1d_period_one`` for 1-D parameters, ``force_2d_period_one``
    for 2-D parameters, then any of ``period_one_substrings`` occurring (case-insensitive)
    in the parameter's name; otherwise :func:`shape_period`.
    """

    force_1d_period_one: bool = False
    force_2d_period_one: bool = False
    period_one_substrings: tuple[str, ...] = ()

    def forces_period_one(self, name: str | None, ndim: int) -> bool:
        if self.force_1d_period_one and ndim == 1:
            return True
        if self.force_2d_period_one and ndim == 2:
            return True
        if name is not None and self.period_one_substrings:
            lowered = name.lower()
            return any(s.lower() in lowered for s in self.period_one_substrings)
        return False

    def resolve(self, name: str | None, shape: Sequence[int], local_numel: int, *, row_sharded: bool = False) -> int:
        """The period of a piece of ``local_numel`` elements of a parameter of global ``shape``
        (``row_sharded``: a ``Shard(0)`` DTensor's local rows, see the module docstring)."""
        if self.forces_period_one(name, len(shape)):
            return 1
        if row_sharded:
            return shape_period(shape, math.prod(int(d) for d in shape)) if len(shape) >= 2 else 1
        if local_numel <= 1:
            return 1
        return shape_period(shape, local_numel)


def period_policy(options: Mapping[str, Any]) -> PeriodPolicy:
    """The period overrides of normalised group options."""
    return PeriodPolicy(
        bool(options["force_1d_period_one"]),
        bool(options["force_2d_period_one"]),
        tuple(options["period_one_substrings"]),
    )

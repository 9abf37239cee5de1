"""Re-blocking: compress a dense momentum (and block second moment) for a target piece.

When state arrives in dense, topology-neutral form (a portable document, a DCP checkpoint
resharded onto other ranks), each target piece chooses its own period ``P``, then
``magnitude_b = max |m|`` over each block, ``indices = nearest codeword of m / magnitude``
and, on the block path, ``vmean_b = mean of v`` over the block (float64, rounded once).

The period rule (:func:`choose_period`), for a piece of ``L`` elements:

1. **Forced or tiny**: the group's period-one override, or ``L < 8``: ``P = 1``.
2. **Exact structure**: the source's blocks are recovered from the data. A block second
   moment is constant on each source block, so every source boundary inside the piece is
   a multiple of ``S = gcd(L, positions where v changes)``; without one ``S = L``. The
   candidates are the divisors of ``S`` of at least 8 that do not exceed the memory-safe
   fallback period ``F`` (:func:`gefen_core.periods.memory_safe_fallback`), largest first.
   With a codebook (a portable document carries the source's), the first candidate at
   which the momentum re-encodes **bit for bit** wins: when the target piece's blocks are
   the source's, that is the source period, so momentum, second moment and every later
   step are exact. Without a codebook (a source that never learned one), the largest
   candidate wins when the source was block-shaped
   (``v`` stays exact: target blocks lie inside constant runs), else ``F``.
3. **Re-inference**: otherwise the period a fresh optimizer would choose for the piece
   (:func:`gefen_core.periods.shape_period` through the group's
   :class:`~gefen_core.periods.PeriodPolicy`); candidates between ``F`` and that period are tried for
   exactness first, then ragged blocks of ``F`` when ``F`` does not tile the piece
   (:data:`gefen_core.periods.RAGGED_PERIOD`; ``v`` exact when every change of the source's ``v``
   falls on their boundaries), and a block-shaped source keeps the largest candidate below
   ``max(F, P)`` so ``v`` stays exact.

Capping candidates at ``F`` keeps a region that carries no information (an embedding's
never-seen rows: zero momentum, zero ``v``) from collapsing into one huge block.

Errors: exact (bit for bit) when the target blocks are the source's; ``v`` exact whenever
the target blocks lie inside constant runs of a block second moment (refinements and
unions of equal blocks); otherwise ``v`` is the block mean of the dense field and the
momentum is re-quantised: the README states the measured figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from gefen_contracts.torch_support import block_count

from .momentum_codec import dequantize, nearest_codeword, normalize_blocks
from .periods import MIN_BLOCK_PERIOD, cuts, memory_safe_fallback

__all__ = [
    "ENCODE_CHUNK_ELEMENTS",
    "TRIAL_FIRST_CHUNK_ELEMENTS",
    "PeriodChoice",
    "block_means",
    "choose_period",
    "constant_run_gcd",
    "encode_momentum",
    "exact_encoding",
    "period_divisors",
    "reencodes_exactly",
    "source_encoding",
]

#: Elements per encoding chunk (whole blocks; at least one block).
ENCODE_CHUNK_ELEMENTS = 1 << 20
#: Elements of an exactness trial's first chunk: a period that is not the source's fails
#: there, so trying a candidate costs a small prefix instead of a whole chunk.
TRIAL_FIRST_CHUNK_ELEMENTS = 1 << 14


@dataclass(frozen=True, slots=True)
class PeriodChoice:
    """A target piece's period and what is known about its exactness.

    ``momentum_exact``: the momentum re-encodes bit for bit at ``period`` (only ever true
    when a codebook was given). ``second_moment_exact``: each target block lies inside a
    constant run of the source's block second moment, so the block mean is exact. ``rule``
    names the step of the module's rule that decided (``"empty"``, ``"period_one"``,
    ``"exact"``, ``"structure"``, ``"fallback"``, ``"reinferred"``).
    """

    period: int
    momentum_exact: bool
    second_moment_exact: bool
    rule: str
    #: ``(indices, magnitude)`` of the momentum at ``period`` when the exactness trial made them
    #: (rule ``"exact"``), so the import does not encode the momentum a second time.
    encoding: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)


def period_divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (``n`` included), descending."""
    if n < 1:
        return []
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return sorted(small + large, reverse=True)


def constant_run_gcd(values: torch.Tensor) -> int:
    """``gcd(L, every position i where values[i] != values[i - 1])`` of a flat field (``L`` when constant).

    A field that is constant on the blocks of some partition aligned at 0 changes only at
    multiples of its block length, so that length divides the result.
    """
    numel = values.numel()
    return max(numel, 1) if numel <= 1 else math.gcd(numel, change_gcd(values))


def change_gcd(values: torch.Tensor) -> int:
    """``gcd`` of every position ``i`` where a flat field changes (``values[i] != values[i - 1]``);
    0 when it is constant. Blocks of ``P`` from 0 (the last one possibly ragged) lie inside its
    constant runs exactly when ``P`` divides it."""
    flat = values.reshape(-1)
    numel = flat.numel()
    result = 0
    step = ENCODE_CHUNK_ELEMENTS
    for lo in range(1, numel, step):
        hi = min(numel, lo + step)
        changed = torch.nonzero(flat[lo:hi] != flat[lo - 1 : hi - 1]).reshape(-1)
        if changed.numel():
            positions = (changed + lo).cpu().numpy()
            result = math.gcd(result, int(np.gcd.reduce(positions)))
            if result == 1:
                break
    return result


def _block_chunks(numel: int, period: int, first_elements: int = ENCODE_CHUNK_ELEMENTS) -> Iterable[tuple[int, int]]:
    """``(first_block, last_block)`` ranges of blocks (one at least; the last block may be
    ragged): the first of at most ``first_elements`` elements, the others of at most
    :data:`ENCODE_CHUNK_ELEMENTS`."""
    blocks = block_count(numel, period)
    first, size = 0, max(1, first_elements // period)
    while first < blocks:
        last = min(blocks, first + size)
        yield first, last
        first, size = last, max(1, ENCODE_CHUNK_ELEMENTS // period)


def _rows(flat: torch.Tensor, first: int, last: int, period: int, *, edge: bool = False) -> tuple[torch.Tensor, int]:
    """``(rows [last - first, period], valid)``: blocks ``first..last`` of ``flat`` and how many
    of the rows' elements are real. A ragged last row is padded with 0, or with ``edge`` its last
    real element (which changes neither a block's maximum nor its constancy)."""
    part = flat[first * period : last * period]
    padding = (last - first) * period - part.numel()
    if padding:
        fill = part[-1:].expand(padding) if edge else part.new_zeros(padding)
        part = torch.cat([part, fill])
    return part.view(-1, period), (last - first) * period - padding


def _encode(
    flat: torch.Tensor, period: int, codebook: torch.Tensor, target: torch.device, *, exact: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Nearest-codeword codes of ``flat`` at ``period`` on ``target`` (a ragged last block's
    padding codes 0); with ``exact``, ``None`` as soon as a chunk does not decode back to equal
    values (the first chunk small, so a wrong period is rejected cheaply)."""
    blocks = block_count(flat.numel(), period)
    indices = torch.empty(blocks, period, dtype=torch.uint8, device=target)
    magnitude = torch.empty(blocks, 1, dtype=torch.float32, device=target)
    table = codebook.to(device=target, dtype=torch.float32)
    head = TRIAL_FIRST_CHUNK_ELEMENTS if exact else ENCODE_CHUNK_ELEMENTS
    for first, last in _block_chunks(flat.numel(), period, head):
        rows, valid = _rows(flat, first, last, period)
        rows = rows.to(device=target, dtype=torch.float32)
        scale, z = normalize_blocks(rows)  # zero padding changes no block's maximum
        codes = nearest_codeword(table, z)
        codes.view(-1)[valid:] = 0
        if exact and not torch.equal(dequantize(table, codes, scale).view(-1)[:valid], rows.view(-1)[:valid]):
            return None
        indices[first:last] = codes
        magnitude[first:last] = scale
    return indices, magnitude


def exact_encoding(
    momentum: torch.Tensor, period: int, codebook: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(indices uint8 [B, P], magnitude fp32 [B, 1])`` of the fp32 ``momentum`` at ``period``
    (as :func:`encode_momentum` makes them, on the momentum's device) when they decode back to
    equal values, else ``None``. Values are compared with ``==`` (so ``-0.0 == 0.0``)."""
    flat = momentum.reshape(-1)
    if not cuts(flat.numel(), period):
        return None
    return _encode(flat, period, codebook, flat.device, exact=True)


def source_encoding(
    codes: torch.Tensor, scale: torch.Tensor, period: int, codebook: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The source's own ``(indices [B, P], magnitude [B, 1])`` at ``period`` when re-encoding
    ``codebook[codes] * scale`` there would give them back, else ``None``; no search.

    ``codes`` (uint8) and ``scale`` (fp32) are flat, one per element (a portable import's
    expanded block scales). It holds when the scale is constant on every target block and,
    where it is not 0, the block's largest ``|codebook[code]|`` is 1 (the source normalised
    by that element, so the block maximum is the scale and each value decodes to its own
    code). Checked chunk by chunk, the first chunk small, so a wrong period costs a prefix.
    """
    numel = codes.numel()
    if not cuts(numel, period) or scale.numel() != numel:
        return None
    blocks = block_count(numel, period)
    table = codebook.to(device=codes.device, dtype=torch.float32).abs()
    indices = torch.empty(blocks, period, dtype=torch.uint8, device=codes.device)
    magnitude = torch.empty(blocks, 1, dtype=torch.float32, device=codes.device)
    for first, last in _block_chunks(numel, period, TRIAL_FIRST_CHUNK_ELEMENTS):
        rows, valid = _rows(scale, first, last, period, edge=True)
        head = rows[:, :1]
        if not bool((rows == head).all()):
            return None
        q, _ = _rows(codes, first, last, period, edge=True)
        top = table.index_select(0, q.reshape(-1).to(torch.int32)).view(-1, period).amax(dim=1, keepdim=True)
        if not bool(((top == 1.0) | (head == 0.0)).all()):
            return None
        indices[first:last] = q
        indices[first:last].view(-1)[valid:] = 0  # a ragged block's padding codes 0
        magnitude[first:last] = head
    return indices, magnitude


def reencodes_exactly(momentum: torch.Tensor, period: int, codebook: torch.Tensor) -> bool:
    """Whether encoding ``momentum`` at ``period`` with ``codebook`` decodes back to equal values
    (:func:`exact_encoding`, the codes discarded)."""
    return exact_encoding(momentum, period, codebook) is not None


def encode_momentum(
    momentum: torch.Tensor, period: int, codebook: torch.Tensor, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices uint8 [B, P], magnitude fp32 [B, 1])`` on ``device``: nearest-codeword encoding
    of a dense momentum at ``period`` (each block's scale is its max ``|m|``)."""
    flat = momentum.reshape(-1)
    if not cuts(flat.numel(), period):
        raise ValueError(f"period {period} does not divide {flat.numel()} elements")
    encoded = _encode(flat, period, codebook, torch.device(device), exact=False)
    assert encoded is not None
    return encoded


def block_means(values: torch.Tensor, period: int, device: torch.device | str) -> torch.Tensor:
    """Per-block float64 means of a dense field, rounded once to fp32 ``[B, 1]`` on ``device``
    (exact for a block that is constant)."""
    flat = values.reshape(-1)
    numel = flat.numel()
    if not cuts(numel, period):
        raise ValueError(f"period {period} does not divide {numel} elements")
    blocks = block_count(numel, period)
    out = torch.empty(blocks, 1, dtype=torch.float32, device=torch.device(device))
    for first, last in _block_chunks(numel, period):
        rows, valid = _rows(flat, first, last, period)
        rows = rows.to(torch.float64)
        counts = torch.full((last - first, 1), float(period), dtype=torch.float64, device=rows.device)
        counts[-1] = float(valid - (last - first - 1) * period)  # a ragged last block: its own length
        out[first:last] = (rows.sum(dim=1, keepdim=True) / counts).to(torch.float32)
    return out


def choose_period(
    momentum: torch.Tensor,
    *,
    shape: Sequence[int],
    second_moment: torch.Tensor | None,
    codebook: torch.Tensor | None,
    forced_one: bool,
    reinfer: Callable[[], int],
    source: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PeriodChoice:
    """The target piece's period by the module's rule.

    ``momentum`` is the piece's dense momentum (flat order = the piece's row-major order);
    ``shape`` the shape the optimizer's period rule sees for the piece (a DTensor's global
    shape, else the local one); ``second_moment`` the dense *block* second moment when the
    source kept one (``None`` for factored sources and GefenMuon); ``codebook`` the source's
    codebook when it is kept; ``reinfer()`` computes the period a fresh optimizer would
    choose (called only when needed); ``source`` the flat ``(codes, scale)`` the momentum was
    decoded from, when known: each exactness trial is then :func:`source_encoding` (no
    codeword search; a wrong period fails on a small prefix). Its verdict is the search's
    wherever the target blocks lie inside source blocks (the source normalised each block by
    its largest element, so it decodes to the scale), and blocks whose scale is 0 keep the
    source's codes (any code decodes them to 0).
    """
    numel = momentum.numel()

    def exact(period: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        assert codebook is not None
        if source is not None:
            return source_encoding(source[0], source[1], period, codebook)
        return exact_encoding(momentum, period, codebook)

    if numel == 0:
        return PeriodChoice(1, True, True, "empty")
    if forced_one or numel < MIN_BLOCK_PERIOD:
        return PeriodChoice(1, codebook is not None, True, "period_one")
    block_source = second_moment is not None
    changes = change_gcd(second_moment) if second_moment is not None else 0
    structure = math.gcd(numel, changes)
    divisors = [d for d in period_divisors(structure) if d >= MIN_BLOCK_PERIOD]
    fallback = memory_safe_fallback(numel, tuple(shape))
    low = [d for d in divisors if d <= fallback]
    # ragged blocks (a fallback that does not tile the piece) are the last candidate, after every
    # divisor; their second moment is exact when the source's changes fall on their boundaries
    ragged = [fallback] if numel % fallback else []
    ragged_v_exact = bool(ragged) and changes % fallback == 0
    if codebook is not None:
        for period in low:
            encoded = exact(period)
            if encoded is not None:
                return PeriodChoice(period, True, block_source, "exact", encoded)
    elif block_source and low:
        return PeriodChoice(low[0], False, True, "structure")
    elif not block_source:
        return PeriodChoice(fallback, False, False, "fallback")
    searched = reinfer()
    high = [d for d in divisors if fallback < d <= searched]
    if codebook is not None:
        for period in high + ragged:
            encoded = exact(period)
            if encoded is not None:
                v_exact = block_source and (period in high or ragged_v_exact)
                return PeriodChoice(period, True, v_exact, "exact", encoded)
    if block_source and (low or high):
        return PeriodChoice(max(low + high), False, True, "structure")
    if block_source and ragged_v_exact:
        return PeriodChoice(fallback, False, True, "structure")
    return PeriodChoice(searched, False, False, "reinferred")

"""The first-moment codec: block-scaled codewords from one shared 256-entry codebook.

A momentum block ``u`` (``P`` fp32 values) is stored as its scale ``M = max |u|`` (fp32) and
one uint8 index per element into the codebook ``C`` (fp32, ascending, ``C[0] = -1``,
``C[255] = +1``). Decoding is ``C[q] * M``. Everything here is fp32 and elementwise, so
CPU and GPU give bit-identical results:

* ``z = u / M`` (correctly rounded division; ``z = 0`` for a block with ``M == 0``);
* nearest: ``k = lower_bound(C, z)`` (first ``C[k] >= z``, found through a bucket table:
  see :func:`lower_bound`), ``L = max(k - 1, 0)``,
  ``R = min(k, 255)``; choose ``L`` when ``|z - C[L]| <= |z - C[R]|`` (ties: lower index);
* stochastic: same bracket; ``p_up = (clamp(z, C[L], C[R]) - C[L]) / (C[R] - C[L])`` (0 when
  ``C[R] == C[L]``); choose ``R`` when ``U(seed, index) < p_up``, so ``E[C[q]] = z``.

``U`` is a counter-based SplitMix64-style hash (no generator state, identical on every
device) of a 64-bit ``seed`` and the element's flat ``index``::

    z = seed + 0x9E3779B97F4A7C15 * (index + 1)       (mod 2**64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9          (mod 2**64)
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB          (mod 2**64)
    z =  z ^ (z >> 31)
    U = (z >> 40) * 2**-24                            (24-bit uniform in [0, 1))

Shifts are logical. The optimizer derives ``seed = global_step * 2**32 + slot`` (``slot`` is
the parameter's position in ``param_groups`` order), so different parameters draw
different streams (the reference reused one stream for every tensor of a step).
:func:`stochastic_seed` computes it; for a piece of a parameter whose first element has flat
index ``f`` it adds ``0x9E3779B97F4A7C15 * f``, so the piece's element ``i`` draws exactly the
uniform of the whole parameter's element ``f + i``.
"""

from __future__ import annotations

import torch

__all__ = [
    "CODEBOOK_SIZE",
    "LOOKUP_BUCKETS",
    "bucket_occupancy_ok",
    "lower_bound",
    "dequantize",
    "nearest_codeword",
    "normalize_blocks",
    "splitmix_uniform",
    "stochastic_codeword",
    "stochastic_seed",
]

CODEBOOK_SIZE = 256
#: Buckets of the lower-bound lookup table on ``[-1, 1]`` (width 2 / 4096, the histogram's bins).
LOOKUP_BUCKETS = 4096
_PER_BUCKET = 2

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 bit pattern of an unsigned 64-bit constant."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _logical_shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix_uniform(seed: torch.Tensor | int, index: torch.Tensor) -> torch.Tensor:
    """24-bit uniforms in ``[0, 1)`` as fp32, one per element of ``index`` (int64).

    ``seed`` is an int (host) or an int64 tensor broadcastable to ``index`` (device, for
    capturable steps). Wrapping int64 arithmetic reproduces the unsigned hash bit for bit.
    """
    if index.dtype is not torch.int64:
        raise TypeError(f"splitmix_uniform: index must be int64, got {index.dtype}")
    if isinstance(seed, torch.Tensor):
        if seed.dtype is not torch.int64:
            raise TypeError(f"splitmix_uniform: seed must be int64, got {seed.dtype}")
        base = seed
    else:
        base = torch.tensor(_signed(seed % (1 << 64)), dtype=torch.int64, device=index.device)
    z = base + (index + 1) * _signed(_GOLDEN)
    z = (z ^ _logical_shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _logical_shift_right(z, 27)) * _signed(_MIX2)
    z = z ^ _logical_shift_right(z, 31)
    return _logical_shift_right(z, 40).to(torch.float32) * (2.0**-24)


def stochastic_seed(global_step: int, slot: int, first_index: int = 0) -> int:
    """The int64 seed of parameter ``slot`` at ``global_step`` for a piece starting at ``first_index``."""
    return _signed((global_step * (1 << 32) + slot + _GOLDEN * first_index) % (1 << 64))


def normalize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale ``M = max |u|`` (``[rows, 1]``) and ``z = u / M`` (0 where ``M == 0``)."""
    magnitude = blocks.abs().amax(dim=1, keepdim=True)
    safe = torch.where(magnitude > 0, magnitude, torch.ones_like(magnitude))
    return magnitude, blocks / safe


def _gather(codebook: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``codebook[indices]`` for int32/uint8/int64 indices of any shape (int32 is cheapest)."""
    flat = indices.reshape(-1)
    if flat.dtype is not torch.int32 and flat.dtype is not torch.int64:
        flat = flat.to(torch.int32)
    return codebook.index_select(0, flat).view(indices.shape)


def _buckets(values: torch.Tensor) -> torch.Tensor:
    """``clamp(floor(fl(v + 1) * 2048), 0, 4095)`` as int32 (``v >= -1``: truncation is floor)."""
    return ((values + 1.0) * float(LOOKUP_BUCKETS // 2)).to(torch.int32).clamp_(0, LOOKUP_BUCKETS - 1)


def bucket_occupancy_ok(codebook: torch.Tensor) -> bool:
    """The lookup precondition: no bucket holds more than two codewords below +1."""
    below = codebook[codebook < 1.0]
    if below.numel() == 0:
        return True
    counts = torch.bincount(_buckets(below).to(torch.int64), minlength=LOOKUP_BUCKETS)
    return bool(counts.max() <= _PER_BUCKET)


def lower_bound(codebook: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """First index ``k`` with ``codebook[k] >= z`` (int32), for ``z`` in ``[-1, 1]``.

    Equal to a binary search, but through a 4097-entry bucket table: codewords in lower
    buckets are below ``z``, codewords in higher buckets above it, and within ``z``'s own
    bucket at most two codewords can be below ``z`` (:func:`bucket_occupancy_ok`, which every
    learned or loaded codebook satisfies), so two comparisons finish the search.
    """
    table = torch.searchsorted(
        _buckets(codebook),
        torch.arange(LOOKUP_BUCKETS + 1, dtype=torch.int32, device=codebook.device),
        out_int32=True,
    )
    last = codebook.numel() - 1
    bucket = _buckets(z).reshape(-1)
    start = table.index_select(0, bucket)
    stop = table.index_select(0, bucket + 1)
    flat = z.reshape(-1)
    result = start.clone()
    for offset in range(_PER_BUCKET):
        candidate = start + offset
        value = codebook.index_select(0, candidate.clamp(max=last))
        result += ((candidate < stop) & (value < flat)).to(torch.int32)
    return result.view(z.shape)


def _bracket(codebook: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    upper = lower_bound(codebook, z)
    last = codebook.numel() - 1
    lower = (upper - 1).clamp_(min=0)
    upper = upper.clamp_(max=last)
    return lower, upper


def nearest_codeword(codebook: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the codeword nearest to each ``z`` (ties: lower index)."""
    lower, upper = _bracket(codebook, z)
    below = (z - _gather(codebook, lower)).abs()
    above = (z - _gather(codebook, upper)).abs()
    return torch.where(below <= above, lower, upper).to(torch.uint8)


def stochastic_codeword(
    codebook: torch.Tensor, z: torch.Tensor, seed: torch.Tensor | int, first_index: int
) -> torch.Tensor:
    """Unbiased stochastic rounding of ``z`` onto the codebook (uint8).

    ``first_index`` is the flat index of ``z``'s first element in its parameter; elements
    are numbered row-major from there.
    """
    lower, upper = _bracket(codebook, z)
    lo = _gather(codebook, lower)
    hi = _gather(codebook, upper)
    width = hi - lo
    clamped = torch.minimum(torch.maximum(z, lo), hi)
    up = torch.where(width > 0, (clamped - lo) / torch.where(width > 0, width, torch.ones_like(width)), 0.0)
    index = torch.arange(first_index, first_index + z.numel(), dtype=torch.int64, device=z.device).view(z.shape)
    draw = splitmix_uniform(seed, index)
    return torch.where(draw < up, upper, lower).to(torch.uint8)


def dequantize(codebook: torch.Tensor, indices: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``C[q] * M`` in fp32 (``indices`` ``[rows, P]`` uint8, ``magnitude`` ``[rows, 1]``)."""
    return _gather(codebook, indices) * magnitude

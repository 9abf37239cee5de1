# mypy: disable-error-code="no-untyped-def,untyped-decorator,no-any-return"
"""Triton device functions every kernel family shares (the step kernels of
:mod:`gefen_kernels.triton_kernels`, the statistics of :mod:`gefen_kernels.triton_statistics`,
GefenMuon's momentum of :mod:`gefen_kernels.triton_muon`): the SplitMix64 uniform of
stochastic rounding, element loads and stores (bf16 through its uint16 bits) and bf16's exact
widening to fp32, rounding to a parameter's dtype, the codeword search, and a list launch's lookup of the entry a program
serves. Numerics as in :mod:`gefen_kernels.triton_kernels`.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

# ruff: noqa: N803, PLR0124  (constexpr parameters are upper case; x != x is the NaN test in Triton)

# A compiled kernel reads only module globals that are tl.constexpr (the interpreter reads any):
# test_kernels_triton_parity.py checks what every kernel reads (a plain int ran on CPU, not on an H200).
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _uniform(seed, index):
    """SplitMix64-style uniform in [0, 1) from uint64 ``seed`` and ``index`` (24-bit resolution)."""
    z = seed + (index + 1) * _GOLDEN
    z = (z ^ (z >> 30)) * _MIX1
    z = (z ^ (z >> 27)) * _MIX2
    z = z ^ (z >> 31)
    return (z >> 40).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _load_value(ptr, offs, mask):
    """A parameter or gradient element in its dtype. The list kernel reaches a bf16 tensor
    through the uint16 pointer of its bits (Triton's interpreter reads a bf16 tensor at a raw
    address wrong, and the bits are the same on a GPU): those are bitcast back."""
    x = tl.load(ptr + offs, mask=mask, other=0)
    if tl.constexpr(x.dtype == tl.uint16):
        x = x.to(tl.bfloat16, bitcast=True)
    return x


@triton.jit
def _widen(x):
    """bf16 ``x`` as fp32 by shifting its bits, exactly (Triton 3.9's interpreter converts bf16
    subnormals to fp32 wrongly, some to 0; a GPU shifts the same bits); any other dtype as it is."""
    if tl.constexpr(x.dtype == tl.bfloat16):
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x


@triton.jit
def _store_value(ptr, offs, x, mask):
    """Store a parameter element (bf16 as its bits where the pointer is uint16, see :func:`_load_value`)."""
    if tl.constexpr(ptr.dtype.element_ty == tl.uint16):
        x = x.to(tl.uint16, bitcast=True)
    tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _requantize(u, g, m, m_new, safe, cb_ptr, mask, flat, seed, STOCHASTIC: tl.constexpr):
    """New codes and their decoded momentum C[q'] * M' for momentum u of a block with scale m_new
    (g: the gradient, m: the old momentum C[q] * M; nearest rounding settles a zero-gradient
    element whose momentum failed to decay, as ``gefen_core.reference_ops.requantized_momentum``)."""
    z = tl.math.div_rn(u, safe)
    k = tl.zeros(z.shape, dtype=tl.int32)
    for shift in tl.static_range(8):
        step = 128 >> shift
        probe = tl.load(cb_ptr + (k + step - 1), mask=mask, other=2.0)
        k = tl.where(probe < z, k + step, k)
    top = tl.load(cb_ptr + 255)
    k = tl.where(top < z, 256, k)
    lo = tl.maximum(k - 1, 0)
    hi = tl.minimum(k, 255)
    clo = tl.load(cb_ptr + lo, mask=mask, other=0.0)
    chi = tl.load(cb_ptr + hi, mask=mask, other=0.0)
    if STOCHASTIC:
        width = chi - clo
        clamped = tl.minimum(tl.maximum(z, clo), chi)
        up = tl.math.div_rn(clamped - clo, tl.where(width > 0.0, width, 1.0))
        up = tl.where(width > 0.0, up, 0.0)
        take_hi = _uniform(seed, flat.to(tl.uint64)) < up
    else:
        take_hi = tl.abs(z - clo) > tl.abs(z - chi)
    code = tl.where(take_hi, hi, lo)
    c = tl.where(take_hi, chi, clo)
    value = c * m_new
    if not STOCHASTIC:
        stuck = (g == 0.0) & (m != 0.0) & (tl.abs(value) >= tl.abs(m))  # (so c != 0)
        code = tl.where(stuck, tl.where(c > 0.0, code - 1, code + 1), code)
        value = tl.where(stuck, tl.load(cb_ptr + code, mask=mask & stuck, other=0.0) * m_new, value)
    return code, value


@triton.jit
def _to_param_dtype(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to the parameter dtype to nearest even; bf16 by explicit bit arithmetic
    (the same on every backend, the interpreter included)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _entry_of(starts_ptr, entries, pid, SEARCH: tl.constexpr):
    """The entry whose programs hold ``pid`` (``starts``: each entry's first program, ascending,
    then the total) and ``pid``'s index among them, by ``SEARCH`` halvings."""
    lo = pid * 0
    hi = lo + entries
    for _ in tl.static_range(SEARCH):  # keeps starts[lo] <= pid < starts[hi]
        mid = (lo + hi) // 2
        below = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo, pid - tl.load(starts_ptr + lo)


@triton.jit
def uniform_kernel(seed_ptr, index_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    index = tl.load(index_ptr + offs, mask=mask, other=0)
    seed = tl.load(seed_ptr).to(tl.uint64)
    tl.store(out_ptr + offs, _uniform(seed, index.to(tl.uint64)), mask=mask)

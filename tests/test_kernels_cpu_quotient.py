"""The CPU kernel's division-free quotient z = u / a at the edges of its proof.

The AVX-512 requantisation computes ``fl(u / a)`` with Markstein's correction instead of a
vector division (gefen_cpu.c, ``quotient_avx512``); that is exact while nothing underflows,
so block scales outside ``[2^-100, 2^100]`` take the division and lanes whose ``|u|`` or
quotient is tiny are recomputed with it. These cases put blocks on both sides of each of
those limits and demand the reference's codes and parameters bit for bit. (For a tiny
block scale the two guards overlap: every lane of such a block is also a tiny-``|u|`` lane;
removing both makes the 1e-38 and subnormal-midpoint cases fail.)
"""

from __future__ import annotations

import pytest
import torch
from gefen_kernels import cpu_kernel_status, cpu_ops
from kernels_parity_helpers import compare_block_step, random_state, shared_codebook

#: Gradient and block-scale magnitudes: inside the no-division range and beyond both ends.
SCALES = [1e-38, 1e-33, 1e-29, 1e-12, 1.0, 1e25, 1e33, 1e37]


@pytest.fixture(autouse=True, scope="module")
def compiled_kernel() -> None:
    status = cpu_kernel_status()
    assert status.available, status.reason


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"{s:g}")
def test_quotient_is_exact_at_every_block_scale(scale: float) -> None:
    torch.manual_seed(7)
    blocks, period = 8, 512
    grad = torch.randn(blocks * period) * scale
    state = random_state((blocks * period,), period, torch.float32, "cpu", factored=False)
    state.magnitude.mul_(scale)
    compare_block_step(
        cpu_ops.block_step,
        state,
        grad,
        shared_codebook(),
        steps=2,
        weight_decay=0.0,
        maximize=False,
        sr_seed=None,
        exact=True,
    )


def test_quotient_is_exact_when_lanes_underflow() -> None:
    """Log-uniform magnitudes from 1e-45 to 1: quotients down into the subnormals, and
    ``|u|`` below 2^-100 next to lanes near the block maximum, in every vector."""
    torch.manual_seed(11)
    blocks, period = 16, 256
    exponents = torch.empty(blocks * period).uniform_(-45.0, 0.0)
    grad = torch.randn(blocks * period).sign() * torch.pow(10.0, exponents)
    grad[::period] = 1.0  # every block's scale stays near 1
    state = random_state((blocks * period,), period, torch.float32, "cpu", factored=False)
    state.magnitude.zero_()  # u = g (1 - beta1) exactly as chosen
    compare_block_step(
        cpu_ops.block_step,
        state,
        grad,
        shared_codebook(),
        steps=1,
        weight_decay=0.0,
        maximize=False,
        sr_seed=None,
        exact=True,
    )
    assert cpu_ops.nearest_rounding_path(shared_codebook()) == "thresholds"


def _near_every_threshold(codebook: torch.Tensor, scale: float, period: int) -> torch.Tensor:
    """A block whose momentum u = fl(g * (1 - beta1)) has its maximum near ``scale`` and,
    for every pair of neighbouring codewords, seven gradients one float apart whose quotient
    u / max|u| lands on the pair's decision midpoint (so a one-ulp error changes a code)."""
    midpoints = (codebook[:-1] + codebook[1:]) / 2
    centre = (midpoints.double() * scale / 0.1).float()
    steps = torch.arange(-3, 4, dtype=torch.float32)
    near = centre[:, None] + steps[None, :] * torch.finfo(torch.float32).eps * centre.abs()[:, None]
    block = torch.zeros(period)
    block[0] = scale / 0.1
    block[1 : 1 + near.numel()] = near.reshape(-1)
    return block


@pytest.mark.parametrize("scale", [1.37 * 2.0**-127, 1.37 * 2.0**-95, 1.37, 1.37 * 2.0**110], ids=str)
def test_quotient_is_exact_on_every_decision_midpoint(scale: float) -> None:
    """Blocks below the no-division range (subnormal u), inside it with lanes under 2^-100
    (the guarded lanes), in the middle, and above it."""
    period = 2048
    codebook = shared_codebook()
    grad = _near_every_threshold(codebook, scale, period)
    state = random_state((period,), period, torch.float32, "cpu", factored=False)
    state.magnitude.zero_()
    compare_block_step(
        cpu_ops.block_step,
        state,
        grad,
        codebook,
        steps=1,
        weight_decay=0.0,
        maximize=False,
        sr_seed=None,
        exact=True,
    )

"""The CPU kernel's nearest-codeword threshold table against the reference rule, value by value.

The kernel rounds through a table of decision thresholds when the codebook allows it and
through the reference's bucket search otherwise; both must give the reference's codes bit
for bit, at and around every decision boundary (where a float-rounding slip would show).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from gefen_core import step_scalars
from gefen_core.momentum_codec import bucket_occupancy_ok, nearest_codeword
from gefen_kernels import cpu_kernel_status, cpu_ops
from kernels_parity_helpers import shared_codebook

#: Floats examined on each side of every codeword and every midpoint between neighbours.
_NEIGHBOURS = 6


@pytest.fixture(autouse=True, scope="module")
def compiled_kernel() -> Iterator[None]:
    status = cpu_kernel_status()
    assert status.available, status.reason
    yield


def _floats_near(points: torch.Tensor, count: int) -> torch.Tensor:
    """Every fp32 within ``count`` ulps of each point (ordered-integer steps), clipped to [-1, 1]."""
    bits = points.to(torch.float32).view(torch.int32).to(torch.int64)
    keys = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    steps = torch.arange(-count, count + 1, dtype=torch.int64)
    near = (keys[:, None] + steps[None, :]).reshape(-1)
    as_bits = torch.where(near < 0, (-near) | (1 << 31), near)
    values = as_bits.to(torch.int64).bitwise_and(0xFFFFFFFF)
    values = torch.where(values >= 1 << 31, values - (1 << 32), values).to(torch.int32).view(torch.float32)
    return values[(values >= -1.0) & (values <= 1.0)]


def _probe_values(codebook: torch.Tensor) -> torch.Tensor:
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    exact_mid = ((codebook[1:].double() + codebook[:-1].double()) / 2).float()
    generator = torch.Generator().manual_seed(11)
    spread = torch.rand(20000, generator=generator) * 2 - 1
    tiny = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8])
    return torch.cat(
        [
            _floats_near(codebook, _NEIGHBOURS),
            _floats_near(midpoints, _NEIGHBOURS),
            _floats_near(exact_mid, _NEIGHBOURS),
            spread,
            spread**7,
            tiny,
        ]
    )


def _kernel_codes(codebook: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The kernel's nearest codes of ``z``: one block per value with scale 1 and EMA weight 0.

    GefenMuon's momentum op with ``beta = 0`` stores ``u = g``; each block holds ``[1, z]``, so
    its scale is 1 and the quantiser sees ``z`` exactly. The old momentum (code 255, scale
    1e30) is larger than any new one, so the settling of a zero gradient's code never applies.
    """
    grad = torch.stack([torch.ones_like(z), z], dim=1).contiguous()
    indices = torch.full((z.numel(), 2), 255, dtype=torch.uint8)
    magnitude = torch.full((z.numel(), 1), 1e30)
    out = torch.empty_like(grad)
    packet = step_scalars.muon_scalars(torch.device("cpu"), 0.0)
    cpu_ops.muon_momentum(
        [grad], [indices], [magnitude], codebook, packet, None, [out], nesterov=False, deterministic=True
    )
    assert torch.equal(magnitude, torch.ones_like(magnitude))
    return indices[:, 1]


@pytest.mark.parametrize("kind", ["gaussian", "cubed"])
def test_learned_codebooks_take_the_threshold_table_and_match_the_reference(kind: str) -> None:
    codebook = shared_codebook(kind)
    assert cpu_ops.nearest_rounding_path(codebook) == "thresholds"
    z = _probe_values(codebook)
    assert torch.equal(_kernel_codes(codebook, z), nearest_codeword(codebook, z))


def test_a_uniform_codes_takes_the_threshold_table() -> None:
    codebook = torch.linspace(-1.0, 1.0, 256)
    assert cpu_ops.nearest_rounding_path(codebook) == "thresholds"
    z = _probe_values(codebook)
    assert torch.equal(_kernel_codes(codebook, z), nearest_codeword(codebook, z))


def _moved(offsets: list[float]) -> torch.Tensor:
    """A learned codebook with codewords 120.. moved to ``R + offsets``: ``R`` is the first
    boundary of the reference's 4096 lookup buckets above ``C[120]`` (kept sorted)."""
    codebook = shared_codebook().clone()
    boundary = math.floor((float(codebook[120]) + 1.0) * 2048 + 1) / 2048 - 1.0
    for i, offset in enumerate(offsets):
        codebook[120 + i] = boundary + offset
    assert bool((codebook[1:] >= codebook[:-1]).all())
    return codebook


@pytest.mark.parametrize(
    ("offsets", "precondition", "path"),
    [
        # three codewords within two fine buckets (two of them in one reference bucket): two
        # decision thresholds share a fine bucket, so the table cannot be used
        ([-1e-5, 5e-5, 1.5e-4], True, "bucket search"),
        # three codewords in one reference bucket: the reference's lookup precondition fails
        ([1e-5, 5e-5, 1.5e-4], False, "bucket search"),
        # a repeated codeword: the codes still rise one at a time, so the table holds
        ([0.0, 0.0], True, "thresholds"),
    ],
    ids=["thresholds-too-close", "crowded-bucket", "repeated"],
)
def test_any_codebook_gives_the_reference_codes(offsets: list[float], precondition: bool, path: str) -> None:
    codebook = _moved(offsets)
    assert bucket_occupancy_ok(codebook) is precondition
    assert cpu_ops.nearest_rounding_path(codebook) == path
    z = _probe_values(codebook)
    assert torch.equal(_kernel_codes(codebook, z), nearest_codeword(codebook, z))


def test_the_path_query_names_a_bad_codebook() -> None:
    with pytest.raises(cpu_ops.arguments.KernelArgumentError, match="codebook"):
        cpu_ops.nearest_rounding_path(torch.zeros(255))

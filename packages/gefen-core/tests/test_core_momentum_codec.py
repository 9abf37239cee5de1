"""Momentum codec: nearest and stochastic rounding, the SplitMix64 hash's golden values."""

from __future__ import annotations

import pytest
import torch
from gefen_core.momentum_codec import (
    dequantize,
    nearest_codeword,
    normalize_blocks,
    splitmix_uniform,
    stochastic_codeword,
)
from gefen_core.reference_ops import stochastic_uniform_reference
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)

# (seed, index) -> the top 24 bits of the hash; splitmix64(0)'s first output is 0xE220A8397B1DCDAF.
GOLDEN = {
    0: [14819496, 7239838, 443485, 2947631, 1177231],
    1: [9505325, 12512141, 16290722, 7823360, 9240495],
    (7 << 32) | 3: [16593460, 8343915, 13025804, 13005523, 8608456],
    (1 << 63) + 12345: [2838525, 3936835, 7308886, 4011608, 12210847],
}
INDICES = [0, 1, 2, 1000, 2**31 + 5]


def _python_hash(seed: int, index: int) -> int:
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 40


@pytest.mark.parametrize("seed", sorted(GOLDEN))
def test_splitmix_golden_values(seed: int) -> None:
    index = torch.tensor(INDICES, dtype=torch.int64)
    values = splitmix_uniform(seed, index)
    assert values.dtype is torch.float32
    assert [int(v * 2**24) for v in values.tolist()] == GOLDEN[seed]
    assert GOLDEN[seed] == [_python_hash(seed, i) for i in INDICES]
    signed = seed - (1 << 64) if seed >= 1 << 63 else seed
    as_tensor = stochastic_uniform_reference(torch.tensor([signed], dtype=torch.int64), index)
    assert torch.equal(as_tensor, values)


def test_splitmix_matches_python_on_many_indices() -> None:
    index = torch.arange(0, 5000, 7, dtype=torch.int64)
    got = (splitmix_uniform(123456789, index) * 2**24).to(torch.int64).tolist()
    assert got == [_python_hash(123456789, int(i)) for i in index]


def _codebook() -> torch.Tensor:
    inner = torch.linspace(-0.9, 0.9, 254)
    return torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])


def test_nearest_picks_the_closest_and_breaks_ties_low() -> None:
    codebook = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    z = torch.tensor([-1.0, -0.74, -0.75, -0.76, 0.0, 0.25, 0.26, 1.0, 0.99])
    assert nearest_codeword(codebook, z).tolist() == [0, 1, 0, 0, 2, 2, 3, 4, 4]


def test_block_maximum_is_exact_after_a_round_trip() -> None:
    torch.manual_seed(0)
    blocks = torch.randn(6, 32)
    magnitude, z = normalize_blocks(blocks)
    codes = nearest_codeword(_codebook(), z)
    decoded = dequantize(_codebook(), codes, magnitude)
    top = blocks.abs().argmax(dim=1)
    rows = torch.arange(6)
    assert torch.equal(decoded[rows, top], blocks[rows, top])
    half_gap = (_codebook()[1:] - _codebook()[:-1]).max() / 2
    assert bool(((decoded - blocks).abs() <= magnitude * half_gap * (1 + 1e-6)).all())


def test_zero_blocks_encode_to_zero() -> None:
    magnitude, z = normalize_blocks(torch.zeros(2, 4))
    assert torch.equal(magnitude, torch.zeros(2, 1)) and torch.equal(z, torch.zeros(2, 4))
    assert torch.equal(dequantize(_codebook(), nearest_codeword(_codebook(), z), magnitude), torch.zeros(2, 4))


def test_stochastic_rounding_is_unbiased_and_stays_in_the_bracket() -> None:
    codebook = _codebook()
    z = torch.full((200_000,), 0.123456)
    codes = stochastic_codeword(codebook, z, 42, 0)
    values = codebook[codes.long()]
    above = int(torch.searchsorted(codebook, torch.tensor([0.123456])).item())
    assert set(values.unique().tolist()) == {codebook[above - 1].item(), codebook[above].item()}
    assert abs(values.double().mean().item() - 0.123456) < 2e-5
    again = stochastic_codeword(codebook, z, 42, 0)
    assert torch.equal(codes, again)
    other = stochastic_codeword(codebook, z, 43, 0)
    assert not torch.equal(codes, other)


def test_stochastic_rounding_keeps_codewords_exact() -> None:
    codebook = _codebook()
    z = codebook.clone()
    assert torch.equal(codebook[stochastic_codeword(codebook, z, 5, 0).long()], codebook)


def test_lookup_lower_bound_equals_binary_search() -> None:
    from gefen_core.codebook import codebook_from_counts
    from gefen_core.momentum_codec import bucket_occupancy_ok, lower_bound

    generator = torch.Generator().manual_seed(3)
    codebooks = [
        codebook_from_counts(torch.randint(0, 50, (4096,), generator=generator)),
        codebook_from_counts(torch.bincount(torch.tensor([0, 100, 2048, 2049, 4095]), minlength=4096)),
        _codebook(),
    ]
    for codebook in codebooks:
        assert codebook is not None and bucket_occupancy_ok(codebook)
        edges = torch.arange(4097, dtype=torch.float32) / 2048 - 1
        z = torch.cat(
            [torch.rand(50_000, generator=generator) * 2 - 1, codebook, edges, edges.nextafter(torch.tensor(2.0))]
        )
        z = z.clamp(-1, 1)
        assert torch.equal(lower_bound(codebook, z), torch.searchsorted(codebook, z, out_int32=True))
    crowded = torch.cat([torch.tensor([-1.0]), torch.full((3,), 0.1), torch.linspace(0.2, 1.0, 252)])
    assert not bucket_occupancy_ok(crowded)


def test_the_uniform_reference_has_the_shape_and_layout_of_its_fake_and_kernels() -> None:
    """``gefen::stochastic_uniform.v1`` returns an index-shaped contiguous tensor (its fake's
    ``index.new_empty(index.shape)``); the reference broadcast the ``[1]`` seed, giving a 0-d
    index a ``[1]`` result, and kept a transposed index's strides."""
    import gefen_core.ops  # noqa: F401  (registers the op)

    seed = torch.tensor([12345], dtype=torch.int64)
    for index in (torch.tensor(7, dtype=torch.int64), torch.arange(6, dtype=torch.int64).reshape(2, 3).T):
        out = stochastic_uniform_reference(seed, index)
        assert out.shape == index.shape and out.is_contiguous() and out.dtype is torch.float32
        torch.library.opcheck(torch.ops.gefen.stochastic_uniform.v1, (seed, index))

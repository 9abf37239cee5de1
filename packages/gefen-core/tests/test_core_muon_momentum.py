"""``gefen::muon_momentum.v3``: the reference op against its documented arithmetic."""

from __future__ import annotations

import pytest
import torch
from gefen_core import reference_ops
from gefen_core.momentum_codec import dequantize, nearest_codeword, normalize_blocks
from gefen_core.muon_reference_ops import muon_momentum_reference, muon_momentum_tensor
from gefen_core.ops import MUON_MOMENTUM, OPS
from gefen_core.step_scalars import MUON_BETA, MUON_ONE_MINUS_BETA, muon_scalars
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def _codebook() -> torch.Tensor:
    inner = torch.sort(torch.rand(254, generator=torch.Generator().manual_seed(7)) * 1.98 - 0.99).values
    return torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])


def _state(rows: int, cols: int, period: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    blocks = rows * cols // period
    indices = torch.randint(0, 256, (blocks, period), generator=generator, dtype=torch.uint8)
    magnitude = torch.rand(blocks, 1, generator=generator)
    return indices, magnitude


def _by_hand(
    grad: torch.Tensor,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    codebook: torch.Tensor,
    beta: float,
    nesterov: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's formulas, written out with separately rounded fp32 ops."""
    scalars = muon_scalars(torch.device("cpu"), beta)
    b, omb = scalars[MUON_BETA], scalars[MUON_ONE_MINUS_BETA]
    g = grad.to(torch.float32).reshape(indices.shape)
    m = codebook[indices.long()] * magnitude
    u = m * b + g * omb
    new_magnitude = u.abs().amax(dim=1, keepdim=True)
    z = torch.where(new_magnitude > 0, u / torch.where(new_magnitude > 0, new_magnitude, 1.0), 0.0)
    q = (z[..., None] - codebook).abs().argmin(dim=-1)  # argmin keeps the first (lower) index on ties
    h = codebook[q] * new_magnitude
    n = h * b + g * omb if nesterov else h
    return q.to(torch.uint8), new_magnitude, n.reshape(grad.shape)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_reference_matches_the_documented_arithmetic(nesterov: bool, dtype: torch.dtype) -> None:
    rows, cols, period = 12, 20, 40
    grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)).to(dtype)
    codebook = _codebook()
    indices, magnitude = _state(rows, cols, period, 2)
    expected_q, expected_m, expected_n = _by_hand(grad, indices, magnitude, codebook, 0.9, nesterov)
    out = torch.empty(rows, cols, dtype=torch.bfloat16)
    muon_momentum_tensor(
        grad, indices, magnitude, codebook, muon_scalars(torch.device("cpu"), 0.9), None, out,
        nesterov=nesterov, deterministic=False,
    )  # fmt: skip
    assert torch.equal(indices, expected_q)
    assert torch.equal(magnitude, expected_m)
    assert torch.equal(out, expected_n.to(torch.bfloat16))


def test_nesterov_changes_only_the_output_and_fp32_out_is_unrounded() -> None:
    grad = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))
    codebook = _codebook()
    results = []
    for nesterov in (False, True):
        indices, magnitude = _state(6, 16, 16, 4)
        out = torch.empty(6, 16)
        muon_momentum_tensor(
            grad, indices, magnitude, codebook, muon_scalars(torch.device("cpu"), 0.95), None, out,
            nesterov=nesterov, deterministic=False,
        )  # fmt: skip
        results.append((indices, magnitude, out))
    (q0, m0, plain), (q1, m1, nesterov_out) = results
    assert torch.equal(q0, q1) and torch.equal(m0, m1)
    assert torch.equal(plain, dequantize(codebook, q0, m0).view(6, 16))
    assert not torch.equal(plain, nesterov_out)


def test_chunking_does_not_change_any_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    grad = torch.randn(32, 24, generator=torch.Generator().manual_seed(5))
    codebook = _codebook()
    seed = torch.tensor([12345], dtype=torch.int64)
    outputs = []
    for chunk in (1 << 22, 48):  # 48 elements: two blocks of 24 per chunk
        monkeypatch.setattr(reference_ops, "CHUNK_ELEMENTS", chunk)
        indices, magnitude = _state(32, 24, 24, 6)
        out = torch.empty(32, 24, dtype=torch.bfloat16)
        muon_momentum_tensor(
            grad, indices, magnitude, codebook, muon_scalars(torch.device("cpu"), 0.9), seed, out,
            nesterov=True, deterministic=False,
        )  # fmt: skip
        outputs.append((indices, magnitude, out))
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_stochastic_rounding_is_reproducible_and_unbiased() -> None:
    codebook = _codebook()
    grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(8))
    mean_code = torch.zeros(64, 64)
    draws = 200
    for draw in range(draws):
        indices = torch.zeros(64, 64, dtype=torch.uint8)
        magnitude = torch.zeros(64, 1)
        seed = torch.tensor([draw], dtype=torch.int64)
        out = torch.empty(64, 64)
        muon_momentum_tensor(
            grad, indices, magnitude, codebook, muon_scalars(torch.device("cpu"), 0.0), seed, out,
            nesterov=False, deterministic=False,
        )  # fmt: skip
        mean_code += out / draws
        if draw == 0:
            again_q = torch.zeros(64, 64, dtype=torch.uint8)
            again_m = torch.zeros(64, 1)
            muon_momentum_tensor(
                grad, again_q, again_m, codebook, muon_scalars(torch.device("cpu"), 0.0), seed, torch.empty(64, 64),
                nesterov=False, deterministic=False,
            )  # fmt: skip
            assert torch.equal(again_q, indices)
    magnitude, z = normalize_blocks(grad)
    nearest_error = (dequantize(codebook, nearest_codeword(codebook, z), magnitude) - grad).abs().mean()
    assert (mean_code - grad).abs().mean() < 0.25 * nearest_error  # E[C[q]] * M == u


def test_the_op_is_named_and_signed() -> None:
    spec = OPS[MUON_MOMENTUM]
    assert MUON_MOMENTUM == "gefen::muon_momentum.v3" and spec.reference is muon_momentum_reference

"""Adafactor's update clipping on Gefen's factored matrices (the ``clip_threshold`` option).

The clipping statistic is the RMS of the preconditioned gradient ``g / h`` over the whole
matrix; above the threshold every denominator grows by that ratio, so the first update of a
matrix (which is the preconditioned gradient itself, after bias correction) has RMS at most the
threshold, up to the momentum's 8-bit rounding.
"""

from __future__ import annotations

import pytest
import torch
from gefen_core import Gefen
from gefen_core.second_moment import FLT_MIN, clip_row_factor, preconditioned_sumsq
from gefen_core.step_scalars import host_scalars
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)

LR = 1e-2


def _spiky_gradient() -> torch.Tensor:
    """A 16 x 32 gradient whose few large elements sit in quiet rows and columns: its factored
    ``V`` underestimates them, so ``g / sqrt(V)`` has RMS well above 1."""
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(16, 32, generator=generator) * 1e-3
    grad[3, 5] = 1.0
    grad[11, 20] = -0.5
    return grad


def _first_update(grad: torch.Tensor, fused: bool | None, **options: object) -> torch.Tensor:
    param = torch.nn.Parameter(torch.zeros_like(grad))
    options = {"min_dim_size_to_factor": 0, **options}  # clipping is a factored-matrix option
    optimizer = Gefen([param], lr=LR, weight_decay=0.0, fused=fused, **options)  # type: ignore[arg-type]
    param.grad = grad.clone()
    optimizer.step()
    return param.detach().neg() / LR


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.square().mean().sqrt())


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "kernel"])
def test_a_spiky_first_update_is_clipped_to_the_threshold(fused: bool | None) -> None:
    grad = _spiky_gradient()
    unclipped = _first_update(grad, fused, clip_threshold=None)
    assert _rms(unclipped) > 2.0  # the factored V lets the spikes through
    for threshold in (1.0, 0.5):
        clipped = _first_update(grad, fused, clip_threshold=threshold)
        assert _rms(clipped) == pytest.approx(threshold, rel=0.02)
        # one scale for the whole matrix: the direction is kept
        ratio = unclipped.norm() / clipped.norm()
        torch.testing.assert_close(clipped * ratio, unclipped, rtol=0.05, atol=0.05 * float(unclipped.abs().max()))


def test_below_the_threshold_nothing_changes_bit_for_bit() -> None:
    grad = _spiky_gradient()
    assert torch.equal(_first_update(grad, False, clip_threshold=1e6), _first_update(grad, False, clip_threshold=None))


def test_the_kernel_and_the_reference_clip_alike() -> None:
    grad = _spiky_gradient()
    assert torch.equal(_first_update(grad, False, clip_threshold=1.0), _first_update(grad, None, clip_threshold=1.0))


def test_the_statistic_follows_its_formula() -> None:
    grad = _spiky_gradient()
    generator = torch.Generator().manual_seed(1)
    row_factor = torch.rand(16, generator=generator) + 0.5
    v_col = torch.rand(32, generator=generator) * 1e-4 + FLT_MIN
    scalars = host_scalars(
        torch.device("cpu"), lr=LR, step=1, age=1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, factored=True
    )
    h = (row_factor.double().sqrt().float()[:, None] * v_col.double().sqrt().float()[None, :]) + 1e-8
    expected = (grad / h).double().square().sum()
    assert torch.equal(preconditioned_sumsq(grad, row_factor, v_col, scalars), expected.reshape(1))
    rms = float((expected / grad.numel()).sqrt())
    assert rms > 2.0  # the spikes sit in quiet columns: this statistic clips at 1
    clipped = clip_row_factor(row_factor, expected.reshape(1), grad.numel(), 1.0)
    torch.testing.assert_close(clipped, row_factor * rms**2)
    assert torch.equal(clip_row_factor(row_factor, expected.reshape(1), grad.numel(), 2 * rms), row_factor)


def test_group_option_and_checkpoint_round_trip() -> None:
    param = torch.nn.Parameter(torch.zeros(4, 8))
    optimizer = Gefen([{"params": [param], "clip_threshold": 2.0}], lr=LR)
    assert optimizer.param_groups[0]["clip_threshold"] == 2.0
    assert optimizer.defaults["clip_threshold"] is None
    param.grad = torch.randn(4, 8)
    optimizer.step()
    state = optimizer.state_dict()
    other = Gefen([param], lr=LR)
    other.load_state_dict(state)
    assert other.param_groups[0]["clip_threshold"] == 2.0

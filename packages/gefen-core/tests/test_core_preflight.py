"""Bad input raises a specific error before anything is mutated; kernel dispatch by ``fused``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_core import Gefen, GradientError
from gefen_core.ops import DISPATCHED_OPS
from gefen_core_test_support import counting_kernels, single_threaded_torch  # noqa: F401  (autouse fixture)


def _setup(initialised: bool) -> tuple[list[torch.nn.Parameter], Gefen]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    opt = Gefen(params, lr=1e-2, weight_decay=0.1, fused=False)
    if initialised:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        p.grad = torch.randn_like(p)
    return params, opt


def _wrong_shape(p: torch.Tensor) -> None:
    p.grad.data = torch.zeros(p.numel() + 1)  # type: ignore[union-attr]


def _wrong_dtype(p: torch.Tensor) -> None:
    p.grad.data = p.grad.data.double()  # type: ignore[union-attr]


def _sparse(p: torch.Tensor) -> None:
    p.grad = torch.zeros_like(p).to_sparse()


CORRUPTIONS: dict[str, tuple[Callable[[torch.Tensor], None], str]] = {
    "shape": (_wrong_shape, "shape"),
    "dtype": (_wrong_dtype, "dtype"),
    "sparse": (_sparse, "sparse"),
}


@pytest.mark.parametrize("initialised", [False, True])
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_bad_gradient_on_a_later_parameter_changes_nothing(kind: str, initialised: bool) -> None:
    params, opt = _setup(initialised)
    corrupt, message = CORRUPTIONS[kind]
    corrupt(params[1])
    before = deep_snapshot(opt, *params)
    with pytest.raises(GradientError, match=message):
        opt.preflight_step()
    assert not snapshot_diff(before, opt, *params)
    with pytest.raises(GradientError, match=rf"param_groups\[0\]\['params'\]\[1\].*{message}"):
        opt.step()
    assert not snapshot_diff(before, opt, *params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device mismatch needs a second device")
def test_gradient_on_another_device_is_refused() -> None:
    params, opt = _setup(True)
    params[1].grad.data = params[1].grad.data.cuda()  # type: ignore[union-attr]
    before = deep_snapshot(opt, *params)
    with pytest.raises(GradientError, match="same device"):
        opt.step()
    assert not snapshot_diff(before, opt, *params)


def test_non_finite_first_gradient_is_refused_before_learning() -> None:
    params, opt = _setup(False)
    params[0].grad[0, 0] = float("nan")  # type: ignore[index]
    before = deep_snapshot(opt, *params)
    with pytest.raises(GradientError, match="not finite"):
        opt.step()
    assert not snapshot_diff(before, opt, *params) and opt.codebook is None


def test_a_group_edited_into_an_invalid_state_is_refused() -> None:
    params, opt = _setup(True)
    opt.param_groups[0]["lr"] = -0.5
    before = deep_snapshot(opt, *params)
    with pytest.raises(ValueError, match="learning rate"):
        opt.step()
    assert not snapshot_diff(before, opt, *params)


def test_a_resized_parameter_is_refused() -> None:
    params, opt = _setup(True)
    params[1].data = torch.randn(12)
    params[1].grad = torch.randn(12)
    with pytest.raises(ValueError, match="resized"):
        opt.preflight_step()


def test_preflight_passes_on_good_gradients_and_changes_nothing() -> None:
    for initialised in (False, True):
        params, opt = _setup(initialised)
        before = deep_snapshot(opt, *params)
        opt.preflight_step()
        assert not snapshot_diff(before, opt, *params)


def _run(fused: bool | None) -> list[torch.Tensor]:
    torch.manual_seed(1)
    # factored (8 x 16), element (4 x 16: narrower than 8) and block (16) second moments
    shapes = [(8, 16), (4, 16), (16,)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    opt = Gefen(params, lr=1e-2, fused=fused, stochastic_round=True, min_dim_size_to_factor=8)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params


def test_fused_none_runs_the_kernels_registered_for_the_device() -> None:
    with counting_kernels() as calls:
        with_kernels = _run(None)
        reference = _run(False)
    assert all(torch.equal(a, b) for a, b in zip(with_kernels, reference))
    assert calls == {
        "gefen::block_step.v4": 3,
        "gefen::element_step.v2": 3,
        "gefen::factored_moments.v3": 3,
        "gefen::factored_step.v5": 3,
        "gefen::histogram.v2": 1,  # one for the first step's parameters
        "gefen::codebook_solve.v2": 1,  # and its codebook
    }


def test_fused_false_never_calls_a_registered_kernel_and_true_calls_only_them() -> None:
    with counting_kernels() as calls:
        _run(False)
        assert calls == {}
        _run(True)
        assert calls["gefen::block_step.v4"] == 3 and calls["gefen::factored_step.v5"] == 3
        assert calls["gefen::element_step.v2"] == 3
    with counting_kernels(DISPATCHED_OPS) as calls:  # no stochastic_uniform: never dispatched
        _run(True)
        assert set(calls) == {
            "gefen::block_step.v4",
            "gefen::element_step.v2",
            "gefen::factored_moments.v3",
            "gefen::factored_step.v5",
            "gefen::histogram.v2",
        }

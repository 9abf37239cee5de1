"""Bad input raises a specific error before anything is mutated; kernel dispatch by ``fused``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import KernelRegistry, KernelUnavailableError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_core import Gefen, GradientError
from gefen_core.ops import DISPATCHED_OPS, OPS
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


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


class _CountingProvider:
    """A provider that runs the reference implementations and counts calls."""

    def __init__(self, supported: bool = True) -> None:
        self.calls: dict[str, int] = {}
        self.supported = supported

    @property
    def name(self) -> str:
        return "counting"

    def op_ids(self) -> frozenset[str]:
        return frozenset(OPS)

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
        return self.supported

    def implementation(self, op_id: str) -> Callable[..., Any]:
        reference = OPS[op_id].reference

        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls[op_id] = self.calls.get(op_id, 0) + 1
            return reference(*args, **kwargs)

        return run


def _run(fused: bool | None, registry: KernelRegistry | None) -> list[torch.Tensor]:
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(16))]
    opt = Gefen(params, lr=1e-2, fused=fused, kernel_registry=registry, stochastic_round=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params


def test_fused_none_uses_a_provider_that_supports_the_tensors() -> None:
    provider = _CountingProvider()
    with_provider = _run(None, KernelRegistry([provider]))
    reference = _run(False, KernelRegistry([provider]))
    assert all(torch.equal(a, b) for a, b in zip(with_provider, reference))
    assert provider.calls == {
        "gefen.block_step/2": 3,
        "gefen.factored_moments/1": 3,
        "gefen.factored_step/3": 3,
        "gefen.histogram/1": 2,
    }


def test_fused_none_falls_back_to_the_reference_when_the_provider_declines() -> None:
    provider = _CountingProvider(supported=False)
    _run(None, KernelRegistry([provider]))
    assert provider.calls == {}


def test_fused_true_requires_a_provider() -> None:
    with pytest.raises(KernelUnavailableError, match="fused=True"):
        Gefen([torch.nn.Parameter(torch.ones(4))], fused=True, kernel_registry=KernelRegistry())
    provider = _CountingProvider()
    _run(True, KernelRegistry([provider]))
    assert provider.calls["gefen.block_step/2"] == 3

    class StepOpsOnly(_CountingProvider):
        def op_ids(self) -> frozenset[str]:
            return frozenset(DISPATCHED_OPS)  # no gefen.stochastic_uniform/1: never dispatched

    _run(True, KernelRegistry([StepOpsOnly()]))
    declining = _CountingProvider()
    params = [torch.nn.Parameter(torch.randn(8, 16))]
    opt = Gefen(params, fused=True, kernel_registry=KernelRegistry([declining]))
    params[0].grad = torch.randn(8, 16)
    opt.step()
    declining.supported = False
    params[0].grad = torch.randn(8, 16)
    before = deep_snapshot(opt, *params)
    with pytest.raises(KernelUnavailableError, match="do not support"):
        opt.step()
    assert not snapshot_diff(before, opt, *params)


def test_fused_true_rolls_back_a_first_step_whose_new_state_no_kernel_supports() -> None:
    class FirstStepOnly(_CountingProvider):
        def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
            return op_id in ("gefen.histogram/1", "gefen.factored_stats/1")

    params = [torch.nn.Parameter(torch.randn(8, 16))]
    opt = Gefen(params, fused=True, kernel_registry=KernelRegistry([FirstStepOnly()]))
    params[0].grad = torch.randn(8, 16)
    before = deep_snapshot(opt, *params)
    with pytest.raises(KernelUnavailableError):
        opt.step()
    assert not [d for d in snapshot_diff(before, opt, *params) if "_providers" not in d]
    assert opt.codebook is None and not opt.state.get(params[0])

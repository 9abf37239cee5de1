"""``fused=None/True/False`` on ``Gefen`` with gefen-kernels registered ("fused" means one thing everywhere)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gefen_contracts import KernelRegistry, KernelUnavailableError, default_kernel_registry
from gefen_core import Gefen
from gefen_kernels import CpuKernelUnavailableWarning, GefenKernelProvider, cpu_kernel_status, provider
from gefen_kernels.cpu_build import reset_cpu_library
from kernels_parity_helpers import assert_params_close

STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def compiled_kernel() -> Iterator[None]:
    status = cpu_kernel_status()
    assert status.available, status.reason
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class CountingProvider:
    """Delegates to gefen-kernels and counts the ops it ran."""

    def __init__(self, inner: GefenKernelProvider) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    @property
    def name(self) -> str:
        return "counting"

    def op_ids(self) -> frozenset[str]:
        return self.inner.op_ids()

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
        return self.inner.supports(op_id, *args, **kwargs)

    def implementation(self, op_id: str) -> Callable[..., Any]:
        run = self.inner.implementation(op_id)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[op_id] += 1
            return run(*args, **kwargs)

        return counted


def _params() -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(11)
    base = torch.randn(24, 10, generator=generator)
    return [
        ("matrix", torch.nn.Parameter(torch.randn(16, 24, generator=generator))),
        ("norm", torch.nn.Parameter(torch.randn(24, generator=generator))),
        ("transposed", torch.nn.Parameter(base.t())),  # non-contiguous
        ("bf16", torch.nn.Parameter(torch.randn(12, 20, generator=generator).to(torch.bfloat16))),
        ("conv", torch.nn.Parameter(torch.randn(4, 3, 5, generator=generator))),
    ]


def _train(fused: bool | None, registry: KernelRegistry | None, **options: Any) -> tuple[list[torch.Tensor], Gefen]:
    params = _params()
    assert not params[2][1].is_contiguous()
    optimizer = Gefen(params, lr=3e-3, weight_decay=0.05, fused=fused, kernel_registry=registry, **options)
    generator = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        for _, param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()
    return [p.detach().clone() for _, p in params], optimizer


def _assert_same_training(expected: tuple[list[torch.Tensor], Gefen], got: tuple[list[torch.Tensor], Gefen]) -> None:
    initial = [p.detach() for _, p in _params()]
    for before, ref, mine in zip(initial, expected[0], got[0]):
        assert ref.dtype == mine.dtype and ref.stride() == mine.stride()
        assert_params_close(before, ref, mine, ulps=2 * STEPS)
    ref_opt, mine_opt = expected[1], got[1]
    for ref_state, mine_state in zip(ref_opt.state.values(), mine_opt.state.values()):
        for key, value in ref_state.items():
            if isinstance(value, torch.Tensor) and value.dtype is torch.uint8:
                assert torch.equal(value, mine_state[key]), key


def test_the_entry_point_registers_gefen_kernels() -> None:
    assert any(isinstance(p, GefenKernelProvider) for p in default_kernel_registry().providers)


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_fused_none_runs_the_kernels_and_matches_the_reference(stochastic_round: bool) -> None:
    counting = CountingProvider(provider())
    fused = _train(None, KernelRegistry([counting]), stochastic_round=stochastic_round)
    assert set(counting.calls) == {
        "gefen.block_step/2",
        "gefen.factored_moments/1",  # unsharded factored parameters: statistics and update in one call
        "gefen.factored_step/3",
        "gefen.histogram/1",
    }
    assert counting.calls["gefen.factored_step/3"] == 3 * STEPS  # matrix, transposed, bf16
    assert counting.calls["gefen.factored_moments/1"] == 3 * STEPS
    assert counting.calls["gefen.block_step/2"] == 2 * STEPS  # norm, conv
    _assert_same_training(_train(False, None, stochastic_round=stochastic_round), fused)


def test_fused_true_requires_and_uses_the_kernels() -> None:
    counting = CountingProvider(provider())
    fused = _train(True, KernelRegistry([counting]), factored_v_2d=False)
    assert counting.calls["gefen.block_step/2"] == 5 * STEPS
    _assert_same_training(_train(False, None, factored_v_2d=False), fused)
    with pytest.raises(KernelUnavailableError, match=r"gefen\.block_step/2"):
        Gefen(_params(), fused=True, kernel_registry=KernelRegistry())


def test_fused_false_never_calls_a_provider() -> None:
    counting = CountingProvider(provider())
    _train(False, KernelRegistry([counting]))
    assert not counting.calls


def test_without_a_compiler_cpu_steps_fall_back_with_one_clear_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("GEFEN_KERNELS_CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("GEFEN_KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GEFEN_KERNELS_PREBUILT", "0")  # an installed platform wheel needs no compiler
    reset_cpu_library()
    try:
        fresh = GefenKernelProvider()
        registry = KernelRegistry([fresh])
        with pytest.warns(CpuKernelUnavailableWarning, match="no C compiler found") as caught:
            fallback = _train(None, registry)
        assert len([w for w in caught if issubclass(w.category, CpuKernelUnavailableWarning)]) == 1
        status = cpu_kernel_status()
        assert not status.available and "no-such-compiler" in status.reason
        assert not list((tmp_path / "cache").glob("*.so"))
        param = torch.zeros(4)
        block = torch.zeros(1, 1)
        args = (
            param,
            param,
            torch.zeros(1, 4, dtype=torch.uint8),
            block,
            block,
            torch.zeros(256),
            torch.zeros(9),
            None,
        )
        flags = {"apply_decay": False, "maximize": False, "deterministic": False}
        assert "C compiler" in (fresh.explain("gefen.block_step/2", *args, **flags) or "")
        reference = _train(False, None)
        for expected, got in zip(reference[0], fallback[0]):
            assert torch.equal(expected, got)  # the reference path ran
        strict = Gefen(_params(), fused=True, kernel_registry=registry)
        for group in strict.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        # the error names the real cause, not only that the provider declined
        with pytest.raises(KernelUnavailableError, match=r"do not support these tensors \(gefen-kernels: .*C compiler"):
            strict.step()
    finally:
        monkeypatch.undo()
        reset_cpu_library()
    assert cpu_kernel_status().available

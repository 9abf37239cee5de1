"""``fused=None/True/False`` on ``Gefen`` with gefen-kernels registered ("fused" means one thing everywhere)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts import KernelUnavailableError
from gefen_contracts.kernels import load_kernel_plugins
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_core import Gefen
from gefen_core.ops import PartialKernelsWarning, warn_on_partial_kernels
from gefen_kernels import CpuKernelUnavailableWarning, cpu_kernel_status, cpu_ops, registered_devices
from gefen_kernels.cpu_build import reset_cpu_library
from gefen_kernels.signatures import GEFEN_OPS, HOST_OPS
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


@contextmanager
def counting_kernels() -> Iterator[Counter[str]]:
    """gefen-kernels' CPU kernels, registered again through ``torch.library`` wrapped in a call
    counter (the latest registration wins; withdrawing it restores gefen-kernels' own)."""
    load_kernel_plugins()
    calls: Counter[str] = Counter()
    library = torch.library.Library("gefen", "IMPL")

    def counted(op: str) -> Callable[..., Any]:
        run = getattr(cpu_ops, op.split("::")[1].split(".", maxsplit=1)[0])

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[op] += 1
            return run(*args, **kwargs)

        return call

    for op in GEFEN_OPS:
        library.impl(op.split("::")[1], counted(op), "CPU")
    try:
        yield calls
    finally:
        library._destroy()


@contextmanager
def without_a_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """gefen-kernels loaded again where no C compiler exists (and no cached or prebuilt library)."""
    monkeypatch.setenv("GEFEN_KERNELS_CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("GEFEN_KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GEFEN_KERNELS_PREBUILT", "0")  # an installed platform wheel needs no compiler
    reset_cpu_library()
    try:
        yield
    finally:
        monkeypatch.undo()
        reset_cpu_library()
        load_kernel_plugins(reload=True)


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


def _train(fused: bool | None, **options: Any) -> tuple[list[torch.Tensor], Gefen]:
    params = _params()
    assert not params[2][1].is_contiguous()
    # factored (matrix 16 x 24, bf16 12 x 20) and per-element (transposed 10 x 24, narrower than 12) v
    options = {"min_dim_size_to_factor": 12, **options}
    optimizer = Gefen(params, lr=3e-3, weight_decay=0.05, fused=fused, **options)
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


def test_the_entry_point_registers_gefen_kernels_for_cpu() -> None:
    load_kernel_plugins()
    assert "cpu" in registered_devices()
    for op in GEFEN_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"), op


def test_a_cuda_kernel_runs_with_its_first_tensors_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current CUDA device and torch's dispatcher sets no device guard for
    a kernel registered from Python, so ``register`` wraps each CUDA kernel in
    ``on_its_device``: the first tensor's (or first listed tensor's) device is made current. The
    guard is recorded here on CPU tensors (a no-op guard); for ``cuda:1`` it is torch's
    ``torch.cuda.device(1)``."""
    from gefen_kernels import registration

    real = registration.device_guard
    entered: list[torch.device] = []

    def recording(device: torch.device) -> Any:
        entered.append(device)
        return real(device)

    monkeypatch.setattr(registration, "device_guard", recording)
    calls: list[tuple[Any, ...]] = []
    kernel = registration.on_its_device(lambda *args, **kwargs: calls.append(args) or "done")
    tensor = torch.zeros(2)
    assert kernel([tensor], tensor, flag=True) == "done" and entered == [tensor.device]
    assert kernel(tensor) == "done" and entered == [tensor.device] * 2
    assert kernel([]) == "done" and len(entered) == 2 and len(calls) == 3  # nothing to launch: no guard
    guard = real(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(real(torch.device("cpu")), torch.cuda.device)


def test_register_wraps_every_cuda_kernel_in_the_device_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """``register`` itself applies ``on_its_device`` to each CUDA kernel and to no CPU one
    (a stand-in CUDA backend, since CI has no GPU; registering for the CUDA key needs none)."""
    from types import SimpleNamespace

    from gefen_kernels import registration

    guarded: list[str] = []

    def marking(kernel: Any) -> Any:
        guarded.append(kernel.__name__)
        return kernel

    names = sorted({op.split("::")[1].split(".")[0] for op in GEFEN_OPS})
    stand_in = SimpleNamespace(**{name: _named_kernel(name) for name in names})
    monkeypatch.setattr(registration, "on_its_device", marking)
    monkeypatch.setattr(registration, "_cuda_backend", lambda: (stand_in, None))
    try:
        assert registration.register() == {}
        assert registration.registered_devices() == ("cpu", "cuda")
        device_ops = GEFEN_OPS - HOST_OPS  # (a host op, the codebook solve, is registered for the CPU only)
        assert sorted(guarded) == sorted(op.split("::")[1].split(".")[0] for op in device_ops)
        for op in GEFEN_OPS:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") == (op in device_ops), op
    finally:
        monkeypatch.undo()
        registration.register()  # the real registration again, for the tests that follow
    assert "cuda" not in registration.registered_devices() or torch.cuda.is_available()


def _named_kernel(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a stand-in CUDA kernel never runs")

    kernel.__name__ = name
    return kernel


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_fused_none_runs_the_kernels_and_matches_the_reference(stochastic_round: bool) -> None:
    with counting_kernels() as calls:
        fused = _train(None, stochastic_round=stochastic_round)
    assert set(calls) == {
        "gefen::block_step.v4",
        "gefen::element_step.v2",
        "gefen::factored_moments.v3",  # unsharded factored parameters: statistics and update in one call
        "gefen::factored_step.v5",
        "gefen::histogram.v2",
        "gefen::codebook_solve.v2",  # the first step's codebook
    }
    assert calls["gefen::codebook_solve.v2"] == 1
    # one call per phase for the group's factored matrices (matrix, bf16), one for its narrow
    # one (transposed, Adam's v) and one for its block-path tensors (norm, conv), whatever their number
    assert calls["gefen::factored_step.v5"] == STEPS
    assert calls["gefen::element_step.v2"] == STEPS
    assert calls["gefen::factored_moments.v3"] == STEPS
    assert calls["gefen::block_step.v4"] == STEPS
    _assert_same_training(_train(False, stochastic_round=stochastic_round), fused)


def test_fused_true_uses_the_kernels_and_false_never_does() -> None:
    with counting_kernels() as calls:
        fused = _train(True, factored_v_2d=False)
        assert calls["gefen::block_step.v4"] == STEPS  # all five tensors in one call
        calls.clear()
        reference = _train(False, factored_v_2d=False)
        assert not calls
    _assert_same_training(reference, fused)


def test_without_a_compiler_cpu_steps_fall_back_with_one_clear_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    strict = Gefen(_params(), fused=True)  # built while the kernels are registered
    with without_a_compiler(monkeypatch, tmp_path):
        with pytest.warns(CpuKernelUnavailableWarning, match="no C compiler found") as caught:
            reports = load_kernel_plugins(reload=True)
        assert len([w for w in caught if issubclass(w.category, CpuKernelUnavailableWarning)]) == 1
        assert "C compiler" in (reports[0].reason("cpu") or "") and "cpu" not in registered_devices()
        status = cpu_kernel_status()
        assert not status.available and "no-such-compiler" in status.reason
        assert not list((tmp_path / "cache").glob("*.so"))
        fallback = _train(None)
        reference = _train(False)
        for expected, got in zip(reference[0], fallback[0]):
            assert torch.equal(expected, got)  # the reference path ran
        # fused=True names the real cause, at construction and at a step, and changes nothing
        with pytest.raises(KernelUnavailableError, match=r"gefen::block_step\.v4.*C compiler"):
            Gefen(_params(), fused=True)
        for group in strict.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        before = deep_snapshot(strict, *strict.param_groups[0]["params"])
        with pytest.raises(KernelUnavailableError, match="C compiler"):
            strict.step()
        assert not snapshot_diff(before, strict, *strict.param_groups[0]["params"])
    assert cpu_kernel_status().available and "cpu" in registered_devices()


def test_kernels_for_some_ops_only_are_named_in_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A kernel package built for other op versions registers some of gefen-core's ops but not
    others; the missing ones would silently run the reference, so loading says which."""
    with without_a_compiler(monkeypatch, tmp_path):
        with pytest.warns(CpuKernelUnavailableWarning):
            load_kernel_plugins(reload=True)  # no CPU kernels at all: nothing partial to report
        assert warn_on_partial_kernels() == []
        library = torch.library.Library("gefen", "IMPL")
        library.impl("histogram.v2", cpu_ops.histogram, "CPU")  # as a skewed kernel package would
        try:
            with pytest.warns(PartialKernelsWarning, match=r"not for \[.*gefen::block_step\.v4"):
                missing = warn_on_partial_kernels()
            assert "CPU: gefen::block_step.v4" in missing and "CPU: gefen::histogram.v2" not in missing
        finally:
            library._destroy()


def test_the_fused_step_reaches_the_c_kernels_within_five_python_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: from ``Gefen.step`` to the Python frame that calls into C, at most five frames
    (``step`` and that frame included; torch's dispatcher adds none)."""
    import sys

    load_kernel_plugins()
    real = cpu_ops._function
    depths: dict[str, int] = {}

    def spy(name: str) -> Callable[..., int]:
        function = real(name)

        def call(*args: Any) -> int:
            frame, depth = sys._getframe(1), 1  # the frame that calls the C function
            while frame is not None and not (
                frame.f_code.co_name == "step" and frame.f_code.co_filename.endswith("gefen.py")
            ):
                frame, depth = frame.f_back, depth + 1
            assert frame is not None, "not called from Gefen.step"
            depths[name] = depth
            return function(*args)

        return call

    # factored (8 x 16), element (4 x 16: narrower than 8) and block (16)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((8, 16), (4, 16), (16,))]
    optimizer = Gefen(params, lr=1e-2, fused=True, min_dim_size_to_factor=8)
    for step in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        if step == 1:
            monkeypatch.setattr(cpu_ops, "_function", spy)
        optimizer.step()
    assert set(depths) == {"gefen_block_step", "gefen_element_step", "gefen_factored_moments", "gefen_factored_step"}, (
        depths
    )
    assert max(depths.values()) <= 5, depths

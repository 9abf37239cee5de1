"""The Triton kernels against gefen-core's reference ops.

With a GPU they run compiled on CUDA tensors; without one, Triton's interpreter
(``TRITON_INTERPRET=1``, set before the kernels are imported) runs them on CPU tensors at
tiny sizes (the interpreter is slow).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated
triton = pytest.importorskip("triton")


def _load_triton_ops() -> ModuleType:
    if not ON_GPU:
        triton.knobs.runtime.interpret = True  # in case triton was imported (and read the knob) earlier
    import gefen_kernels.triton_elements as elements
    import gefen_kernels.triton_kernels as kernels
    import gefen_kernels.triton_muon as muon
    import gefen_kernels.triton_ops as ops
    import gefen_kernels.triton_statistics as statistics

    if not ON_GPU and "Interpreted" not in type(kernels.block_step_kernel).__name__:
        importlib.reload(elements)  # imported earlier without the interpreter
        importlib.reload(kernels)
        importlib.reload(statistics)
        importlib.reload(muon)
        ops = importlib.reload(ops)
    assert ON_GPU or "Interpreted" in type(statistics.histogram_kernel).__name__
    return ops


T = _load_triton_ops()

from gefen_core.momentum_codec import splitmix_uniform  # noqa: E402
from kernels_parity_helpers import (  # noqa: E402
    DTYPES,
    compare_block_step,
    compare_element_steps,
    compare_factored_moments,
    compare_factored_step,
    compare_histogram,
    compare_list_steps,
    compare_muon_list,
    compare_muon_momentum,
    compare_stats_list,
    random_state,
    shared_codebook,
)

BLOCKS = (
    [(0, 3), (3, 5), (17, 1), (2, 64)] if not ON_GPU else [(0, 3), (3, 5), (17, 1), (2, 64), (300, 2048), (3, 70001)]
)
FACTORED = [(3, 5, 5), (4, 6, 8), (2, 17, 34)] if not ON_GPU else [(3, 5, 5), (4, 6, 8), (2, 17, 34), (512, 1000, 500)]
VARIANTS = [(0.0, False, False), (0.1, True, True)]


def _seed(stochastic: bool) -> torch.Tensor | None:
    return torch.tensor([(9 << 32) + 2], dtype=torch.int64, device=DEVICE) if stochastic else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", BLOCKS, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=["nearest", "decay-maximize-sr"])
def test_triton_block_step_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int], variant: tuple) -> None:
    torch.manual_seed(2)
    blocks, period = shape
    weight_decay, maximize, stochastic = variant
    grad = torch.randn(blocks * period, dtype=dtype, device=DEVICE)
    state = random_state((blocks * period,), period, dtype, DEVICE, factored=False)
    compare_block_step(
        T.block_step,
        state,
        grad,
        shared_codebook().to(DEVICE),
        steps=2,
        weight_decay=weight_decay,
        maximize=maximize,
        sr_seed=_seed(stochastic),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FACTORED, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=["nearest", "decay-maximize-sr"])
def test_triton_factored_step_matches_the_reference(dtype: torch.dtype, shape: tuple, variant: tuple) -> None:
    torch.manual_seed(3)
    rows, cols, period = shape
    weight_decay, maximize, stochastic = variant
    grad = torch.randn(rows, cols, dtype=dtype, device=DEVICE)
    state = random_state((rows, cols), period, dtype, DEVICE, factored=True)
    compare_factored_step(
        T.factored_stats,
        T.factored_step,
        state,
        grad,
        shared_codebook().to(DEVICE),
        steps=2,
        weight_decay=weight_decay,
        maximize=maximize,
        sr_seed=_seed(stochastic),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [*FACTORED, (0, 4, 1), (1300, 3, 3)], ids=str)
def test_triton_factored_moments_match_the_reference(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(6)
    rows, cols, _ = shape
    compare_factored_moments(T.factored_moments, torch.randn(rows, cols, dtype=dtype, device=DEVICE), steps=2)


def test_triton_list_ops_step_each_entry_as_the_reference() -> None:
    torch.manual_seed(12)
    compare_list_steps(T.block_step, T.factored_moments, T.factored_step, DEVICE, stochastic=True)
    compare_muon_list(T.muon_momentum, DEVICE)


#: Entries that share a dtype and a tile, two programs each (100 blocks of 16: 64 blocks a
#: program), with a second dtype and a one-program entry: three launches per step op.
GROUPED = [
    *[((100, 16), 16, torch.float32)] * 3,
    *[((100, 16), 16, torch.bfloat16)] * 2,
    ((20, 16), 16, torch.float32),
]


_LIST_KERNELS = ("step_list_kernel", "stats_list_kernel", "moments_list_kernel", "muon_list_kernel")


def _module_of(kernel: str) -> ModuleType:
    """The kernels module (step, statistics or GefenMuon's) that defines ``kernel``."""
    return next(module for module in (T.K, T.S, T.M) if hasattr(module, kernel))


class _LaunchCounter:
    """Counts the grids a kernel is launched with, and launches it."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self.grids.append(grid)
        return self.kernel[grid]  # type: ignore[index]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_triton_one_launch_steps_every_entry_of_a_dtype_and_tile(
    stochastic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17: launches grow with the groups (dtype and tile), not with the tensors; each
    program finds its entry and block, so every entry still equals the reference bit for bit."""
    counters = {name: _LaunchCounter(getattr(_module_of(name), name)) for name in _LIST_KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(_module_of(name), name, counter)
    torch.manual_seed(21)
    compare_list_steps(
        T.block_step, T.factored_moments, T.factored_step, DEVICE, stochastic=stochastic, entries=GROUPED, ragged=[]
    )
    compare_element_steps(T.element_step, DEVICE, stochastic=stochastic, maximize=True, entries=GROUPED)
    steps = counters["step_list_kernel"].grids
    # factored step, block step, element step twice: three groups each (fp32 100 x 16, bf16, fp32 20 x 16)
    assert len(steps) == 4 * 3
    assert sorted({grid[0] for grid in steps}) == [1, 4, 6]  # programs: 1, 2 + 2, 2 + 2 + 2
    # the factored statistics: one launch per dtype (all column tiles are 16), one for the moments
    assert len(counters["stats_list_kernel"].grids) == 2
    assert counters["moments_list_kernel"].grids == [(6,)]
    # GefenMuon's momentum, five matrices with outputs bf16 / fp32 / bf16 / fp32 / bf16: the three
    # fp32 gradients make two groups (by output dtype), the two bf16 ones two; two calls per compare
    compare_muon_list(T.muon_momentum, DEVICE, entries=GROUPED[:5])
    assert len(counters["muon_list_kernel"].grids) == 2 * 4


def test_a_captured_step_launches_per_entry_and_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA graph capture the step ops launch once per entry (a replayed graph would copy a
    list launch's table from a freed host buffer); that path equals the reference too."""
    monkeypatch.setattr(T, "_capturing", lambda tensor: True)
    counters = {name: _LaunchCounter(getattr(_module_of(name), name)) for name in _LIST_KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(_module_of(name), name, counter)
    torch.manual_seed(22)
    compare_list_steps(T.block_step, T.factored_moments, T.factored_step, DEVICE, stochastic=True, entries=GROUPED)
    compare_element_steps(T.element_step, DEVICE, stochastic=False, maximize=False, entries=GROUPED[3:])
    compare_muon_list(T.muon_momentum, DEVICE, entries=GROUPED[:5])
    assert all(not counter.grids for counter in counters.values())


def test_triton_one_statistics_call_sums_every_gradient_as_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(17)
    compare_stats_list(T.factored_stats, DEVICE)
    monkeypatch.setattr(T, "_capturing", lambda tensor: True)  # the per-matrix path of a captured step
    compare_stats_list(T.factored_stats, DEVICE)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_triton_element_step_matches_the_reference_bit_for_bit(stochastic: bool) -> None:
    """Adam's per-element v advanced inside the kernel (maximize with stochastic rounding)."""
    torch.manual_seed(13)
    small = [((8, 16), 16, torch.float32), ((0, 4), 4, torch.float32), ((3, 7), 21, torch.bfloat16)]
    compare_element_steps(
        T.element_step, DEVICE, stochastic=stochastic, maximize=stochastic, entries=None if ON_GPU else small
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_histogram_counts_equal_the_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    grad = torch.randn(5 * 13, dtype=dtype, device=DEVICE)
    grad[:13] = 0
    compare_histogram(T.histogram, grad, 13)


@pytest.mark.parametrize("numel", [2 * 2048 + 37, 3])
def test_triton_ragged_last_block_steps_and_counts_as_the_reference(numel: int) -> None:
    """Blocks of 2048 over a size 2048 does not divide: the last block is a block of its own length."""
    torch.manual_seed(numel)
    grad = torch.randn(numel, device=DEVICE)
    state = random_state((numel,), 2048, torch.float32, DEVICE, factored=False)
    compare_block_step(
        T.block_step,
        state,
        grad,
        shared_codebook().to(DEVICE),
        steps=2,
        weight_decay=0.1,
        maximize=True,
        sr_seed=_seed(True),
        exact=True,
    )
    grad[-min(numel, 5) :] = 0
    compare_histogram(T.histogram, grad, 2048)


def test_triton_uniforms_equal_the_pinned_hash() -> None:
    index = torch.tensor([0, 1, 2, 1000, 2**31 + 5], dtype=torch.int64, device=DEVICE)
    got = T.stochastic_uniform(torch.tensor([0], dtype=torch.int64, device=DEVICE), index)
    assert [int(v * 2**24) for v in got.tolist()] == [14819496, 7239838, 443485, 2947631, 1177231]
    seed = torch.tensor([-(2**63) + 12345], dtype=torch.int64, device=DEVICE)
    many = torch.arange(0, 3000, 7, dtype=torch.int64, device=DEVICE)
    assert torch.equal(T.stochastic_uniform(seed, many).cpu(), splitmix_uniform(seed.cpu(), many.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "variant", [(torch.bfloat16, True, False), (torch.float32, False, True)], ids=["bf16-nesterov", "fp32-sr"]
)
def test_triton_muon_momentum_matches_the_reference(dtype: torch.dtype, variant: tuple) -> None:
    torch.manual_seed(6)
    out_dtype, nesterov, stochastic = variant
    grad = torch.randn(4, 6, dtype=dtype, device=DEVICE)
    compare_muon_momentum(
        T.muon_momentum,
        grad,
        8,
        shared_codebook().to(DEVICE),
        out_dtype=out_dtype,
        nesterov=nesterov,
        sr_seed=_seed(stochastic),
    )


def test_kernels_read_only_the_globals_a_compiled_kernel_may_read() -> None:
    """Compiled Triton reads a module global only when it is a ``tl.constexpr``, a jitted function
    or a module; the interpreter these CPU tests run under reads any (a plain-int hash constant
    passed here and failed to compile on an H200). Every name each kernel's code looks up that is
    a global of its module must be one of those."""
    import inspect

    import gefen_kernels.triton_elements as elements
    import gefen_kernels.triton_kernels as kernels
    import gefen_kernels.triton_muon as muon
    import gefen_kernels.triton_statistics as statistics
    from triton.runtime.interpreter import InterpretedFunction

    kinds = (triton.runtime.JITFunction, InterpretedFunction)
    refused = []
    for module in (elements, kernels, statistics, muon):
        module_globals = vars(module)
        jitted = {name: obj for name, obj in module_globals.items() if isinstance(obj, kinds)}
        assert jitted, f"no jitted functions found in {module.__name__}"
        for name, fn in jitted.items():
            for looked_up in fn.fn.__code__.co_names:
                value = module_globals.get(looked_up)
                if looked_up not in module_globals:
                    continue  # an attribute (tl.load) or a builtin (range)
                allowed = isinstance(value, (triton.language.constexpr, *kinds)) or inspect.ismodule(value)
                if not allowed:
                    refused.append(f"{module.__name__}.{name} reads {looked_up} = {value!r}")
    assert not refused, refused


def test_triton_histogram_bounds_its_columns_by_the_gradient_not_the_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """A period beyond the gradient is one ragged block of it (the reference's and the C
    kernel's reading). The kernel's column loops ran to the period, masked past the end: a
    period of 2**40 over 3 elements hung. The launch now carries the gradient's length."""
    grad = torch.tensor([0.5, -1.0, 0.25], device=DEVICE)
    compare_histogram(T.histogram, grad, 64)  # (a period above the gradient, cheap either way)
    launched: list[torch.Tensor] = []

    class Recorder:
        def __getitem__(self, grid: object) -> object:
            return lambda table, *args, **kwargs: launched.append(table.cpu())

    monkeypatch.setattr(T.S, "histogram_list_kernel", Recorder())
    T.histogram([grad], [2**40], torch.zeros(4096, dtype=torch.int64, device=DEVICE), deterministic=False)
    _pointer, blocks, period, numel = launched[0].tolist()
    assert (blocks, period, numel) == (1, 3, 3)

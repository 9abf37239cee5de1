"""The compiled CPU kernels against gefen-core's reference ops (odd, empty and large-block shapes, every dtype)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gefen_contracts.kernels import load_kernel_plugins
from gefen_core.momentum_codec import splitmix_uniform
from gefen_core.reference_ops import block_step_reference, factored_stats_reference, factored_step_reference
from gefen_kernels import KernelArgumentError, cpu_kernel_status, cpu_ops
from kernels_parity_helpers import (
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
    scalars,
    shared_codebook,
    update_factored_moments,
)

SMALL_BLOCKS = [(0, 5), (1, 1), (7, 13), (33, 64)]  # (blocks, period)
LARGE_BLOCKS = [(1, 1031), (2, 4099)]  # 4099 > the kernel's momentum buffer (recomputing path)
SMALL_FACTORED = [(5, 7, 35), (6, 10, 4), (9, 33, 33), (0, 3, 1)]  # (rows, cols, period)
#: The third: rows over 64 KiB; the last: 9 rows per statistics chunk, so the vector loops that
#: sum four rows at a time run, with their prefetch (16 rows ahead), leaving a row and six
#: columns to the plain loops.
LARGE_FACTORED = [(4, 1030, 515), (2, 5000, 10000), (6, 16411, 16411), (130, 1030, 515)]
BLOCK_CASES = [(d, s) for d in DTYPES for s in SMALL_BLOCKS] + [
    (d, s) for d in (torch.float32, torch.bfloat16) for s in LARGE_BLOCKS
]
FACTORED_CASES = [(d, s) for d in DTYPES for s in SMALL_FACTORED] + [
    (d, s) for d in (torch.float32, torch.bfloat16) for s in LARGE_FACTORED
]
VARIANTS = [  # (weight decay, maximize, stochastic rounding)
    (0.0, False, False),
    (0.1, True, True),
]


@pytest.fixture(autouse=True, scope="module")
def compiled_kernel() -> Iterator[None]:
    """Build (or load) the CPU kernel once, and make sure it really runs (no silent fallback)."""
    status = cpu_kernel_status()
    assert status.available, status.reason
    assert status.openmp, "the CPU kernel was built without OpenMP"
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # exercise the multi-threaded path
    yield
    torch.set_num_threads(previous)


def _seed(stochastic: bool) -> torch.Tensor | None:
    return torch.tensor([(3 << 32) + 5], dtype=torch.int64) if stochastic else None


@pytest.mark.parametrize(("dtype", "shape"), BLOCK_CASES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=["nearest", "decay-maximize-sr"])
def test_block_step_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int], variant: tuple) -> None:
    torch.manual_seed(hash((str(dtype), shape)) % 2**31)
    blocks, period = shape
    weight_decay, maximize, stochastic = variant
    grad = torch.randn(blocks * period, dtype=dtype)
    codebook = shared_codebook()
    state = random_state((blocks * period,), period, dtype, "cpu", factored=False)
    compare_block_step(
        cpu_ops.block_step,
        state,
        grad,
        codebook,
        steps=2,
        weight_decay=weight_decay,
        maximize=maximize,
        sr_seed=_seed(stochastic),
        exact=True,
    )


@pytest.mark.parametrize(("dtype", "shape"), FACTORED_CASES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS, ids=["nearest", "decay-maximize-sr"])
def test_factored_step_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int, int], variant: tuple) -> None:
    torch.manual_seed(hash((str(dtype), shape)) % 2**31)
    rows, cols, period = shape
    weight_decay, maximize, stochastic = variant
    grad = torch.randn(rows, cols, dtype=dtype)
    codebook = shared_codebook()
    state = random_state((rows, cols), period, dtype, "cpu", factored=True)
    compare_factored_step(
        cpu_ops.factored_stats,
        cpu_ops.factored_step,
        state,
        grad,
        codebook,
        steps=2,
        weight_decay=weight_decay,
        maximize=maximize,
        sr_seed=_seed(stochastic),
        exact=True,
    )


@pytest.mark.parametrize(("dtype", "shape"), FACTORED_CASES, ids=str)
def test_factored_moments_match_the_reference(dtype: torch.dtype, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(hash((str(dtype), shape, "moments")) % 2**31)
    rows, cols, _ = shape
    compare_factored_moments(cpu_ops.factored_moments, torch.randn(rows, cols, dtype=dtype), steps=3)


def test_factored_moments_keep_an_all_zero_column_mean_at_the_floor() -> None:
    """All-zero moments: the column mean is clamped to FLT_MIN, as in the reference (no 0/0)."""
    grad = torch.zeros(4, 6)
    v_row, v_col = torch.zeros(4), torch.zeros(6)
    sc = scalars("cpu", step=1, weight_decay=0.0, factored=True)
    row_factor = cpu_ops.factored_moments([grad], [v_row], [v_col], sc, deterministic=True)
    assert torch.equal(row_factor, torch.zeros(4)) and torch.equal(v_col, torch.zeros(6))


def test_one_statistics_call_sums_every_gradient_as_the_reference() -> None:
    torch.manual_seed(17)
    compare_stats_list(cpu_ops.factored_stats, "cpu")


@pytest.mark.parametrize("maximize", [False, True], ids=["minimize", "maximize"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_element_step_matches_the_reference_bit_for_bit(stochastic: bool, maximize: bool) -> None:
    """Adam's per-element v advanced inside the kernel: every dtype, an empty entry, blocks longer
    than the momentum buffer (the second pass recomputes the denominators from the advanced v)."""
    torch.manual_seed(13)
    compare_element_steps(cpu_ops.element_step, "cpu", stochastic=stochastic, maximize=maximize)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_one_call_steps_many_tensors_as_the_reference_steps_each(stochastic: bool) -> None:
    """The list ops: small entries run one per thread, large ones split over threads, mixed
    dtypes, per-entry scalar rows and seeds; each entry as the reference's."""
    torch.manual_seed(11)
    compare_list_steps(
        cpu_ops.block_step, cpu_ops.factored_moments, cpu_ops.factored_step, "cpu", stochastic=stochastic
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0, 4), (1, 1), (37, 11), (3, 5000)], ids=str)
def test_histogram_counts_equal_the_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(7)
    blocks, period = shape
    grad = torch.randn(blocks * period, dtype=dtype) * torch.rand(blocks * period, dtype=dtype)
    if grad.numel() > 3:
        grad[:period] = 0  # an all-zero block
    compare_histogram(cpu_ops.histogram, grad, period)


def test_histogram_of_one_block_longer_than_any_tensor_counts_every_element() -> None:
    """A period near ``INT64_MAX`` is one (ragged) block: ``numel + period - 1`` overflowed the
    C kernel's block count (no block counted)."""
    grad = torch.randn(10, generator=torch.Generator().manual_seed(3))
    for period in (2**62, 2**63 - 1):
        compare_histogram(cpu_ops.histogram, grad, period)


def test_uniforms_equal_the_pinned_hash() -> None:
    index = torch.tensor([0, 1, 2, 1000, 2**31 + 5], dtype=torch.int64)
    got = cpu_ops.stochastic_uniform(torch.tensor([0], dtype=torch.int64), index)
    assert [int(v * 2**24) for v in got.tolist()] == [14819496, 7239838, 443485, 2947631, 1177231]
    many = torch.arange(-5, 100_000, 7, dtype=torch.int64)
    for seed in (0, 1, (7 << 32) | 3, -(2**63) + 12345):
        expected = splitmix_uniform(torch.tensor([seed], dtype=torch.int64), many)
        assert torch.equal(cpu_ops.stochastic_uniform(torch.tensor([seed], dtype=torch.int64), many), expected)


def test_the_kernel_reads_whatever_codebook_it_is_given() -> None:
    """The per-thread lookup table is rebuilt when the codebook changes (no stale table)."""
    torch.manual_seed(3)
    grad = torch.randn(8 * 32)
    first = shared_codebook()
    second = shared_codebook("cubed")
    for codebook in (first, second, first):
        state = random_state((8 * 32,), 32, torch.float32, "cpu", factored=False)
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


def test_the_registered_cpu_kernel_refuses_malformed_arguments_by_name() -> None:
    load_kernel_plugins()
    param = torch.zeros(12)
    indices = torch.zeros(3, 4, dtype=torch.uint8)
    block = torch.zeros(3, 1)
    codebook = torch.linspace(-1, 1, 256)
    scalars = torch.zeros(9)
    flags = {"apply_decay": False, "maximize": False, "deterministic": False}
    block_step = torch.ops.gefen.block_step.v4
    block_step([param], [param.clone()], [indices], [block], [block.clone()], codebook, scalars, None, **flags)
    with pytest.raises(KernelArgumentError, match=r"entry 0: indices must be torch\.uint8"):
        block_step(
            [param], [param.clone()], [indices.float()], [block], [block.clone()], codebook, scalars, None, **flags
        )
    with pytest.raises(KernelArgumentError, match="entry 1: param and grad must be contiguous"):
        strided = torch.zeros(24)[::2]
        block_step(
            [param, strided], [param, param], [indices] * 2, [block] * 2, [block] * 2, codebook, scalars, None, **flags
        )
    with pytest.raises(KernelArgumentError, match="entry 1: its tensors are not all on cpu"):
        meta = [t.to("meta") for t in (param, param, indices, block, block)]
        cpu_ops.block_step(
            [param, meta[0]], [param, meta[1]], [indices, meta[2]], [block, meta[3]], [block, meta[4]],
            codebook, scalars, None, **flags,
        )  # fmt: skip
    with pytest.raises(KernelArgumentError, match="entry 1: param and grad must be tensors"):
        lists = ([param, param], [param, None], [indices] * 2, [block] * 2, [block] * 2)
        cpu_ops.block_step(*lists, codebook, scalars, None, **flags)  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="lists differ in length"):
        block_step([param], [param, param], [indices], [block], [block], codebook, scalars, None, **flags)
    with pytest.raises(KernelArgumentError, match=r"with a period >= 1, got \(3, 0\)"):  # the reference raises too
        empty = torch.zeros(0)
        codes, scales = torch.zeros(3, 0, dtype=torch.uint8), torch.zeros(3, 1)
        block_step([empty], [empty.clone()], [codes], [scales], [scales.clone()], codebook, scalars, None, **flags)
    # the element and Muon paths' one-pass entry tests let period 0 through to C, which wrote a
    # zero scale for every "block" of an empty parameter
    empty2d, no_period = torch.zeros(0, 4), torch.zeros(5, 0, dtype=torch.uint8)
    with pytest.raises(KernelArgumentError, match=r"period >= 1"):
        torch.ops.gefen.element_step.v2(
            [empty2d], [empty2d.clone()], [no_period], [torch.ones(5, 1)], [empty2d.clone()], codebook, scalars, None,
            **flags,
        )  # fmt: skip
    with pytest.raises(KernelArgumentError, match=r"period >= 1"):
        torch.ops.gefen.muon_momentum.v3(
            [empty2d], [no_period], [torch.ones(5)], codebook, torch.tensor([0.9, 0.1]), None, [torch.empty(0, 4)],
            nesterov=False, deterministic=True,
        )  # fmt: skip
    with pytest.raises(KernelArgumentError, match=r"period must be an int in \[1, 2\*\*63\)"):  # C's int64 wrapped it
        cpu_ops.histogram([torch.ones(8)], [2**64 + 3], torch.zeros(4096, dtype=torch.int64), deterministic=True)
    for seeds in (torch.zeros(2, dtype=torch.int64), torch.zeros((), dtype=torch.int64)):  # a 0-dim one too
        with pytest.raises(KernelArgumentError, match=r"sr_seeds must have shape \(1,\), one seed per entry"):
            block_step([param], [param.clone()], [indices], [block], [block.clone()], codebook, scalars, seeds, **flags)
    with pytest.raises(KernelArgumentError, match=r"scalars must have shape \(9,\) or \(1, 9\)"):
        block_step(
            [param], [param.clone()], [indices], [block], [block.clone()], codebook, torch.zeros(2, 9), None, **flags
        )
    element_step = torch.ops.gefen.element_step.v2
    v = torch.zeros(12)
    element_step([param], [param.clone()], [indices], [block], [v], codebook, scalars, None, **flags)
    with pytest.raises(KernelArgumentError, match=r"entry 0: v must have the parameter's shape \(12,\)"):
        element_step([param], [param.clone()], [indices], [block], [block.clone()], codebook, scalars, None, **flags)
    with pytest.raises(KernelArgumentError, match=r"entry 0: indices must be \[blocks, period\] with 12 elements"):
        wide = torch.zeros(4, 4, dtype=torch.uint8)
        element_step([param], [param.clone()], [wide], [torch.zeros(4, 1)], [v], codebook, scalars, None, **flags)
    with pytest.raises(KernelArgumentError, match="entry 1: grad must be a contiguous 2-D tensor"):
        cpu_ops.factored_stats([torch.ones(2, 3), torch.ones(2, 3, 4)], deterministic=False)
    with pytest.raises(KernelArgumentError, match="bool"):
        cpu_ops.factored_stats([torch.ones(2, 3)], deterministic=1)  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="CPU tensors"):
        cpu_ops.factored_stats([torch.ones(2, 3, device="meta")], deterministic=False)
    with pytest.raises(KernelArgumentError, match="entry 1: grad is on meta, not on cpu"):
        cpu_ops.factored_stats([torch.ones(2, 3), torch.ones(2, 3, device="meta")], deterministic=False)
    with pytest.raises(KernelArgumentError, match="grads must be a list of tensors"):
        cpu_ops.factored_stats(torch.ones(2, 3), deterministic=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0, 4, 4), (3, 5, 5), (16, 48, 48), (6, 10, 4), (2, 4100, 8200)], ids=str)
@pytest.mark.parametrize(
    "variant", [(torch.bfloat16, True, False), (torch.float32, False, True)], ids=["bf16-nesterov", "fp32-sr"]
)
def test_muon_momentum_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int, int], variant: tuple) -> None:
    torch.manual_seed(5)
    rows, cols, period = shape
    out_dtype, nesterov, stochastic = variant
    grad = torch.randn(rows, cols, dtype=dtype)
    compare_muon_momentum(
        cpu_ops.muon_momentum,
        grad,
        period,
        shared_codebook(),
        out_dtype=out_dtype,
        nesterov=nesterov,
        sr_seed=_seed(stochastic),
        exact=True,
    )


def test_one_muon_momentum_call_steps_many_matrices_as_the_reference_does() -> None:
    torch.manual_seed(13)
    compare_muon_list(cpu_ops.muon_momentum, "cpu")


@pytest.mark.parametrize(
    ("numel", "dtype"), [(2 * 2048 + 37, torch.float32), (3, torch.bfloat16), (40_000, torch.float16)]
)
def test_a_ragged_last_block_steps_and_counts_as_the_reference(numel: int, dtype: torch.dtype) -> None:
    """Blocks of 2048 over a size 2048 does not divide: the last block is shorter (its codes'
    row padded), bit for bit as the reference, with stochastic rounding and decay."""
    torch.manual_seed(numel)
    grad = torch.randn(numel, dtype=dtype)
    state = random_state((numel,), 2048, dtype, "cpu", factored=False)
    compare_block_step(
        cpu_ops.block_step,
        state,
        grad,
        shared_codebook(),
        steps=2,
        weight_decay=0.1,
        maximize=True,
        sr_seed=_seed(True),
        exact=True,
    )
    grad[-min(numel, 5) :] = 0  # an all-zero ragged block when it is short
    compare_histogram(cpu_ops.histogram, grad, 2048)


def _same_or_both_nan(expected: torch.Tensor, got: torch.Tensor) -> bool:
    a, b = expected.reshape(-1).float(), got.reshape(-1).float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", ["block", "factored"])
def test_a_non_finite_gradient_steps_as_the_reference(value: float, path: str) -> None:
    """One non-finite gradient element: the kernel's vector loops (whose NaN flags and maxima
    the finite cases do not test) leave what the reference leaves, NaN where it has NaN."""
    torch.manual_seed(5)
    factored = path == "factored"
    shape = (8, 64) if factored else (256,)
    grad = torch.randn(shape)
    grad.view(-1)[197] = value
    state = random_state(shape, 64, torch.float32, "cpu", factored=factored)
    ref, mine = state.clone(), state.clone()
    sc = scalars("cpu", step=2, weight_decay=0.0, factored=factored)
    flags = {"apply_decay": False, "maximize": False, "deterministic": True}
    if factored:
        rows, cols = factored_stats_reference([grad], deterministic=True)
        got_rows, got_cols = cpu_ops.factored_stats([grad], deterministic=True)
        assert _same_or_both_nan(rows, got_rows) and _same_or_both_nan(cols, got_cols), "statistics differ"
        row_factor = update_factored_moments(ref.second[0], ref.second[1], rows, cols, shape[0], sc)
        common = ([row_factor], [ref.second[1]], shared_codebook(), sc, None)
        factored_step_reference([ref.param], [grad], [ref.indices], [ref.magnitude], *common, **flags)
        cpu_ops.factored_step([mine.param], [grad], [mine.indices], [mine.magnitude], *common, **flags)
    else:
        common_block = (shared_codebook(), sc, None)
        block_step_reference(
            [ref.param], [grad], [ref.indices], [ref.magnitude], ref.second[:1], *common_block, **flags
        )
        cpu_ops.block_step(
            [mine.param], [grad], [mine.indices], [mine.magnitude], mine.second[:1], *common_block, **flags
        )
        assert _same_or_both_nan(ref.second[0], mine.second[0]), "second moments differ"
    assert torch.equal(ref.indices, mine.indices), "codes differ"
    assert _same_or_both_nan(ref.magnitude, mine.magnitude), "block scales differ"
    assert _same_or_both_nan(ref.param, mine.param), "parameters differ"


def _histograms() -> list[torch.Tensor]:
    """Occupancies across the few-points rule's edge (253 free codewords), weights small
    (ties), mid and large (segment sums beyond 2^53, the int64 path), tie-heavy shapes, and
    histograms with one side of zero empty or nearly so (the split of the free codewords)."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for occupied in (1, 2, 5, 252, 253, 254, 255, 256, 1000, 4096):
        for high in (2, 1000, 10**7):  # (10**7 x 4096 bins: sums beyond 2^53)
            counts = torch.zeros(4096, dtype=torch.int64)
            bins = torch.randperm(4096, generator=generator)[:occupied]
            counts[bins] = torch.randint(1, high, (occupied,), generator=generator)
            cases.append(counts)
    every_seventh = torch.zeros(4096, dtype=torch.int64)
    every_seventh[::7] = 5
    ends_and_zero = torch.zeros(4096, dtype=torch.int64)
    ends_and_zero[[0, 2048, 4095]] = torch.tensor([1, 10, 1])
    one_sided = []
    for negatives in (0, 1, 3, 300):
        counts = torch.zeros(4096, dtype=torch.int64)
        counts[2048:] = torch.randint(0, 50, (2048,), generator=generator)
        counts[2048 - negatives : 2048] = 7
        one_sided += [counts, counts.flip(0)]
    return [*cases, every_seventh, torch.ones(4096, dtype=torch.int64), ends_and_zero, *one_sided]


def test_the_codebook_solve_equals_the_reference_bit_for_bit() -> None:
    from gefen_core.exact_dp import codebook_solve_reference

    load_kernel_plugins()
    solve = torch.ops.gefen.codebook_solve.v2
    assert torch._C._dispatch_has_kernel_for_dispatch_key("gefen::codebook_solve.v2", "CPU")
    for counts in _histograms():
        codebook = cpu_ops.codebook_solve(counts)
        assert codebook.dtype is torch.float64 and codebook.shape == (256,)
        assert torch.equal(codebook, codebook_solve_reference(counts)), int((counts > 0).sum())
        assert torch.equal(solve(counts), codebook)  # the dispatcher runs the kernel
    for bad, reason in (
        (torch.zeros(4096, dtype=torch.int32), "counts must be torch.int64"),
        (torch.zeros(4095, dtype=torch.int64), r"counts must have shape \(4096,\)"),
        (torch.zeros(4096, dtype=torch.int64), "the histogram is empty"),
        (torch.full((4096,), -1, dtype=torch.int64), "counts must not be negative"),
        (torch.full((4096,), 2**50, dtype=torch.int64), "too large for exact int64 sums"),
    ):
        with pytest.raises(KernelArgumentError, match=reason):
            cpu_ops.codebook_solve(bad)

"""Shared cases and tolerances of the kernel-vs-reference parity tests (tests/test_kernels_*).

Tolerances (the issue's): codebook indices equal except adjacent-codeword ties (at most
1e-4 of the elements, and never more than one code apart), ``v`` and block scales within
1 ulp, parameters within 2 ulp per step. ULPs are counted in the parameter dtype, except
for fp64 parameters, whose update is computed in fp32 and which are compared in fp32.
One step is compared at a time from identical states, so differences never accumulate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gefen_core import step_scalars
from gefen_core.codebook import codebook_from_counts
from gefen_core.reference_ops import (
    block_step_reference,
    element_step_reference,
    factored_moments_reference,
    factored_stats_reference,
    factored_step_reference,
    histogram_reference,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_TIE_FRACTION = 1e-4


@functools.cache
def shared_codebook(kind: str = "gaussian") -> torch.Tensor:
    """A learned codebook, solved once per process (the exact solve takes a few tenths of a second)."""
    generator = torch.Generator().manual_seed(1234)
    sample = torch.randn(8192, generator=generator)
    return learned_codebook(sample if kind == "gaussian" else sample**3, 64)


def learned_codebook(grad: torch.Tensor, period: int) -> torch.Tensor:
    """The codebook Gefen would learn from ``grad`` (a real, non-uniform one)."""
    counts = torch.zeros(4096, dtype=torch.int64)
    histogram_reference([grad.cpu()], [period], counts, deterministic=False)
    codebook = codebook_from_counts(counts)
    assert codebook is not None
    return codebook.to(grad.device)


def with_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A random gradient with every fifth element exactly zero (nearest rounding settles some of
    those elements, ``gefen_core.reference_ops.requantized_momentum``, a branch of every kernel)
    and, for a 16-bit dtype, every eleventh a subnormal (not zero: Triton's interpreter once
    converted bf16 subnormals to 0)."""
    grad = torch.randn(shape, dtype=dtype, device=device)
    grad.view(-1)[::5] = 0
    if torch.finfo(dtype).bits == 16:
        grad.view(-1)[1::11] = torch.finfo(dtype).tiny / 4
    return grad


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between equal-shaped float tensors."""
    if a.numel() == 0:
        return 0
    dtype = torch.float32 if a.dtype is torch.float64 else a.dtype
    x, y = a.to(dtype).cpu(), b.to(dtype).cpu()
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    xi, yi = x.view(bits).to(torch.int64), y.view(bits).to(torch.int64)
    sign = 1 << (torch.iinfo(bits).bits - 1)
    # map the sign-magnitude float order onto integers
    xi = torch.where(xi < 0, -(xi + sign), xi)
    yi = torch.where(yi < 0, -(yi + sign), yi)
    return int((xi - yi).abs().max())


def assert_params_close(before: torch.Tensor, expected: torch.Tensor, got: torch.Tensor, ulps: int = 2) -> None:
    """``|got - expected| <= ulps`` units in the last place of the step's larger operand.

    The step is ``p - d``: when the result nearly cancels, one ulp of ``d`` is many ulps of
    the result, so the unit is taken at ``max(|p before|, |p after|)`` (fp64 parameters in
    fp32 units, since their update is computed in fp32).
    """
    if expected.numel() == 0:
        return
    dtype = torch.float32 if expected.dtype is torch.float64 else expected.dtype
    info = torch.finfo(dtype)
    scale = torch.maximum(before.double().abs(), expected.double().abs()).clamp_min(info.tiny)
    unit = torch.exp2(torch.floor(torch.log2(scale))) * info.eps
    excess = (got.double() - expected.double()).abs() - ulps * unit
    worst = float(excess.max())
    assert worst <= 0.0, f"parameters differ by more than {ulps} ulp (by {worst:.3g} beyond it)"


def assert_indices_close(expected: torch.Tensor, got: torch.Tensor) -> None:
    diff = (expected.to(torch.int32) - got.to(torch.int32)).abs().cpu()
    if diff.numel() == 0:
        return
    assert int(diff.max()) <= 1, "indices differ by more than one codeword"
    assert int((diff > 0).sum()) <= max(1, int(MAX_TIE_FRACTION * expected.numel())), "too many index ties"


@dataclass
class MomentumState:
    param: torch.Tensor
    indices: torch.Tensor
    magnitude: torch.Tensor
    second: list[torch.Tensor]  # [vmean] (block) or [v_row, v_col] (factored)

    def clone(self) -> MomentumState:
        return MomentumState(
            self.param.clone(), self.indices.clone(), self.magnitude.clone(), [t.clone() for t in self.second]
        )


def random_state(shape: tuple[int, ...], period: int, dtype: torch.dtype, device: str, factored: bool) -> MomentumState:
    numel = 1
    for size in shape:
        numel *= size
    blocks = -(-numel // period) if period else 0  # the block path's last block may be ragged
    param = torch.randn(shape, dtype=dtype, device=device)
    indices = torch.randint(0, 256, (blocks, period), dtype=torch.uint8, device=device)
    magnitude = torch.rand(blocks, 1, device=device) * 0.1
    if factored:
        second = [torch.rand(shape[0], device=device) * 1e-2, torch.rand(shape[1], device=device) * 1e-2]
    else:
        second = [torch.rand(blocks, 1, device=device) * 1e-2]
    return MomentumState(param, indices, magnitude, second)


def scalars(device: str, *, step: int, weight_decay: float, factored: bool) -> torch.Tensor:
    return step_scalars.host_scalars(
        torch.device(device),
        lr=3e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        step=step,
        age=step,
        factored=factored,
    )


StepOp = Callable[..., Any]


def update_factored_moments(
    v_row: torch.Tensor,
    v_col: torch.Tensor,
    row_sumsq: torch.Tensor,
    col_sumsq: torch.Tensor,
    rows: int,
    sc: torch.Tensor,
) -> torch.Tensor:
    """The factored second moment's small O(R + K) update, as documented in gefen-core (the
    kernels' input ``row_factor``; both sides receive the same one)."""
    beta2, one_minus_beta2, bc2 = sc[6], sc[7], sc[2]
    row_mean = (row_sumsq / float(v_col.numel())).to(torch.float32)
    col_mean = (col_sumsq / float(rows)).to(torch.float32)
    v_row.copy_(v_row * beta2 + row_mean * one_minus_beta2)
    v_col.copy_(v_col * beta2 + col_mean * one_minus_beta2)
    scale = (v_col.double().sum() / v_col.numel()).to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    return (v_row / scale) * bc2


def _flags(weight_decay: float, maximize: bool) -> dict[str, bool]:
    return {"apply_decay": weight_decay != 0.0, "maximize": maximize, "deterministic": False}


def compare_block_step(
    op: StepOp,
    state: MomentumState,
    grad: torch.Tensor,
    codebook: torch.Tensor,
    *,
    steps: int,
    weight_decay: float,
    maximize: bool,
    sr_seed: torch.Tensor | None,
    exact: bool = False,
) -> None:
    """Run ``steps`` steps of the reference and of ``op``, each from the reference's state, and compare.

    ``exact``: the kernel must reproduce the reference bit for bit (indices, block scales,
    and every parameter of a block whose ``v`` came out identical; ``v`` itself may differ
    by one ulp where the float64 sum of squares was added in another order).
    """
    ref = state.clone()
    flags = _flags(weight_decay, maximize)
    for step in range(1, steps + 1):
        sc = scalars(str(grad.device), step=step, weight_decay=weight_decay, factored=False)
        mine = ref.clone()
        before = ref.param.clone()
        common = (codebook, sc, sr_seed)
        block_step_reference([ref.param], [grad], [ref.indices], [ref.magnitude], ref.second[:1], *common, **flags)
        op([mine.param], [grad], [mine.indices], [mine.magnitude], mine.second[:1], *common, **flags)
        _assert_states(before, ref, mine)
        if exact:
            _assert_exact_block_states(ref, mine)
        grad = grad.roll(1)  # a different gradient for the next step


def compare_factored_step(
    stats_op: StepOp,
    step_op: StepOp,
    state: MomentumState,
    grad: torch.Tensor,
    codebook: torch.Tensor,
    *,
    steps: int,
    weight_decay: float,
    maximize: bool,
    sr_seed: torch.Tensor | None,
    exact: bool = False,
) -> None:
    """Both phases of the factored update against the reference, one step at a time.

    ``exact``: phase 2 (which gets the reference's statistics) must reproduce the reference
    bit for bit.
    """
    ref = state.clone()
    flags = _flags(weight_decay, maximize)
    for step in range(1, steps + 1):
        sc = scalars(str(grad.device), step=step, weight_decay=weight_decay, factored=True)
        rows_ref, cols_ref = factored_stats_reference([grad], deterministic=False)
        rows_mine, cols_mine = stats_op([grad], deterministic=False)
        assert rows_mine.dtype is torch.float64 and cols_mine.dtype is torch.float64
        torch.testing.assert_close(rows_mine, rows_ref, rtol=1e-13, atol=0.0)
        torch.testing.assert_close(cols_mine, cols_ref, rtol=1e-13, atol=0.0)
        row_factor = update_factored_moments(ref.second[0], ref.second[1], rows_ref, cols_ref, grad.shape[0], sc)
        mine = ref.clone()
        before = ref.param.clone()
        common = ([row_factor], [ref.second[1]], codebook, sc, sr_seed)
        factored_step_reference([ref.param], [grad], [ref.indices], [ref.magnitude], *common, **flags)
        step_op([mine.param], [grad], [mine.indices], [mine.magnitude], *common, **flags)
        _assert_states(before, ref, mine)
        if exact:
            _assert_exact(ref, mine)
        grad = grad.roll(1, dims=1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _assert_exact(ref: MomentumState, mine: MomentumState) -> None:
    assert torch.equal(ref.indices, mine.indices), "indices differ"
    assert _same_bits(ref.magnitude, mine.magnitude), "block scales differ"
    for expected, got in zip(ref.second, mine.second):
        assert _same_bits(expected, got), "second moments differ"
    assert _same_bits(ref.param, mine.param), "params differ"


def _assert_exact_block_states(ref: MomentumState, mine: MomentumState) -> None:
    assert torch.equal(ref.indices, mine.indices), "indices differ"
    assert _same_bits(ref.magnitude, mine.magnitude), "block scales differ"
    blocks, period = ref.indices.shape
    same_v = (ref.second[0] == mine.second[0]).view(blocks)
    expected = _blocked(ref.param, blocks, period)[same_v]
    got = _blocked(mine.param, blocks, period)[same_v]
    assert _same_bits(expected, got), "params differ"


def _blocked(tensor: torch.Tensor, blocks: int, period: int) -> torch.Tensor:
    """``tensor`` as ``[blocks, period]`` rows, a ragged last row padded with zeros."""
    flat = tensor.reshape(-1)
    padding = blocks * period - flat.numel()
    return torch.cat([flat, flat.new_zeros(padding)]).view(blocks, period)


def _assert_states(before: torch.Tensor, ref: MomentumState, mine: MomentumState) -> None:
    assert_indices_close(ref.indices, mine.indices)
    assert ulp_distance(ref.magnitude, mine.magnitude) <= 1, "block scales differ by more than 1 ulp"
    for expected, got in zip(ref.second, mine.second):
        assert ulp_distance(expected, got) <= 1, "second moments differ by more than 1 ulp"
    assert_params_close(before, ref.param, mine.param)


def compare_histogram(op: StepOp, grad: torch.Tensor, period: int) -> None:
    """One gradient, then a list of it with a few others (dtypes, periods, an empty one, a
    ragged one) in one call: the counts equal the reference's exactly."""
    expected = torch.zeros(4096, dtype=torch.int64, device=grad.device)
    got = torch.zeros(4096, dtype=torch.int64, device=grad.device)
    histogram_reference([grad], [period], expected, deterministic=False)
    op([grad], [period], got, deterministic=False)
    assert torch.equal(expected, got)
    others = [torch.randn(5, 24, device=grad.device), torch.randn(0, device=grad.device)]
    others.append(torch.randn(70, dtype=torch.bfloat16, device=grad.device))
    grads, periods = [grad, *others, grad], [period, 24, 8, 32, period]
    histogram_reference(grads, periods, expected, deterministic=False)
    op(grads, periods, got, deterministic=False)
    assert torch.equal(expected, got)


def compare_muon_momentum(
    op: StepOp,
    grad: torch.Tensor,
    period: int,
    codebook: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    nesterov: bool,
    sr_seed: torch.Tensor | None,
    exact: bool = False,
) -> None:
    """``gefen::muon_momentum.v3`` (one entry) against the reference, two steps from the reference's state
    (``exact``: bit for bit)."""
    from gefen_core.muon_reference_ops import muon_momentum_reference

    device = grad.device
    blocks = grad.numel() // period
    indices = torch.randint(0, 256, (blocks, period), dtype=torch.uint8, device=device)
    magnitude = torch.rand(blocks, 1, device=device) * 0.1
    packet = step_scalars.muon_scalars(device, 0.95)
    for _ in range(2):
        expected = torch.empty(grad.shape, dtype=out_dtype, device=device)
        got = torch.empty(grad.shape, dtype=out_dtype, device=device)
        mine_indices, mine_magnitude = indices.clone(), magnitude.clone()
        flags = {"nesterov": nesterov, "deterministic": False}
        muon_momentum_reference([grad], [indices], [magnitude], codebook, packet, sr_seed, [expected], **flags)
        op([grad], [mine_indices], [mine_magnitude], codebook, packet, sr_seed, [got], **flags)
        assert_indices_close(indices, mine_indices)
        assert ulp_distance(magnitude, mine_magnitude) <= 1
        assert ulp_distance(expected, got) <= 1
        if exact:
            assert torch.equal(indices, mine_indices), "indices differ"
            assert _same_bits(magnitude, mine_magnitude), "block scales differ"
            assert _same_bits(expected, got), "outputs differ"
        grad = grad.roll(1, dims=1)


def compare_factored_moments(op: StepOp, grad: torch.Tensor, *, steps: int) -> None:
    """``gefen::factored_moments.v3`` against the reference, one step at a time from equal moments:
    ``v_row``/``v_col`` bit for bit; ``row_factor`` within 1 ulp (the float64 mean of ``v_col``
    may be summed in another order), and bit for bit wherever that mean agrees."""
    rows, cols = grad.shape
    ref_row = torch.rand(rows, device=grad.device) * 1e-2
    ref_col = torch.rand(cols, device=grad.device) * 1e-2
    for step in range(1, steps + 1):
        sc = scalars(str(grad.device), step=step, weight_decay=0.0, factored=True)
        mine_row, mine_col = ref_row.clone(), ref_col.clone()
        expected = factored_moments_reference([grad], [ref_row], [ref_col], sc, deterministic=False)
        got = op([grad], [mine_row], [mine_col], sc, deterministic=False)
        assert got.dtype is torch.float32 and tuple(got.shape) == (rows,)
        assert _same_bits(ref_row, mine_row), "v_row differs"
        assert _same_bits(ref_col, mine_col), "v_col differs"
        assert ulp_distance(expected, got) <= 1, "row_factor differs by more than 1 ulp"
        grad = grad.roll(1, dims=1)


#: Entries of one list call: small ones (spread over threads) and large ones (each split over
#: threads), mixed dtypes, an empty one: (shape, period, dtype).
LIST_ENTRIES = [
    ((8, 16), 16, torch.float32),
    ((0, 4), 4, torch.float32),
    ((33, 64), 64, torch.bfloat16),
    ((256, 160), 160, torch.float32),
    ((5, 7), 35, torch.float64),
    ((64, 1024), 512, torch.float16),
]
#: Block-path entries whose last block is ragged: (shape, period, dtype).
RAGGED_ENTRIES = [
    ((2 * 2048 + 37,), 2048, torch.float32),
    ((3,), 2048, torch.bfloat16),
    ((5, 1001), 2048, torch.float64),
    ((40_000,), 2048, torch.float16),
]


def compare_list_steps(
    block_op: StepOp,
    moments_op: StepOp,
    step_op: StepOp,
    device: str,
    *,
    stochastic: bool,
    entries: list[Any] | None = None,
    ragged: list[Any] | None = None,
) -> None:
    """One call of each list op over ``entries`` (default :data:`LIST_ENTRIES`; the block op also
    over ``ragged``, default :data:`RAGGED_ENTRIES`), with per-entry scalars (counters that
    differ) and seeds, against the reference list ops: every entry as the reference's, bit for
    bit where the single-entry tests demand it."""
    entries = LIST_ENTRIES if entries is None else entries
    ragged = RAGGED_ENTRIES if ragged is None else ragged
    codebook = shared_codebook().to(device)
    states = [random_state(shape, period, dtype, device, factored=True) for shape, period, dtype in entries]
    blocks = [random_state(shape, period, dtype, device, factored=False) for shape, period, dtype in entries]
    grads = [with_zeros(shape, dtype, device) for shape, _, dtype in entries]
    rows = [scalars(device, step=index + 1, weight_decay=0.1, factored=True) for index in range(len(grads))]
    sc = torch.stack(rows)
    seeds = torch.arange(len(grads), dtype=torch.int64, device=device) + (9 << 32) if stochastic else None
    flags = _flags(0.1, False)
    mine_moments = [s.clone() for s in states]
    heights = [grad.shape[0] for grad in grads]
    expected = factored_moments_reference(
        grads, [s.second[0] for s in states], [s.second[1] for s in states], sc, deterministic=False
    ).split(heights)
    expected = list(expected)
    got = moments_op(
        grads, [s.second[0] for s in mine_moments], [s.second[1] for s in mine_moments], sc, deterministic=False
    ).split(heights)
    for ref, mine, want, have in zip(states, mine_moments, expected, got, strict=True):
        assert _same_bits(ref.second[0], mine.second[0]) and _same_bits(ref.second[1], mine.second[1])
        assert ulp_distance(want, have) <= 1
    mine_states = [s.clone() for s in states]
    befores = [s.param.clone() for s in states]
    common = (expected, [s.second[1] for s in states], codebook, sc, seeds)
    factored_step_reference(
        [s.param for s in states], grads, [s.indices for s in states], [s.magnitude for s in states], *common, **flags
    )
    mine_args = (
        [s.param for s in mine_states],
        grads,
        [s.indices for s in mine_states],
        [s.magnitude for s in mine_states],
    )
    step_op(*mine_args, *common, **flags)
    for before, ref, mine in zip(befores, states, mine_states, strict=True):
        _assert_exact(ref, mine)
        _assert_states(before, ref, mine)
    blocks += [random_state(shape, period, dtype, device, factored=False) for shape, period, dtype in ragged]
    grads += [with_zeros(shape, dtype, device) for shape, _, dtype in ragged]
    if seeds is not None:
        seeds = torch.arange(len(grads), dtype=torch.int64, device=device) + (9 << 32)
    mine_blocks = [s.clone() for s in blocks]
    befores = [s.param.clone() for s in blocks]
    shared = scalars(device, step=3, weight_decay=0.1, factored=False)
    for states_, op in ((blocks, block_step_reference), (mine_blocks, block_op)):
        op(
            [s.param for s in states_],
            grads,
            [s.indices for s in states_],
            [s.magnitude for s in states_],
            [s.second[0] for s in states_],
            codebook,
            shared,
            seeds,
            **flags,
        )
    for before, ref, mine in zip(befores, blocks, mine_blocks, strict=True):
        _assert_exact_block_states(ref, mine)
        _assert_states(before, ref, mine)


def compare_muon_list(op: StepOp, device: str, entries: list[Any] | None = None) -> None:
    """One ``gefen::muon_momentum.v3`` call over matrices of mixed dtypes and sizes (default: an
    empty one, small ones spread over threads, a large one split; five entries), per-entry
    momentum rows and seeds, bf16 and fp32 outputs: every entry bit for bit as the reference's."""
    from gefen_core.muon_reference_ops import muon_momentum_reference

    shapes = [((8, 16), 16, torch.float32), ((0, 4), 4, torch.float32), ((33, 64), 64, torch.bfloat16)]
    shapes += [((256, 160), 160, torch.float16), ((5, 7), 35, torch.float64)]
    shapes = shapes if entries is None else entries
    codebook = shared_codebook().to(device)
    grads = [with_zeros(shape, dtype, device) for shape, _, dtype in shapes]
    codes = [
        torch.randint(0, 256, (g.numel() // p if p else 0, p), dtype=torch.uint8, device=device)
        for g, (_, p, _) in zip(grads, shapes)
    ]
    scales = [torch.rand(c.shape[0], 1, device=device) * 0.1 for c in codes]
    packet = torch.stack(
        [step_scalars.muon_scalars(torch.device(device), beta) for beta in (0.9, 0.95, 0.8, 0.99, 0.5)]
    )
    seeds = torch.arange(len(grads), dtype=torch.int64, device=device) + (11 << 32)
    out_dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    for nesterov, sr in ((True, None), (False, seeds)):
        expected = [torch.empty(g.shape, dtype=d, device=device) for g, d in zip(grads, out_dtypes)]
        got = [torch.empty(g.shape, dtype=d, device=device) for g, d in zip(grads, out_dtypes)]
        mine_codes, mine_scales = [c.clone() for c in codes], [m.clone() for m in scales]
        flags = {"nesterov": nesterov, "deterministic": False}
        muon_momentum_reference(grads, codes, scales, codebook, packet, sr, expected, **flags)
        op(grads, mine_codes, mine_scales, codebook, packet, sr, got, **flags)
        for index in range(len(grads)):
            assert torch.equal(codes[index], mine_codes[index]), f"entry {index}: indices differ"
            assert _same_bits(scales[index], mine_scales[index]), f"entry {index}: block scales differ"
            assert _same_bits(expected[index], got[index]), f"entry {index}: outputs differ"


#: Element-path entries (Adam's per-element ``v``): (shape, period, dtype); blocks tile the
#: parameter, one longer than the C kernel's momentum buffer (4096), one empty.
ELEMENT_ENTRIES = [
    ((8, 16), 16, torch.float32),
    ((0, 4), 4, torch.float32),
    ((33, 64), 64, torch.bfloat16),
    ((5, 7), 35, torch.float64),
    ((64, 96), 96, torch.float16),
    ((3, 5000), 5000, torch.float32),
]


def compare_element_steps(
    op: StepOp, device: str, *, stochastic: bool, maximize: bool, entries: list[Any] | None = None
) -> None:
    """Two calls of ``gefen::element_step.v2`` over ``entries`` (default :data:`ELEMENT_ENTRIES`)
    in one list, per-entry scalar rows (counters that differ) and seeds, against the reference:
    codes, block scales, ``v`` and parameters bit for bit (no reduction order to differ in)."""
    entries = ELEMENT_ENTRIES if entries is None else entries
    codebook = shared_codebook().to(device)
    states = []
    for shape, period, dtype in entries:
        state = random_state(shape, period, dtype, device, factored=False)
        state.second = [torch.rand(shape, device=device) * 1e-2]
        states.append(state)
    mine = [state.clone() for state in states]
    seeds = torch.arange(len(states), dtype=torch.int64, device=device) + (5 << 32) if stochastic else None
    flags = _flags(0.1, maximize)
    for step in (1, 2):
        grads = [with_zeros(shape, dtype, device) for shape, _, dtype in entries]
        rows = [scalars(device, step=step + index, weight_decay=0.1, factored=True) for index in range(len(states))]
        sc = torch.stack(rows)
        for states_, run in ((states, element_step_reference), (mine, op)):
            run(
                [s.param for s in states_],
                grads,
                [s.indices for s in states_],
                [s.magnitude for s in states_],
                [s.second[0] for s in states_],
                codebook,
                sc,
                seeds,
                **flags,
            )
        for ref, got in zip(states, mine, strict=True):
            _assert_exact(ref, got)


def compare_stats_list(op: StepOp, device: str) -> None:
    """One ``gefen::factored_stats.v2`` call over gradients of mixed dtypes and shapes (an empty
    one, one row, a wide one): every entry's row and column sums, concatenated in entry order,
    as the reference's (float64 sums in another order: within 1e-13 relative)."""
    shapes = [((8, 16), torch.float32), ((0, 4), torch.float32), ((33, 64), torch.bfloat16)]
    shapes += [((1, 300), torch.float16), ((5, 7), torch.float64), ((3, 0), torch.float32)]
    grads = [torch.randn(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    rows_ref, cols_ref = factored_stats_reference(grads, deterministic=False)
    rows, cols = op(grads, deterministic=False)
    assert rows.dtype is torch.float64 and cols.dtype is torch.float64
    assert rows.shape == (sum(g.shape[0] for g in grads),) and cols.shape == (sum(g.shape[1] for g in grads),)
    torch.testing.assert_close(rows, rows_ref, rtol=1e-13, atol=0.0)
    torch.testing.assert_close(cols, cols_ref, rtol=1e-13, atol=0.0)
    empty_rows, empty_cols = op([], deterministic=False)
    assert empty_rows.numel() == 0 and empty_cols.numel() == 0

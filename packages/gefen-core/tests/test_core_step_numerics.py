"""The update rule: hand computations, float64 references, dtypes and odd parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gefen_core import Gefen
from gefen_core.exact_dp import histogram_points, solve_pinned_codebook
from gefen_core.param_state import period_of
from gefen_core.step_scalars import device_scalars, host_scalars
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone().to(p.dtype)
    opt.step()


def _decode(opt: Gefen, p: torch.Tensor) -> torch.Tensor:
    state = opt.state[p]
    codebook = opt.codebook
    assert codebook is not None
    return (codebook[state["m_codes"].long()] * state["m_magnitude"]).double()


def test_first_block_step_matches_the_hand_computation() -> None:
    torch.manual_seed(1)
    grad = torch.randn(64)
    p = torch.nn.Parameter(torch.randn(64))
    before = p.detach().double().clone()
    lr, eps = 0.01, 1e-8
    opt = Gefen([p], lr=lr, eps=eps, weight_decay=0.0, fused=False)
    _step(opt, [p], [grad])
    assert period_of(opt.state[p]) == 64  # one block: the fallback keeps small vectors whole
    g = grad.double()
    z = (g / g.abs().max()).numpy()
    bins = np.clip(np.floor((z.astype(np.float32) + np.float32(1.0)) * np.float32(2048.0)), 0, 4095).astype(np.int64)
    counts = np.bincount(bins, minlength=4096)
    positions, weights, scale = histogram_points(counts)
    expected_codebook = solve_pinned_codebook(positions, weights, 256, scale=scale).codebook.astype(np.float32)
    assert opt.codebook is not None and np.array_equal(opt.codebook.numpy(), expected_codebook)
    codebook = torch.from_numpy(expected_codebook).double()
    nearest = (torch.from_numpy(z)[:, None] - codebook[None, :]).abs().argmin(dim=1)
    rms = g.square().mean().sqrt()
    expected = before - lr * codebook[nearest] * g.abs().max() / (rms + eps)
    torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=4e-7)  # fp32 rounding of p
    assert torch.equal(opt.state[p]["m_codes"].view(-1).long(), nearest)


def test_block_path_tracks_a_float64_reference() -> None:
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(8, 40))
    opt = Gefen([p], lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, factored_v_2d=False, fused=False)
    beta1, beta2, lr, eps, wd = 0.8, 0.95, 3e-3, 1e-6, 0.1
    vmean = None
    for t in range(1, 5):
        grad = torch.randn(8, 40) * (1 + t)
        prev = p.detach().double().clone()
        prev_m = _decode(opt, p).reshape(-1) if t > 1 else torch.zeros(320, dtype=torch.float64)
        _step(opt, [p], [grad])
        period = period_of(opt.state[p])
        g = grad.double().reshape(-1, period)
        block_mean = g.square().mean(dim=1, keepdim=True)
        vmean = (1 - beta2) * block_mean if vmean is None else beta2 * vmean + (1 - beta2) * block_mean
        torch.testing.assert_close(opt.state[p]["vmean"].double(), vmean, rtol=1e-6, atol=0)
        m = _decode(opt, p)
        denominator = vmean.sqrt() / (1 - beta2**t) ** 0.5 + eps
        unquantized = beta1 * prev_m.view(-1, period) + (1 - beta1) * g / denominator  # preconditioned EMA
        torch.testing.assert_close(m.abs().amax(dim=1), unquantized.abs().amax(dim=1), rtol=1e-6, atol=0)
        expected = prev.view(-1, period) * (1 - lr * wd) - lr * m / (1 - beta1**t)
        torch.testing.assert_close(p.detach().double().view(-1, period), expected, rtol=0, atol=1e-6)


def test_factored_equations_match_a_float64_reference() -> None:
    torch.manual_seed(3)
    rows, cols = 12, 20
    p = torch.nn.Parameter(torch.randn(rows, cols))
    beta1, beta2, lr, eps = 0.9, 0.99, 1e-2, 1e-8
    opt = Gefen(
        [p],
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=0.0,
        fused=False,
        clip_threshold=1.0,
        min_dim_size_to_factor=0,
    )
    r = torch.zeros(rows, dtype=torch.float64)
    c = torch.zeros(cols, dtype=torch.float64)
    prev_m = torch.zeros(rows, cols, dtype=torch.float64)
    clipped = False
    for t in range(1, 5):
        grad = torch.randn(rows, cols) * torch.linspace(0.5, 2.0, cols)
        prev = p.detach().double().clone()
        _step(opt, [p], [grad])
        g2 = grad.double().square()
        r = beta2 * r + (1 - beta2) * g2.mean(dim=1)
        c = beta2 * c + (1 - beta2) * g2.mean(dim=0)
        state = opt.state[p]
        assert state["factored_step"] == t and state["step"] == t
        torch.testing.assert_close(state["v_row"].double(), r, rtol=1e-6, atol=0)
        torch.testing.assert_close(state["v_col"].double(), c, rtol=1e-6, atol=0)
        estimate = torch.outer(r, c) / c.mean()
        denominator = (estimate / (1 - beta2**t)).sqrt() + eps
        m = _decode(opt, p).view(rows, cols)
        preconditioned = grad.double() / denominator
        kappa = max(1.0, float(preconditioned.square().mean().sqrt()))  # update clipping at clip_threshold=1
        unquantized = beta1 * prev_m + (1 - beta1) * preconditioned / kappa  # preconditioned EMA
        clipped = clipped or kappa > 1.0
        period = period_of(state)
        torch.testing.assert_close(
            m.view(-1, period).abs().amax(dim=1), unquantized.view(-1, period).abs().amax(dim=1), rtol=1e-6, atol=0
        )
        torch.testing.assert_close(p.detach().double(), prev - lr * m / (1 - beta1**t), rtol=0, atol=2e-6)
        prev_m = m
    assert clipped  # the clipping branch of the equations was exercised


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "kernel"])
def test_a_narrow_matrix_keeps_adams_per_element_v(fused: bool | None) -> None:
    """A 12 x 20 matrix is narrower than ``min_dim_size_to_factor`` (128): its ``v`` is Adam's,
    per element, and ``clip_threshold`` (a factored-matrix option) leaves it alone."""
    torch.manual_seed(4)
    rows, cols = 12, 20
    p = torch.nn.Parameter(torch.randn(rows, cols))
    beta1, beta2, lr, eps, wd = 0.9, 0.99, 1e-2, 1e-8, 0.05
    opt = Gefen([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd, fused=fused, clip_threshold=1.0)
    v = torch.zeros(rows, cols, dtype=torch.float64)
    prev_m = torch.zeros(rows, cols, dtype=torch.float64)
    for t in range(1, 5):
        grad = torch.randn(rows, cols) * torch.linspace(0.5, 2.0, cols) * (10.0 if t == 2 else 1.0)
        prev = p.detach().double().clone()
        _step(opt, [p], [grad])
        state = opt.state[p]
        assert sorted(state) == ["m_codes", "m_magnitude", "step", "v", "v_step"] and state["v_step"] == t
        v = beta2 * v + (1 - beta2) * grad.double().square()
        torch.testing.assert_close(state["v"].double(), v, rtol=1e-6, atol=0)
        m = _decode(opt, p).view(rows, cols)
        unquantized = beta1 * prev_m + (1 - beta1) * grad.double() / ((v / (1 - beta2**t)).sqrt() + eps)
        period = period_of(state)
        torch.testing.assert_close(
            m.view(-1, period).abs().amax(dim=1), unquantized.view(-1, period).abs().amax(dim=1), rtol=1e-6, atol=0
        )
        expected = prev * (1 - lr * wd) - lr * m / (1 - beta1**t)
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)
        prev_m = m


def test_maximize_equals_minimizing_the_negated_gradient() -> None:
    torch.manual_seed(4)
    a = torch.nn.Parameter(torch.randn(16, 16))
    b = torch.nn.Parameter(a.detach().clone())
    up = Gefen([a], lr=1e-2, maximize=True, fused=False)
    down = Gefen([b], lr=1e-2, fused=False)
    for _ in range(3):
        grad = torch.randn(16, 16)
        _step(up, [a], [grad])
        _step(down, [b], [-grad])
    assert torch.equal(a, b)


def test_weight_decay_is_decoupled_and_applied_before_the_update() -> None:
    torch.manual_seed(5)
    data = torch.randn(32, 32)
    with_decay = torch.nn.Parameter(data.clone())
    without = torch.nn.Parameter(data.clone())
    lr, wd = 0.05, 0.3
    a = Gefen([with_decay], lr=lr, weight_decay=wd, fused=False)
    b = Gefen([without], lr=lr, weight_decay=0.0, fused=False)
    grad = torch.randn(32, 32)
    _step(a, [with_decay], [grad])
    _step(b, [without], [grad])
    update = data.double() - without.detach().double()
    expected = data.double() * (1 - lr * wd) - update
    torch.testing.assert_close(with_decay.detach().double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(a.state[with_decay]["m_codes"], b.state[without]["m_codes"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_parameters_keep_fp32_state(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    weight = torch.nn.Parameter(torch.randn(16, 24, dtype=dtype))
    bias = torch.nn.Parameter(torch.randn(24, dtype=dtype))
    reference_weight = torch.nn.Parameter(weight.detach().float().clone())
    reference_bias = torch.nn.Parameter(bias.detach().float().clone())
    opt = Gefen([weight, bias], lr=1e-2, fused=False)
    ref = Gefen([reference_weight, reference_bias], lr=1e-2, fused=False)
    for _ in range(3):
        gw, gb = torch.randn(16, 24).to(dtype), torch.randn(24).to(dtype)
        _step(opt, [weight, bias], [gw, gb])
        _step(ref, [reference_weight, reference_bias], [gw.float(), gb.float()])
    assert weight.dtype is dtype and bias.dtype is dtype
    for p in (weight, bias):
        state = opt.state[p]
        assert state["m_codes"].dtype is torch.uint8 and state["m_magnitude"].dtype is torch.float32
        assert torch.isfinite(p.float()).all()
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float64: 1e-6}[dtype]
    torch.testing.assert_close(weight.detach().float(), reference_weight.detach(), rtol=0, atol=tolerance)


def test_fp16_squares_do_not_overflow() -> None:
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float16))
    opt = Gefen([p], lr=1e-3, fused=False)
    _step(opt, [p], [torch.full((64,), 300.0)])
    assert opt.state[p]["vmean"].item() == pytest.approx(300.0**2 * (1 - 0.999), rel=1e-6)
    assert torch.isfinite(p).all()


def test_zero_size_and_non_contiguous_parameters() -> None:
    torch.manual_seed(7)
    empty = torch.nn.Parameter(torch.zeros(0, 5))
    strided = torch.nn.Parameter(torch.randn(8, 16).t())
    dense = torch.nn.Parameter(strided.detach().contiguous().clone())
    assert not strided.is_contiguous()
    a = Gefen([empty, strided], lr=1e-2, fused=False)
    b = Gefen([dense], lr=1e-2, fused=False)
    for _ in range(3):
        grad = torch.randn(16, 8)
        _step(a, [empty, strided], [torch.zeros(0, 5), grad])
        _step(b, [dense], [grad])
    assert torch.equal(strided, dense) and not strided.is_contiguous()
    assert a.state[empty]["m_codes"].shape == (0, 1) and a.state[empty]["step"] == 3


def test_state_starts_at_the_first_gradient_zero_or_not() -> None:
    """torch's DCP template step (zero gradients, ``lr=0``) makes the state a checkpoint holds,
    with the shapes a real first step makes, learns no codebook and moves no parameter."""
    torch.manual_seed(8)
    p = torch.nn.Parameter(torch.randn(32, 32))
    q = torch.nn.Parameter(torch.randn(64))
    opt = Gefen([p, q], lr=0.0, weight_decay=0.5, fused=False)
    before = [p.detach().clone(), q.detach().clone()]
    _step(opt, [p, q], [torch.zeros(32, 32), torch.zeros(64)])
    assert opt.state[p]["step"] == 1 and opt.state[q]["step"] == 1 and opt.codebook is None
    assert torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1])
    p2, q2 = (torch.nn.Parameter(t.clone()) for t in before)
    real = Gefen([p2, q2], lr=1e-2, weight_decay=0.5, fused=False)
    _step(real, [p2, q2], [torch.randn(32, 32), torch.randn(64)])
    for mine, theirs in ((opt.state[p], real.state[p2]), (opt.state[q], real.state[q2])):
        assert set(mine) == set(theirs)
        for key, value in mine.items():
            if isinstance(value, torch.Tensor):
                assert (value.dtype, value.shape) == (theirs[key].dtype, theirs[key].shape), key
            else:
                assert value == theirs[key], key
    for group in opt.param_groups:
        group["lr"] = 1e-2
    _step(opt, [p, q], [torch.randn(32, 32), None])
    assert opt.state[p]["step"] == 2 and opt.codebook is not None and opt.state[q]["step"] == 1
    assert opt.global_step == 2 and not torch.equal(p.detach(), before[0])


def test_none_gradient_leaves_parameter_and_state_untouched() -> None:
    p = torch.nn.Parameter(torch.randn(16))
    q = torch.nn.Parameter(torch.randn(16))
    opt = Gefen([p, q], lr=1e-2, weight_decay=0.1, fused=False)
    _step(opt, [p, q], [torch.randn(16), torch.randn(16)])
    snapshot_q = q.detach().clone()
    state_q = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[q].items()}
    _step(opt, [p, q], [torch.randn(16), None])
    assert torch.equal(q, snapshot_q)
    for key, value in opt.state[q].items():
        assert torch.equal(value, state_q[key]) if isinstance(value, torch.Tensor) else value == state_q[key]


def test_switching_second_moment_representation_restarts_its_age() -> None:
    torch.manual_seed(9)
    p = torch.nn.Parameter(torch.randn(16, 32))
    opt = Gefen([p], lr=1e-2, fused=False, min_dim_size_to_factor=0)
    for _ in range(3):
        _step(opt, [p], [torch.randn(16, 32)])
    assert opt.state[p]["factored_step"] == 3
    opt.param_groups[0]["factored_v_2d"] = False
    _step(opt, [p], [torch.randn(16, 32)])
    state = opt.state[p]
    assert state["step"] == 4 and state["vmean_step"] == 1 and "v_row" not in state
    assert torch.isfinite(p).all()


def test_device_scalars_equal_host_scalars_bitwise() -> None:
    for factored in (False, True):
        for beta1, beta2 in ((0.9, 0.999), (0.95, 0.98), (0.0, 0.5)):
            for step in (1, 2, 3, 10, 100, 1234, 99991):
                options = {"beta1": beta1, "beta2": beta2, "eps": 1e-8, "weight_decay": 0.01, "factored": factored}
                host = host_scalars(torch.device("cpu"), lr=3e-4, step=step, age=max(1, step - 1), **options)
                device = device_scalars(
                    lr=torch.tensor(3e-4, dtype=torch.float64),
                    step=torch.tensor(float(step), dtype=torch.float64),
                    age=torch.tensor(float(max(1, step - 1)), dtype=torch.float64),
                    **options,
                )
                assert torch.equal(host, device), (factored, beta1, beta2, step)
        # one row per counter pair, computed at once: each row as the host computes it
        steps, ages = [1, 2, 10, 99991], [1, 1, 9, 5]
        rows = device_scalars(
            lr=torch.tensor(3e-4, dtype=torch.float64),
            step=torch.tensor(steps, dtype=torch.float64),
            age=torch.tensor(ages, dtype=torch.float64),
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            factored=factored,
        )
        assert rows.shape == (4, 9)
        for row, step, age in zip(rows, steps, ages):
            host = host_scalars(
                torch.device("cpu"), lr=3e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                step=step, age=age, factored=factored,
            )  # fmt: skip
            assert torch.equal(row, host), (factored, step, age)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_left_intact_and_a_negative_gradient_raises_the_parameter(dtype: torch.dtype) -> None:
    p = torch.nn.Parameter(torch.zeros(16, 32, dtype=dtype))
    opt = Gefen([p], lr=1e-2, maximize=False)
    grad = -torch.rand(16, 32, dtype=dtype) - 0.5
    p.grad = grad.clone()
    opt.step()
    assert torch.equal(p.grad, grad)
    assert bool((p > 0).all())


def test_with_every_compression_off_gefen_is_laprop_ordered_adamw() -> None:
    """Period 1 makes the momentum exact (z = +-1 is a codeword) and v per-element: AdamW with
    the momentum taken after the preconditioning (LaProp's order), in float64 here."""
    torch.manual_seed(10)
    shapes = [(12, 20), (20,), (3, 12)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [p.detach().double().clone() for p in ours]
    lr, (beta1, beta2), eps, wd = 3e-3, (0.8, 0.95), 1e-6, 0.1
    gefen = Gefen(
        ours, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
        force_1d_period_one=True, force_2d_period_one=True, factored_v_2d=False,
    )  # fmt: skip
    m = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    v = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for t in range(1, 7):
        grads = [torch.randn(s) for s in shapes]
        _step(gefen, ours, grads)
        for i, g in enumerate(grads):
            g64 = g.double()
            v[i] = beta2 * v[i] + (1 - beta2) * g64.square()
            m[i] = beta1 * m[i] + (1 - beta1) * g64 / ((v[i] / (1 - beta2**t)).sqrt() + eps)
            theirs[i] = theirs[i] * (1 - lr * wd) - lr * m[i] / (1 - beta1**t)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "kernel"])
@pytest.mark.parametrize("shape", [(4096,), (64, 256), (256, 256)], ids=["block", "element", "factored"])
def test_a_zero_gradient_element_comes_to_rest_while_its_block_trains(
    shape: tuple[int, ...], fused: bool | None
) -> None:
    """Half of each block's elements stop receiving gradient while the other half trains, so the
    block scale stays. Nearest rounding once kept ``0.9 C[q]`` at ``C[q]`` for such an element
    (99 % of them still moved 400 steps later); now its momentum decays to zero and its
    parameter comes to rest, as AdamW's does."""
    torch.manual_seed(5)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = Gefen([p], lr=1e-2, weight_decay=0.0, fused=fused)
    dead = torch.zeros(shape, dtype=torch.bool)
    dead.view(-1)[::2] = True
    for step in range(200):
        grad = torch.randn(shape)
        if step >= 50:
            grad[dead] = 0
        _step(opt, [p], [grad])
    assert bool((_decode(opt, p).view(shape)[dead] == 0).all())
    before = p.detach().clone()
    for _ in range(10):
        grad = torch.randn(shape)
        grad[dead] = 0
        _step(opt, [p], [grad])
    assert torch.equal(p.detach()[dead], before[dead])
    assert not torch.equal(p.detach()[~dead], before[~dead])


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "kernel"])
def test_gefen_muon_momentum_of_a_dead_column_decays_to_zero(fused: bool | None) -> None:
    """GefenMuon shares the quantiser: the momentum of a column whose gradient stopped decays to
    zero while the rest of the matrix trains."""
    from gefen_core import GefenMuon

    torch.manual_seed(6)
    p = torch.nn.Parameter(torch.randn(64, 256) * 0.02)
    opt = GefenMuon([p], lr=1e-2, fused=fused)
    dead = torch.zeros(64, 256, dtype=torch.bool)
    dead[:, ::3] = True
    for step in range(200):
        grad = torch.randn(64, 256)
        if step >= 50:
            grad[dead] = 0
        p.grad = grad
        opt.step()
    state = opt.state[p]
    codebook = opt.codebook
    assert codebook is not None
    momentum = (codebook[state["m_codes"].long()] * state["m_magnitude"]).view(64, 256)
    assert bool((momentum[dead] == 0).all()) and bool((momentum[~dead] != 0).any())


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "kernel"])
def test_a_first_step_on_all_zero_gradients_equals_the_kernels_pass(fused: bool | None) -> None:
    """While no rank has a non-zero gradient (the zero-gradient step torch's
    ``get_optimizer_state_dict`` takes to build a template), a new state's update skips the
    kernels: it must leave exactly what their pass over zeros leaves. The twin optimizer holds
    the placeholder codebook already, so its step runs the kernels over the same zeros."""
    from gefen_core.parameter_update import placeholder_codebook

    torch.manual_seed(7)
    shapes = [(300,), (256, 128), (12, 20), (3, 4, 5)]  # block, factored, element, block (3-D)
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float64]
    for lr, weight_decay, stochastic in ((0.0, 0.1, False), (1e-2, 0.1, False), (1e-2, 0.0, False), (0.0, 0.1, True)):
        params = [torch.nn.Parameter(torch.randn(s, dtype=d)) for s, d in zip(shapes, dtypes)]
        for p in params:
            p.data.view(-1)[::7] = -0.0  # the kernels' write p - (C[q'] * 0) makes them +0.0
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        options = {"lr": lr, "weight_decay": weight_decay, "fused": fused, "stochastic_round": stochastic}
        ours, kernels = Gefen(params, **options), Gefen(twins, **options)
        kernels._codebook = placeholder_codebook(torch.device("cpu"))
        for opt, group in ((ours, params), (kernels, twins)):
            _step(opt, group, [torch.zeros(s) for s in shapes])
        assert ours.codebook is None
        for p, twin in zip(params, twins):
            assert torch.equal(p.detach().view(torch.uint8), twin.detach().view(torch.uint8))  # bits: signed zeros
            mine, theirs = ours.state[p], kernels.state[twin]
            assert sorted(mine) == sorted(theirs)
            for key, value in mine.items():
                other = theirs[key]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@pytest.mark.parametrize(("normuon", "cautious"), [(False, False), (True, False), (False, True)])
def test_gefen_muon_first_step_on_all_zero_gradients_skips_newton_schulz_exactly(normuon: bool, cautious: bool) -> None:
    """While no gradient was non-zero (no codebook after learning), every Newton-Schulz input is
    0, and GefenMuon skips the orthogonalisation: the step must leave exactly what running it
    leaves (the twin holds the placeholder codebook already, so its step runs Newton-Schulz)."""
    from gefen_core import GefenMuon
    from gefen_core.parameter_update import placeholder_codebook

    torch.manual_seed(8)
    shapes = [(32, 48), (32, 48), (32, 48), (20, 10)]  # three batched together, one alone
    options = {"lr": 1e-2, "weight_decay": 0.1, "normuon": normuon, "cautious": cautious}
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, twin_opt = GefenMuon(params, **options), GefenMuon(twins, **options)
    twin_opt._codebook = placeholder_codebook(torch.device("cpu"))
    for opt, group in ((ours, params), (twin_opt, twins)):
        for p in group:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert ours.codebook is None
    for p, twin in zip(params, twins):
        assert torch.equal(p.detach(), twin.detach())
        mine, theirs = ours.state[p], twin_opt.state[twin]
        assert sorted(mine) == sorted(theirs)
        for key, value in mine.items():
            other = theirs[key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key

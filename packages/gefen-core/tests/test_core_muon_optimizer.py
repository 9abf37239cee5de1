"""GefenMuon on one device: options, the update rule, levers, dispatch, AMP and preflight."""

from __future__ import annotations

import inspect
import logging
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import StateValidationError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import count_state_bytes
from gefen_core import GefenMuon, GefenOptionError, GefenOptionTypeError, GradientError, ParameterError
from gefen_core.momentum_codec import dequantize
from gefen_core.muon_options import group_schedule, lr_ratio
from gefen_core.newton_schulz import NS_SCHEDULES, newton_schulz, resolve_schedule
from gefen_core.normuon import cautious_mask, normuon_rescale
from gefen_core.ops import MUON_MOMENTUM
from gefen_core.param_state import period_of
from gefen_core_test_support import counting_kernels, single_threaded_torch  # noqa: F401  (autouse fixture)

#: Stated bound: after 10 steps GefenMuon's parameter movement differs from torch.optim.Muon's
#: by at most this fraction (relative L2; measured 0.8% to 1.2%); the gap is the momentum codec.
TORCH_MUON_BOUND = 0.03


def _matrices(*shapes: tuple[int, int], seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator).to(dtype)) for shape in shapes]


def _grads(params: list[torch.nn.Parameter], generator: torch.Generator, scale: float = 1.0) -> None:
    for p in params:
        p.grad = ((torch.randn(p.shape, generator=generator) + 0.3) * scale).to(p.dtype)


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _grads(params, generator)
        opt.step()


BAD_OPTIONS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"lr": -1.0}, GefenOptionError, "learning rate"),
    ({"lr": torch.tensor([1.0, 2.0])}, GefenOptionError, "1-element"),
    ({"weight_decay": -0.1}, GefenOptionError, "weight_decay"),
    ({"momentum": 1.0}, GefenOptionError, r"momentum must be in \[0, 1\)"),
    ({"momentum": -0.1}, GefenOptionError, "momentum"),
    ({"eps": 0.0}, GefenOptionError, "eps must be finite and > 0"),
    ({"eps": -1e-7}, GefenOptionError, "eps"),
    ({"eps": float("nan")}, GefenOptionError, "eps"),
    ({"eps": float("inf")}, GefenOptionError, "eps"),
    ({"ns_steps": 0}, GefenOptionError, "ns_steps"),
    ({"ns_steps": -1}, GefenOptionError, "ns_steps"),
    ({"ns_coefficients": (1.0, 2.0)}, GefenOptionError, "exactly 3"),
    ({"ns_schedule": "tuned5"}, GefenOptionError, "unknown"),
    ({"adjust_lr_fn": "spectral"}, GefenOptionError, "adjust_lr_fn"),
    ({"sharded_mode": "fsdp"}, GefenOptionError, "sharded_mode"),
    ({"batched_ns_workspace_bytes": 0}, GefenOptionError, "batched_ns_workspace_bytes"),
    ({"batched_ns_workspace_bytes": -1}, GefenOptionError, "batched_ns_workspace_bytes"),
    ({"batched_ns_workspace_bytes": 1.5}, GefenOptionTypeError, "batched_ns_workspace_bytes"),
    ({"batched_ns_workspace_bytes": True}, GefenOptionTypeError, "batched_ns_workspace_bytes"),
    ({"normuon_beta2": 1.0}, GefenOptionError, "normuon_beta2"),
    ({"normuon_eps": 0.0}, GefenOptionError, "normuon_eps"),
    ({"normuon_eps": float("nan")}, GefenOptionError, "normuon_eps"),
    ({"normuon_eps": -float("inf")}, GefenOptionError, "normuon_eps"),
    ({"nesterov": 1}, GefenOptionTypeError, "nesterov"),
    ({"normuon": "yes"}, GefenOptionTypeError, "normuon"),
    ({"deterministic": 1}, GefenOptionTypeError, "deterministic"),
    ({"stochastic_round": None}, GefenOptionTypeError, "stochastic_round"),
    ({"verbose": 1}, GefenOptionTypeError, "verbose"),
    ({"fused": "yes"}, GefenOptionTypeError, "fused"),
    ({"capturable": True}, GefenOptionError, "capturable"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_OPTIONS)
def test_bad_options_raise_naming_the_argument(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        GefenMuon(_matrices((4, 6)), **options)


def test_only_2d_real_parameters_are_accepted() -> None:
    for bad in (torch.zeros(5), torch.zeros(2, 3, 4)):
        with pytest.raises(ParameterError, match="only supports 2D parameters"):
            GefenMuon([torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(bad)])
    with pytest.raises(ParameterError, match="complex"):
        GefenMuon([torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="empty parameter list"):
        GefenMuon([])


def test_schedules_normalise_into_the_group() -> None:
    opt = GefenMuon(_matrices((4, 6)), ns_schedule="tuned3")
    group = opt.param_groups[0]
    assert group["ns_steps"] == 3 and group["ns_coefficients"] == NS_SCHEDULES["tuned3"]
    # the defaults keep what was passed (what groups inherit), the group its resolution
    assert group["ns_schedule"] == "tuned3" and opt.defaults["ns_steps"] == 5
    plain = GefenMuon(_matrices((4, 6)), ns_schedule="standard", ns_steps=3)
    assert plain.param_groups[0]["ns_steps"] == 3 and plain.param_groups[0]["ns_coefficients"] == (
        3.4445,
        -4.775,
        2.0315,
    )


def test_a_schedule_edited_in_a_live_group_takes_effect_or_is_refused() -> None:
    """A named schedule's group holds its triples and their count; ``ns_steps`` edited alone on
    such a group was silently ignored (the group said 5, the step ran 3). It is refused before
    anything changes; the schedule's fields set together take effect."""
    params = _matrices((8, 12))
    opt = GefenMuon(params, lr=1e-2, fused=False, ns_schedule="tuned3")
    _train(opt, params, 1)
    opt.param_groups[0]["ns_steps"] = 5
    _grads(params, torch.Generator().manual_seed(2))
    before = deep_snapshot(opt, *params)
    with pytest.raises(GefenOptionError, match="ns_steps is 5 but the group's schedule"):
        opt.step()
    assert snapshot_diff(before, opt, *params) == []
    switched, unedited = _matrices((8, 12)), _matrices((8, 12))
    editing, twin = GefenMuon(switched, lr=1e-2, fused=False), GefenMuon(unedited, lr=1e-2, fused=False)
    _train(editing, switched, 1)
    _train(twin, unedited, 1)
    editing.param_groups[0].update(ns_schedule="tuned3", ns_steps=3)
    _train(editing, switched, 1, seed=2)
    _train(twin, unedited, 1, seed=2)
    assert group_schedule(editing.param_groups[0]) == NS_SCHEDULES["tuned3"]
    assert not torch.equal(switched[0], unedited[0])


def test_add_param_group_validates_everything_before_registering() -> None:
    params = _matrices((4, 6), (6, 4), (3, 3))
    opt = GefenMuon(params[:1], lr=1e-2, fused=False)
    _train(opt, params[:1], 1)
    frozen = opt.codebook
    before = deep_snapshot(opt)
    with pytest.raises(ParameterError, match="only supports 2D"):
        opt.add_param_group({"params": [params[1], torch.nn.Parameter(torch.zeros(4))]})
    with pytest.raises(GefenOptionError, match="normuon_eps"):
        opt.add_param_group({"params": [params[1]], "normuon_eps": 0.0})
    # a named parameter is named (the hybrid's routing override of a bias to muon said only its index)
    with pytest.raises(ParameterError, match=r"\['params'\]\[1\] \('norm.bias'\): GefenMuon only supports 2D"):
        opt.add_param_group({"params": [("w", params[1]), ("norm.bias", torch.nn.Parameter(torch.zeros(4)))]})
    assert not snapshot_diff(before, opt) and len(opt.param_groups) == 1
    options = {
        "momentum": 0.8,
        "nesterov": False,
        "ns_schedule": "tuned3",
        "adjust_lr_fn": "match_rms_adamw",
        "sharded_mode": "approx",
        "batched_ns": True,
        "batched_ns_workspace_bytes": 1 << 20,
        "normuon": True,
        "normuon_beta2": 0.9,
        "normuon_eps": 1e-6,
        "cautious": True,
        "lr": 2e-2,
        "weight_decay": 0.0,
    }
    opt.add_param_group({"params": [params[1]], **options})
    group = opt.param_groups[1]
    assert {key: group[key] for key in options} == options
    assert group["ns_steps"] == 3 and len(group["ns_coefficients"]) == 3
    start = params[1].detach().clone()
    _train(opt, params[:2], 1)
    assert opt.state[params[1]]["step"] == 1 and not torch.equal(start, params[1])
    assert torch.equal(opt.codebook, frozen)  # type: ignore[arg-type]  # learned once, then frozen


def test_torch_muons_positional_arguments_mean_the_same() -> None:
    """A call written for ``torch.optim.Muon`` keeps its meaning: torch's parameters come first, in
    its order (GefenMuon's own options are keyword-only)."""
    ours = list(inspect.signature(GefenMuon.__init__).parameters.values())
    theirs = list(inspect.signature(torch.optim.Muon.__init__).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])
    param = torch.nn.Parameter(torch.randn(8, 4))
    positional = (2e-2, 0.05, 0.9, False, (3.4445, -4.7750, 2.0315), 1e-7, 5, "match_rms_adamw")
    group = GefenMuon([param], *positional).param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"], group["nesterov"]) == positional[:4]
    assert group["adjust_lr_fn"] == "match_rms_adamw" and group["ns_steps"] == 5


@pytest.mark.parametrize("adjust", [None, "original", "match_rms_adamw", "spectral_unclamped"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_first_step_is_decay_then_scaled_newton_schulz_of_the_quantized_momentum(
    adjust: str | None, nesterov: bool, shape: tuple[int, int]
) -> None:
    (p,) = _matrices(shape)
    start = p.detach().clone()
    lr, wd, beta = 0.02, 0.1, 0.9
    opt = GefenMuon([p], lr=lr, weight_decay=wd, momentum=beta, nesterov=nesterov, adjust_lr_fn=adjust, fused=False)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    p.grad = grad.clone()
    opt.step()
    state = opt.state[p]
    codebook = opt.codebook
    assert codebook is not None
    decoded = dequantize(codebook, state["m_codes"], state["m_magnitude"]).view(shape)
    scalars = torch.tensor([beta, 1 - beta], dtype=torch.float32)
    ns_input = decoded * scalars[0] + grad * scalars[1] if nesterov else decoded
    update = newton_schulz(ns_input.to(torch.bfloat16), resolve_schedule(), 1e-7)
    expected = start.clone()
    expected.mul_(1 - lr * wd).add_(update, alpha=-(lr * lr_ratio(adjust, *shape)))
    assert torch.equal(p.detach(), expected)
    rows, cols = shape
    expected_ratio = {"match_rms_adamw": 0.2 * max(rows, cols) ** 0.5, "spectral_unclamped": (rows / cols) ** 0.5}
    assert lr_ratio(adjust, rows, cols) == pytest.approx(expected_ratio.get(str(adjust), max(1.0, rows / cols) ** 0.5))
    torch.testing.assert_close(decoded, grad * (1 - beta), rtol=0, atol=float(grad.abs().max()) * (1 - beta) * 0.02)


@pytest.mark.parametrize(
    "options",
    [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw"}, {"adjust_lr_fn": "spectral_unclamped"}],
)
def test_training_follows_torch_muon_within_the_codec_error(options: dict[str, Any]) -> None:
    movements = []
    for make in (
        lambda ps: torch.optim.Muon(ps, lr=0.01, weight_decay=0.1, **options),
        lambda ps: GefenMuon(ps, lr=0.01, weight_decay=0.1, fused=False, **options),
    ):
        params = _matrices((48, 32), (32, 80))
        start = [p.detach().clone() for p in params]
        _train(make(params), params, 10)
        movements.append([p.detach() - s for p, s in zip(params, start)])
    for theirs, ours in zip(*movements):
        assert float((theirs - ours).norm() / theirs.norm()) < TORCH_MUON_BOUND


def test_quantized_momentum_tracks_the_exact_ema() -> None:
    (p,) = _matrices((64, 96))
    beta = 0.95
    opt = GefenMuon([p], lr=1e-3, momentum=beta, fused=False)
    generator = torch.Generator().manual_seed(5)
    exact = torch.zeros(64, 96)
    for _ in range(6):
        _grads([p], generator)
        exact = beta * exact + (1 - beta) * p.grad  # type: ignore[operator]
        opt.step()
    state = opt.state[p]
    decoded = dequantize(opt.codebook, state["m_codes"], state["m_magnitude"]).view(64, 96)  # type: ignore[arg-type]
    assert float((decoded - exact).norm() / exact.norm()) < 0.02
    assert state["m_codes"].dtype is torch.uint8 and period_of(state) == 96  # one block per row


def test_state_is_about_one_byte_per_parameter() -> None:
    params = _matrices((256, 512), (512, 256))
    opt = GefenMuon(params, fused=False)
    _train(opt, params, 1)
    per_param = count_state_bytes(opt).total / sum(p.numel() for p in params)
    assert 1.0 < per_param < 1.02
    normuon = GefenMuon(params, normuon=True, fused=False)
    _train(normuon, params, 1)
    assert count_state_bytes(normuon).total / sum(p.numel() for p in params) < 1.03


def test_normuon_equalises_rows_and_keeps_the_frobenius_norm() -> None:
    update = (torch.randn(16, 24) * torch.linspace(0.1, 3.0, 16)[:, None]).to(torch.bfloat16)
    state: dict[str, Any] = {}
    beta2, eps = 0.95, 1e-8
    out = normuon_rescale(update, state, beta2, eps)
    o = update.double()
    v = (1 - beta2) * o.square().sum(dim=1, keepdim=True) / 24
    d = (v / (1 - beta2)).sqrt() + eps
    expected = o / d * (o.norm() / (o.norm(dim=1, keepdim=True) / d).norm())
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(out.double().norm(), o.norm(), rtol=1e-2, atol=0)
    row_norms = out.double().norm(dim=1)
    assert float(row_norms.max() / row_norms.min()) < 1.05  # equalised after one step
    assert state["normuon_step"] == 1 and state["normuon_v"].shape == (16, 1)


def test_normuon_with_a_zero_gradient_leaves_the_parameter_bit_identical() -> None:
    params = _matrices((8, 12))
    opt = GefenMuon(params, normuon=True, weight_decay=0.0, fused=False)
    _train(opt, params, 2)
    before = params[0].detach().clone()
    params[0].grad = torch.zeros(8, 12)
    opt.step()
    assert torch.isfinite(params[0]).all()
    moved = params[0].detach().clone()
    assert not torch.equal(before, moved)  # the momentum still moves it
    fresh = _matrices((8, 12), seed=4)
    zero = GefenMuon(fresh, normuon=True, weight_decay=0.0, fused=False)
    start = fresh[0].detach().clone()
    fresh[0].grad = torch.zeros(8, 12)
    zero.step()
    assert torch.equal(fresh[0].detach(), start)
    assert zero.state[fresh[0]]["step"] == 1 and zero.codebook is None  # state from the first gradient


def test_cautious_keeps_agreeing_signs_and_rescales() -> None:
    update = torch.tensor([[1.0, -2.0], [3.0, 4.0]]).to(torch.bfloat16)
    grad = torch.tensor([[1.0, 1.0], [-1.0, 2.0]])
    out = cautious_mask(update, grad)
    assert torch.equal(out.float(), torch.tensor([[2.0, 0.0], [0.0, 8.0]]))
    assert torch.equal(cautious_mask(update, -update.float()).float(), torch.zeros(2, 2))


def test_stochastic_rounding_is_reproducible_and_differs_from_nearest() -> None:
    runs = []
    for stochastic in (True, True, False):
        params = _matrices((16, 32))
        _train(GefenMuon(params, stochastic_round=stochastic, fused=False), params, 3)
        runs.append(params[0].detach())
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_fused_dispatch() -> None:
    results = {}
    for fused in (None, False, True):
        params = _matrices((16, 32), (32, 16))
        with counting_kernels() as calls:
            _train(GefenMuon(params, fused=fused, stochastic_round=True), params, 3)
        results[fused] = (params, calls)
    solve = {"gefen::codebook_solve.v2": 1}  # the first step's codebook
    assert results[None][1] == {MUON_MOMENTUM: 6, "gefen::histogram.v2": 2, **solve} and results[False][1] == {}
    assert results[True][1] == results[None][1]
    assert all(torch.equal(a, b) for a, b in zip(results[None][0], results[False][0]))


def test_fp8_on_cpu_warns_once_and_runs_bf16() -> None:
    outcomes = []
    for fp8 in (True, False):
        params = _matrices((16, 32))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = GefenMuon(params, fp8_ns=fp8, fused=False)
            _train(opt, params, 3)
        outcomes.append((params[0].detach(), [w for w in caught if issubclass(w.category, RuntimeWarning)]))
    (fp8_result, fp8_warnings), (bf16_result, bf16_warnings) = outcomes
    assert len(fp8_warnings) == 1 and "8.9" in str(fp8_warnings[0].message) and not bf16_warnings
    assert torch.equal(fp8_result, bf16_result)


def test_batched_newton_schulz_stays_close_and_keeps_the_state_bit_identical() -> None:
    runs = []
    for batched in (False, True):
        params = _matrices(*[(12, 20)] * 9, (20, 12))
        start = [p.detach().clone() for p in params]
        opt = (
            GefenMuon(params, batched_ns=True, ns_schedule="tuned3", fused=False)
            if batched
            else GefenMuon(params, ns_schedule="tuned3", fused=False)
        )
        _train(opt, params, 3)
        runs.append(([p.detach() - s for p, s in zip(params, start)], [opt.state[p]["m_codes"] for p in params]))
    (serial, serial_codes), (batched_moves, batched_codes) = runs
    for a, b in zip(serial, batched_moves):
        assert float((a - b).norm() / a.norm()) <= 2e-2
    assert all(torch.equal(a, b) for a, b in zip(serial_codes, batched_codes))


def test_bad_gradients_and_swapped_parameters_are_refused_before_mutation() -> None:
    params = _matrices((8, 12), (12, 8))
    opt = GefenMuon(params, fused=False)
    _train(opt, params, 1)
    corruptions: list[tuple[Callable[[], None], type[Exception], str]] = [
        (lambda: setattr(params[1], "grad", torch.zeros(12, 8).to_sparse()), GradientError, "sparse"),
        (lambda: setattr(params[1].grad, "data", params[1].grad.data.double()), GradientError, "dtype"),  # type: ignore[union-attr]
        (lambda: setattr(params[1].grad, "data", torch.zeros(96)), GradientError, "shape"),
    ]
    for corrupt, error, message in corruptions:
        params[0].grad = torch.randn(8, 12)
        params[1].grad = torch.randn(12, 8)
        corrupt()
        before = deep_snapshot(opt, *params)
        with pytest.raises(error, match=message):
            opt.preflight_step()
        with pytest.raises(error, match=rf"\['params'\]\[1\].*{message}"):
            opt.step()
        assert not snapshot_diff(before, opt, *params)
    fresh = _matrices((8, 12))
    first = GefenMuon(fresh, fused=False)
    fresh[0].grad = torch.full((8, 12), float("nan"))
    with pytest.raises(GradientError, match="not finite"):
        first.step()
    assert first.codebook is None and not first.state
    params[1].grad = torch.randn(12, 8)
    params[0].data = params[0].data.reshape(-1)  # what a ZeRO-style wrapper does
    params[0].grad = torch.randn(96)
    with pytest.raises(ParameterError, match="only supports 2D"):
        opt.step()


def test_amp_overflow_skips_and_grad_scale_unscales() -> None:
    runs = []
    for scaled in (True, False):
        params = _matrices((8, 12))
        opt = GefenMuon(params, fused=False)
        _train(opt, params, 1)
        grad = torch.randn(8, 12, generator=torch.Generator().manual_seed(9))
        if scaled:
            params[0].grad = grad * 4.0
            opt.found_inf = torch.ones(1)  # type: ignore[attr-defined]
            opt.grad_scale = torch.full((1,), 4.0)  # type: ignore[attr-defined]
            before = deep_snapshot(opt, *params)
            opt.step()
            assert not snapshot_diff(before, opt, *params) and opt.global_step == 1
            opt.found_inf = torch.zeros(1)  # type: ignore[attr-defined]
        else:
            params[0].grad = grad
        opt.step()
        runs.append(params[0].detach())
    assert torch.equal(runs[0], runs[1])


def test_schedulers_tensor_lr_closure_and_pickling() -> None:
    params = _matrices((8, 12))
    opt = GefenMuon(params, lr=torch.tensor(0.02), fused=False)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    generator = torch.Generator().manual_seed(0)

    def closure() -> torch.Tensor:
        _grads(params, generator)
        return torch.tensor(42.0)

    assert float(opt.step(closure)) == 42.0
    scheduler.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.01)
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.global_step == 1 and torch.equal(clone.codebook, opt.codebook)
    assert clone.state_mode_tags(clone.param_groups[0]["params"][0]) == {"gefen.muon.sharded_mode=exact"}


def test_verbose_logs_the_step_choices(caplog: pytest.LogCaptureFixture) -> None:
    params = _matrices(*[(8, 8)] * 8)
    opt = GefenMuon(params, verbose=True, batched_ns=True, fused=False)
    with caplog.at_level(logging.INFO, logger="gefen_core.muon"):
        _train(opt, params, 1)
    text = caplog.text
    assert "learned the codebook" in text and "batched NS (8, 8): chunks [8]" in text


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw", "spectral_unclamped"])
def test_matrices_without_rows_or_columns_step_with_the_others(adjust_lr_fn: str | None) -> None:
    """An ``8 x 0`` or ``0 x 8`` matrix (a disabled adapter) has nothing to update; the other
    matrices of the step update as without it (Muon's ``sqrt(rows / cols)`` must not divide by
    zero columns)."""
    torch.manual_seed(0)
    full, no_cols, no_rows = (torch.nn.Parameter(torch.randn(*s)) for s in ((16, 32), (8, 0), (0, 8)))
    alone = torch.nn.Parameter(full.detach().clone())
    optimizer = GefenMuon([full, no_cols, no_rows], lr=1e-2, adjust_lr_fn=adjust_lr_fn)
    reference = GefenMuon([alone], lr=1e-2, adjust_lr_fn=adjust_lr_fn)
    for step in range(2):
        grad = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        full.grad, alone.grad = grad.clone(), grad.clone()
        no_cols.grad, no_rows.grad = torch.zeros(8, 0), torch.zeros(0, 8)
        optimizer.step()
        reference.step()
    assert torch.equal(full, alone) and optimizer.global_step == 2


def test_an_overflow_on_the_first_step_skips_it_instead_of_refusing_the_gradient() -> None:
    """AMP's overflow skips the whole step: an ``inf`` in a matrix's first gradient on such a
    step is the scaler's business, not a ``GradientError`` (Gefen skips before its plan too)."""
    params = _matrices((8, 12))
    opt = GefenMuon(params, fused=False)
    params[0].grad = torch.randn(8, 12)
    params[0].grad[0, 0] = float("inf")  # type: ignore[index]
    opt.found_inf = torch.ones(1)  # type: ignore[attr-defined]
    opt.grad_scale = torch.full((1,), 4.0)  # type: ignore[attr-defined]
    before = deep_snapshot(opt, *params)
    opt.step()
    assert not snapshot_diff(before, opt, *params) and opt.global_step == 0


@pytest.mark.parametrize("fused", [False, None])
def test_a_non_finite_gradient_is_refused_while_the_codebook_is_unlearned(fused: bool | None) -> None:
    """A matrix whose first gradient was all zero has a state but no codebook yet: the next
    step learns it from that gradient, so a NaN must be refused there too (it crashed the
    reference's ``bincount`` and skewed the kernels' histogram into a codebook, silently)."""
    params = _matrices((8, 12))
    opt = GefenMuon(params, fused=fused)
    params[0].grad = torch.zeros(8, 12)
    opt.step()
    assert opt.state[params[0]] and opt.codebook is None
    params[0].grad = torch.randn(8, 12)
    params[0].grad[2, 3] = float("nan")  # type: ignore[index]
    before = deep_snapshot(opt, *params)
    with pytest.raises(GradientError, match="codebook is still unlearned"):
        opt.preflight_step()
    with pytest.raises(GradientError, match="codebook is still unlearned"):
        opt.step()
    assert not snapshot_diff(before, opt, *params)


def test_groups_inherit_the_constructors_schedule_options_not_their_resolution() -> None:
    """A named schedule resolves into each group's triples, but a group returning to
    ``"standard"`` (or giving its own triple) must get the constructor's own coefficients and
    step count, not the named schedule's triples (torch.optim.Muon's groups inherit what was
    passed)."""
    matrices = _matrices((8, 16), (8, 16), (8, 16))
    groups: list[dict[str, Any]] = [
        {"params": [matrices[0]]},
        {"params": [matrices[1]], "ns_schedule": "standard"},
        {"params": [matrices[2]], "ns_schedule": None},
    ]
    opt = GefenMuon(groups, ns_schedule="tuned3")
    schedules = [resolve_schedule(g["ns_coefficients"], g["ns_steps"], g["ns_schedule"]) for g in opt.param_groups]
    assert schedules == [NS_SCHEDULES["tuned3"], resolve_schedule(), resolve_schedule()]
    listed = GefenMuon(_matrices((8, 16)), ns_coefficients=[(3.0, -4.0, 2.0), (3.0, -4.0, 2.0)])
    listed.add_param_group({"params": _matrices((8, 16), seed=1), "ns_coefficients": (3.4445, -4.775, 2.0315)})
    assert listed.param_groups[0]["ns_steps"] == 2 and listed.param_groups[1]["ns_steps"] == 5


def test_a_checkpoint_of_the_other_optimizer_is_refused_naming_its_format() -> None:
    """Gefen's and GefenMuon's formats share the ``gefen_format_version`` key: a Gefen checkpoint
    into GefenMuon was blamed on its version ("re-save it with the version that wrote it")."""
    from gefen_core import Gefen

    muon_params, gefen_params = _matrices((8, 12)), _matrices((8, 12))
    muon, gefen = GefenMuon(muon_params, fused=False), Gefen(gefen_params, fused=False)
    _train(muon, muon_params, 1)
    _train(gefen, gefen_params, 1)
    for source, target, params, saved, wanted in (
        (gefen, muon, muon_params, "gefen.native_state", "gefen.muon_native_state"),
        (muon, gefen, gefen_params, "gefen.muon_native_state", "gefen.native_state"),
    ):
        before = deep_snapshot(target, *params)
        with pytest.raises(StateValidationError, match=rf"'{saved}' checkpoint; \w+ reads '{wanted}'"):
            target.load_state_dict(source.state_dict())
        assert not snapshot_diff(before, target, *params)

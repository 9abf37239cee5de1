"""The AdamW-like API: construction errors, groups, closures, hooks, schedulers, AMP, tensor lr."""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
from gefen_contracts import StateValidationError
from gefen_contracts.protocols import ContractProvider, StagedNativeLoad, StepPreflight
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_core import Gefen, GefenMuon, GefenOptionError, GefenOptionTypeError, ParameterError
from gefen_core.param_state import period_of
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(model: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=generator)
    y = torch.randn(32, 4, generator=generator)
    return torch.nn.functional.mse_loss(model(x), y)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for index in range(steps):
        opt.zero_grad()
        loss = _loss(model, index)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": -1.0}, GefenOptionError, "Invalid learning rate"),
        ({"lr": float("nan")}, GefenOptionError, "learning rate"),
        ({"lr": True}, GefenOptionTypeError, "learning rate"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, GefenOptionError, "1-element"),
        ({"betas": (1.0, 0.999)}, GefenOptionError, "beta parameter at index 0"),
        ({"betas": (0.9, 1.0)}, GefenOptionError, "beta parameter at index 1"),
        ({"betas": (0.9,)}, GefenOptionTypeError, "betas"),
        ({"eps": -1.0}, GefenOptionError, "epsilon"),
        ({"eps": 0.0}, GefenOptionError, "epsilon"),
        ({"eps": math.inf}, GefenOptionError, "epsilon"),
        ({"weight_decay": -0.1}, GefenOptionError, "weight_decay"),
        ({"maximize": 1}, GefenOptionTypeError, "maximize"),
        ({"codebook_refresh_every": -1}, GefenOptionError, "codebook_refresh_every"),
        ({"codebook_refresh_every": 2.0}, GefenOptionTypeError, "codebook_refresh_every"),
        ({"deterministic": 1}, GefenOptionTypeError, "deterministic"),
        ({"stochastic_round": "yes"}, GefenOptionTypeError, "stochastic_round"),
        ({"capturable": True, "codebook_refresh_every": 5}, GefenOptionError, "incompatible"),
        ({"fused": "yes"}, GefenOptionTypeError, "fused"),
        ({"period_one_substrings": "norm"}, GefenOptionTypeError, "period_one_substrings"),
        ({"clip_threshold": 0.0}, GefenOptionError, "clip_threshold value: 0.0 .must be > 0, or None"),
        ({"clip_threshold": -1.0}, GefenOptionError, "clip_threshold"),
        ({"clip_threshold": math.nan}, GefenOptionError, "clip_threshold"),
        ({"clip_threshold": "1"}, GefenOptionTypeError, "clip_threshold"),
        ({"clip_threshold": True}, GefenOptionTypeError, "clip_threshold"),
    ],
)
def test_constructor_rejects_bad_options(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Gefen(_model().parameters(), **kwargs)


def test_numpy_scalars_are_taken_as_torch_takes_them_and_saved_as_floats() -> None:
    import io

    import numpy as np

    model = _model()
    opt = Gefen(
        model.parameters(), lr=np.float32(1e-3), betas=(np.float64(0.9), np.float32(0.999)), eps=np.float64(1e-8)
    )
    group = opt.param_groups[0]
    assert [type(v) for v in (group["lr"], *group["betas"], group["eps"])] == [float] * 4
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # no numpy object in the state dict
    with pytest.raises(GefenOptionTypeError, match="learning rate"):
        Gefen(model.parameters(), lr=np.bool_(True))


def test_group_options_are_validated_with_the_group_index() -> None:
    model = _model()
    groups = [{"params": [model[0].weight]}, {"params": [model[0].bias], "betas": (0.9, 1.5)}]
    with pytest.raises(GefenOptionError, match=r"param_groups\[1\].*beta parameter at index 1"):
        Gefen(groups)


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        Gefen([])
    with pytest.raises(TypeError):
        Gefen([torch.nn.Parameter(torch.ones(2)), "not a tensor"])
    with pytest.raises(ParameterError, match="complex"):
        Gefen([torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))])
    # named as torch and GefenMuon name a place (it said "param_groups[0]: params[1]", no name)
    complex_named = [
        ("w", torch.nn.Parameter(torch.ones(2))),
        ("z", torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))),
    ]
    with pytest.raises(
        ParameterError, match=r"^param_groups\[0\]\['params'\]\[1\] \('z'\): Gefen does not support complex"
    ):
        Gefen(complex_named)
    with pytest.raises(ParameterError, match="not supported"):
        Gefen([torch.ones(2, dtype=torch.int64)])
    with pytest.raises(GefenOptionError, match="named parameters"):
        Gefen(_model().parameters(), period_one_substrings=("bias",))
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"is the same parameter as param_groups\[0\]"):
        Gefen([{"params": [p]}, {"params": [p]}])


def test_named_parameters_and_per_group_options() -> None:
    model = _model()
    named = list(model.named_parameters())
    opt = Gefen(
        [{"params": named[:2], "lr": 0.1, "betas": (0.8, 0.99)}, {"params": named[2:], "factored_v_2d": False}],
        lr=0.01,
        period_one_substrings=("bias",),
        min_dim_size_to_factor=8,
    )
    assert opt.param_groups[0]["param_names"] == ["0.weight", "0.bias"]
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[1]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    _train(model, opt, 2)
    assert period_of(opt.state[model[0].bias]) == 1  # the name override
    assert "v_row" in opt.state[model[0].weight] and "vmean" in opt.state[model[2].weight]


def test_add_param_group_is_all_or_nothing() -> None:
    model = _model()
    opt = Gefen([model[0].weight])
    before = deep_snapshot(opt)
    with pytest.raises(TypeError, match="must be a dict"):
        opt.add_param_group([model[0].bias])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'params' key"):
        opt.add_param_group({"lr": 0.1})
    with pytest.raises(ParameterError, match="complex"):
        opt.add_param_group({"params": [model[0].bias, torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))]})
    with pytest.raises(GefenOptionError, match="weight_decay"):
        opt.add_param_group({"params": [model[0].bias], "weight_decay": -1.0})
    with pytest.raises(ValueError, match="same parameter"):
        opt.add_param_group({"params": [model[0].weight]})
    with pytest.raises(TypeError, match="ordered collections"):  # torch's refusal: a set's order changes
        opt.add_param_group({"params": {model[0].bias}})
    assert not snapshot_diff(before, opt)
    opt.add_param_group({"params": model[0].bias, "lr": 0.5})
    assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    opt.add_param_group({"params": []})  # kept, as torch keeps it (ZeroRedundancyOptimizer builds them)
    assert opt.param_groups[2]["params"] == []


def test_closure_runs_first_and_training_reduces_the_loss() -> None:
    model = _model()
    opt = Gefen(model.parameters(), lr=1e-2)
    losses = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model)
        loss.backward()
        return loss

    for _ in range(20):
        losses.append(float(opt.step(closure).detach()))
    assert opt.codebook is not None and losses[-1] < losses[0] * 0.8


def test_frozen_parameters_step_once_they_get_gradients() -> None:
    model = _model()
    model[0].weight.requires_grad_(False)
    opt = Gefen(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    assert not opt.state.get(model[0].weight)
    model[0].weight.requires_grad_(True)
    before = model[0].weight.detach().clone()
    _train(model, opt, 1)
    assert opt.state[model[0].weight]["step"] == 1 and not torch.equal(before, model[0].weight)


def test_hooks_run() -> None:
    model = _model()
    opt = Gefen(model.parameters(), lr=1e-2)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("step_pre"))
    opt.register_step_post_hook(lambda *_: calls.append("step_post"))
    opt.register_state_dict_pre_hook(lambda *_: calls.append("sd_pre"))
    opt.register_state_dict_post_hook(lambda *_: calls.append("sd_post"))
    opt.register_load_state_dict_pre_hook(lambda *_: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda *_: calls.append("load_post"))
    _train(model, opt, 1)
    opt.load_state_dict(opt.state_dict())
    assert calls == ["step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post"]
    calls.clear()
    broken = opt.state_dict()
    broken["gefen_global_step"] = -1
    with pytest.raises(ValueError, match="global_step"):
        opt.load_state_dict(broken)
    assert calls == ["sd_pre", "sd_post", "load_pre"]


def _schedulers() -> dict[str, Any]:
    S = torch.optim.lr_scheduler
    return {
        "LambdaLR": lambda o: S.LambdaLR(o, lambda e: 0.9**e),
        "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda e: 0.9),
        "StepLR": lambda o: S.StepLR(o, step_size=2),
        "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[1, 3]),
        "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=2),
        "LinearLR": lambda o: S.LinearLR(o, start_factor=0.5, total_iters=3),
        "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
        "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=4),
        "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=4),
        "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=2),
        "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2),
        "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=10),
        "SequentialLR": lambda o: S.SequentialLR(
            o, [S.ConstantLR(o, factor=0.5, total_iters=2), S.ExponentialLR(o, gamma=0.9)], milestones=[2]
        ),
        "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5), S.ExponentialLR(o, gamma=0.9)]),
        "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=0, factor=0.5),
    }


@pytest.mark.parametrize("name", sorted(_schedulers()))
def test_every_lr_scheduler_drives_the_groups(name: str) -> None:
    model = _model()
    opt = Gefen(model.parameters(), lr=1e-2)
    scheduler = _schedulers()[name](opt)
    seen = set()
    for index in range(5):
        opt.zero_grad()
        loss = _loss(model, index)
        loss.backward()
        opt.step()
        if name == "ReduceLROnPlateau":
            scheduler.step(1.0)  # a flat metric halves the lr every step
        else:
            scheduler.step()
        seen.add(round(float(opt.param_groups[0]["lr"]), 12))
        opt.preflight_step()
    assert len(seen) > 1, f"{name} never changed the learning rate"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if name in ("CyclicLR", "OneCycleLR"):
        assert opt.param_groups[0]["betas"][0] != 0.9  # momentum cycling edits betas


def test_tensor_learning_rate_equals_float_learning_rate() -> None:
    a, b = _model(), _model()
    opt_a = Gefen(a.parameters(), lr=torch.tensor(3e-3))
    opt_b = Gefen(b.parameters(), lr=3e-3)
    _train(a, opt_a, 3)
    _train(b, opt_b, 3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_grad_scaler_with_cpu_autocast() -> None:
    model = _model()
    opt = Gefen(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for index in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, index)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert opt.global_step == 3


def test_grad_scaler_native_protocol_for_fp16_parameters() -> None:
    torch.manual_seed(0)
    half = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float16))
    twin = torch.nn.Parameter(half.detach().clone())
    opt = Gefen([half], lr=1e-2)
    reference = Gefen([twin], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    weights = torch.randn(8, 8)
    scaler.scale((half.float() * weights).sum()).backward()
    assert half.grad is not None and half.grad.dtype is torch.float16
    assert opt._step_supports_amp_scaling  # the plain path would refuse fp16 gradients
    twin.grad = half.grad / 256.0  # a power of two: exact
    scaler.step(opt)
    scaler.update()
    reference.step()
    assert torch.equal(half, twin) and opt.global_step == 1
    half.grad = torch.full((8, 8), float("inf"), dtype=torch.float16)
    before = deep_snapshot(opt, half)
    scaler.scale(torch.ones(()))
    scaler.step(opt)  # overflow: the whole step is skipped
    assert opt.global_step == 1
    assert not snapshot_diff(before, opt, half)


def test_an_overflow_on_the_first_step_skips_it_like_any_other() -> None:
    half = torch.nn.Parameter(torch.randn(8, 8).half())
    opt = Gefen([half], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    scaler.scale((half.float() * 1e4).sum()).backward()  # 2^20 * 1e4 overflows fp16
    assert not bool(torch.isfinite(half.grad).all())  # type: ignore[arg-type]
    before = half.detach().clone()
    scaler.step(opt)  # it raised GradientError: the plan refused a non-finite first gradient
    scaler.update()
    assert torch.equal(half, before) and opt.global_step == 0 and not opt.state
    assert scaler.get_scale() < 2.0**20


def test_protocols_and_contract() -> None:
    opt = Gefen(_model().parameters())
    assert isinstance(opt, ContractProvider) and isinstance(opt, StagedNativeLoad) and isinstance(opt, StepPreflight)
    contract = opt.optimizer_contract()
    assert contract.implementation == "gefen.Gefen"
    assert contract.capabilities.supports("staged_native_load")
    assert contract.capabilities.supports("parameter_shaped_state")  # even unnamed: state follows the parameters
    for feature in (
        "portable_state",
        "canonical_local_state",  # dynamic: once finalized by post_sharding (test_core_identity.py)
    ):
        status = contract.capabilities.feature(feature)
        assert not status.supported and status.reasons
    assert contract.capabilities.supports("post_sharding") and contract.capabilities.supports("collective_scope")
    assert contract.extensions["gefen.codebook_size"] == 256
    assert contract == opt.optimizer_contract()


def test_deepcopy_and_pickle_keep_the_learned_state() -> None:
    import copy
    import pickle

    model = _model()
    opt = Gefen(model.parameters(), lr=1e-2, stochastic_round=True)
    _train(model, opt, 2)
    for clone in (copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))):
        twin_model, twin = clone
        assert torch.equal(twin.codebook, opt.codebook) and twin.global_step == 2  # type: ignore[arg-type]
        _train(twin_model, twin, 2)
    _train(model, opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_adamw_defaults_and_keywords() -> None:
    """Swapping torch.optim.AdamW for Gefen keeps AdamW's defaults and accepts its keywords."""
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    adamw = torch.optim.AdamW(params)
    gefen = Gefen(params)
    for key in ("lr", "betas", "eps", "weight_decay", "maximize"):
        assert gefen.defaults[key] == adamw.defaults[key], key
    assert gefen.param_groups[0]["weight_decay"] == 1e-2
    # every keyword of AdamW's signature, at its default, as a script written for AdamW passes it
    signature = inspect.signature(torch.optim.AdamW.__init__).parameters.values()
    Gefen(params, **{p.name: p.default for p in signature if p.default is not inspect.Parameter.empty})
    for foreach in (None, True, False):
        Gefen(params, foreach=foreach, amsgrad=False)  # foreach is a hint with nothing to choose here
    with pytest.raises(GefenOptionError, match=r"differentiable=True.*carry no gradient"):
        Gefen(params, differentiable=True)
    with pytest.raises(GefenOptionTypeError, match="differentiable must be a bool"):
        Gefen(params, differentiable=1)  # type: ignore[arg-type]
    with pytest.raises(GefenOptionTypeError, match="foreach"):
        Gefen(params, foreach="yes")  # type: ignore[arg-type]
    with pytest.raises(GefenOptionError, match=r"amsgrad=True.*ContractedAdamW"):
        Gefen(params, amsgrad=True)
    # AdamW honours amsgrad per group: a group asking for it is refused, not silently ignored
    other = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(GefenOptionError, match=r"param_groups\[1\]: amsgrad=True"):
        Gefen([{"params": params}, {"params": [other], "amsgrad": True}])
    gefen = Gefen(params)
    with pytest.raises(GefenOptionError, match=r"param_groups\[1\]: amsgrad=True"):
        gefen.add_param_group({"params": [other], "amsgrad": True})
    with pytest.raises(GefenOptionTypeError, match=r"param_groups\[1\]: amsgrad must be a bool"):
        gefen.add_param_group({"params": [other], "amsgrad": 1})
    assert len(gefen.param_groups) == 1
    gefen.add_param_group({"params": [other], "amsgrad": False})
    # refused wherever a group is read: a load of a checkpoint whose group asks for it (changing
    # nothing), and a step after a user edited the group (tests/test_gefen_portable_state.py: an import)
    trained = Gefen(params, lr=1e-2)
    params[0].grad = torch.ones(4, 4)
    trained.step()
    saved = trained.state_dict()
    saved["param_groups"][0]["amsgrad"] = True
    fresh = Gefen(params)
    before = deep_snapshot(fresh)
    with pytest.raises(StateValidationError, match=r"param_groups\[0\]: amsgrad=True"):
        fresh.load_state_dict(saved)
    assert not snapshot_diff(before, fresh)
    trained.param_groups[0]["differentiable"] = True
    with pytest.raises(GefenOptionError, match=r"param_groups\[0\]: differentiable=True"):
        trained.step()
    positional = (1e-3, (0.9, 0.999), 1e-8, 1e-2, False)  # AdamW's five positional options, amsgrad last
    assert Gefen(params, *positional).defaults["lr"] == torch.optim.AdamW(params, *positional).defaults["lr"]


def test_a_parameter_on_the_meta_device_is_refused_at_its_first_step_by_name() -> None:
    from gefen_core import GefenMuon

    for build in (lambda p: Gefen([("w", p)]), lambda p: GefenMuon([("w", p)])):
        param = torch.nn.Parameter(torch.empty(8, 16, device="meta"))
        param.grad = torch.empty(8, 16, device="meta")
        optimizer = build(param)
        with pytest.raises(ParameterError, match=r"'w'.*meta device.*to_empty"):
            optimizer.step()
        assert not optimizer.state


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a non-contiguous tensor of its shape (every other element of a buffer)."""
    buffer = torch.zeros(2 * tensor.numel(), dtype=tensor.dtype)
    strided = buffer[::2].view(tensor.shape) if tensor.dim() < 2 else buffer.view(*tensor.shape, 2)[..., 0]
    strided.copy_(tensor)
    assert not strided.is_contiguous() and torch.equal(strided, tensor)
    return strided


#: Gefen's factored, block and per-element second moments; GefenMuon's matrices (NorMuon's ``v``).
_STRIDED_CASES = {
    "gefen": ([(256, 256), (64,), (16, 32)], lambda params, fused: Gefen(params, lr=1e-2, fused=fused)),
    "muon": ([(32, 64), (16, 48)], lambda params, fused: GefenMuon(params, lr=1e-2, fused=fused, normuon=True)),
}


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("name", sorted(_STRIDED_CASES))
def test_state_left_strided_between_steps_steps_as_if_contiguous(name: str, fused: bool | None) -> None:
    """torch's optimizers take state of any strides. The kernels need contiguous state, and a
    strided tensor was refused mid-step: after earlier buckets (matrices) had stepped and the
    failing one's counters had advanced. The step now makes it contiguous, equal to an
    untouched twin."""
    torch.manual_seed(0)
    shapes, build = _STRIDED_CASES[name]
    edited = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in edited]
    optimizers = [build(params, fused) for params in (edited, twin)]
    for step in range(3):
        for params, optimizer in zip((edited, twin), optimizers):
            for index, param in enumerate(params):
                param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 * step + index))
            optimizer.step()
        if step == 1:
            for state in optimizers[0].state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        state[key] = _strided(value)
            held = [dict(state) for state in optimizers[0].state.values()]
            optimizers[0].preflight_step()  # changes nothing, strided state included
            assert all(a == dict(b) for a, b in zip(held, optimizers[0].state.values()))
            assert_trees_equal(optimizers[0].state_dict(), optimizers[1].state_dict(), "strided state's export")
    for mine, other in zip(edited, twin):
        assert torch.equal(mine, other)
    assert_trees_equal(optimizers[0].state_dict(), optimizers[1].state_dict(), "state after the edit")

"""ContractedAdamW: bit-identity with torch.optim.AdamW, fail-before-mutation step and load,
and the conformance kit."""

from __future__ import annotations

import copy
import io
from typing import Any

import numpy as np
import pytest
import torch
from gefen_contracts import FEATURE_COLLECTIVE_SCOPE, StaleTransactionError, StateValidationError
from gefen_contracts.testing import ConformanceTarget, assert_conformant, deep_snapshot, run_conformance, snapshot_diff
from gefen_hybrid import ADAMW_IMPLEMENTATION, ContractedAdamW
from gefen_hybrid.conformance import adamw_factory
from hybrid_toys import CONTRIBUTED_WAIVERS, single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(4, 6, generator=generator).to(next(model.parameters()).dtype)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    first, second = model[0], model[2]
    return [
        {"params": list(first.named_parameters(prefix="0"))},
        {"params": list(second.named_parameters(prefix="2")), "lr": 3e-3, "weight_decay": 0.0},
    ]


def _assert_state_dicts_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid in a["state"]:
        for key, value in a["state"][pid].items():
            other = b["state"][pid][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (pid, key)


FLAG_CASES = [
    {"foreach": False},
    {"foreach": True},
    {"fused": True},
    {"foreach": False, "amsgrad": True, "maximize": True},
    {"fused": True, "amsgrad": True},
]


@pytest.mark.parametrize("flags", FLAG_CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_bit_identical_to_torch_adamw_with_the_same_flags(flags: dict[str, Any]) -> None:
    reference_model, model = _model(), _model()
    reference = torch.optim.AdamW(_groups(reference_model), lr=1e-2, weight_decay=0.05, **flags)
    contracted = ContractedAdamW(_groups(model), lr=1e-2, weight_decay=0.05, **flags)
    _train(reference_model, reference, 5)
    _train(model, contracted, 5)
    for a, b in zip(reference_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    _assert_state_dicts_equal(reference.state_dict(), contracted.state_dict())


def test_bit_identical_in_float64() -> None:
    reference_model, model = _model(dtype=torch.float64), _model(dtype=torch.float64)
    reference = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, foreach=True)
    contracted = ContractedAdamW(model.named_parameters(), lr=1e-2, foreach=True)
    _train(reference_model, reference, 4)
    _train(model, contracted, 4)
    assert all(torch.equal(a, b) for a, b in zip(reference_model.parameters(), model.parameters()))


def test_hooks_fire_once_and_the_closure_runs_once() -> None:
    model = _model()
    optimizer = ContractedAdamW(model.named_parameters())
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))

    def closure() -> torch.Tensor:
        calls.append("closure")
        optimizer.zero_grad()
        loss = model(torch.ones(2, 6)).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert calls == ["pre", "closure", "post"]
    assert isinstance(loss, torch.Tensor)


def test_differentiable_is_refused() -> None:
    with pytest.raises(ValueError, match="differentiable"):
        ContractedAdamW(_model().named_parameters(), differentiable=True)


def test_a_sparse_gradient_in_a_later_group_changes_nothing_unlike_torch() -> None:
    def run(cls: type[torch.optim.Optimizer]) -> tuple[bool, list[str]]:
        model = _model()
        optimizer = cls(_groups(model), lr=1e-2, foreach=False)
        _train(model, optimizer, 1)
        x = torch.randn(4, 6)
        optimizer.zero_grad()
        model(x).sum().backward()
        last = model[2].weight
        last.grad = last.grad.to_sparse()
        before = deep_snapshot(optimizer, model)
        with pytest.raises(RuntimeError, match="sparse"):
            optimizer.step()
        return True, snapshot_diff(before, optimizer, model)

    _, torch_diffs = run(torch.optim.AdamW)
    assert torch_diffs, "torch AdamW steps the first group before refusing the second"
    _, diffs = run(ContractedAdamW)
    assert diffs == []


def test_capturable_on_the_cpu_is_refused_before_any_change_unlike_torch() -> None:
    """torch creates the state of a ``capturable=True`` group on the CPU, then asserts the device
    (a half-made step; inside a composite, after the other child stepped); the preflight refuses
    first."""

    def run(cls: type[torch.optim.Optimizer]) -> list[str]:
        model = _model()
        optimizer = cls(model.parameters(), lr=1e-2, capturable=True)
        model(torch.randn(4, 6)).sum().backward()
        before = deep_snapshot(optimizer, model)
        with pytest.raises((RuntimeError, AssertionError), match="capturable=True"):
            optimizer.step()
        return snapshot_diff(before, optimizer, model)

    assert run(torch.optim.AdamW), "torch AdamW creates the state before refusing"
    assert run(ContractedAdamW) == []


def _trained(seed: int = 0, **kwargs: Any) -> tuple[nn.Module, ContractedAdamW]:
    model = _model(seed)
    optimizer = ContractedAdamW(_groups(model), lr=1e-2, **kwargs)
    _train(model, optimizer, 2)
    return model, optimizer


def _refused(state_dict: dict[str, Any], match: str, **kwargs: Any) -> None:
    model, optimizer = _trained(1, **kwargs)
    before = deep_snapshot(optimizer, model)
    with pytest.raises(StateValidationError, match=match):
        optimizer.load_state_dict(state_dict)
    assert snapshot_diff(before, optimizer, model) == []


def test_a_wrong_dtype_torch_would_silently_cast_is_refused() -> None:
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].double()
    torch_model = _model(1)
    torch_optimizer = torch.optim.AdamW(_groups(torch_model), lr=1e-2)
    torch_optimizer.load_state_dict(copy.deepcopy(state))  # torch casts float64 -> float32 silently
    assert torch_optimizer.state_dict()["state"][0]["exp_avg"].dtype == torch.float32
    _refused(state, "dtype torch.float64")


def test_a_missing_step_is_refused_before_any_change() -> None:
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    del state["state"][1]["step"]
    _refused(state, r"missing \['step'\]")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda sd: sd["state"][0].__setitem__("step", torch.tensor(1.5)), "whole number"),
        (lambda sd: sd["state"][0].__setitem__("exp_avg_sq", -sd["state"][0]["exp_avg_sq"] - 1), "negative"),
        (lambda sd: sd["param_groups"][0].__setitem__("amsgrad", True), "different algorithm"),
        (lambda sd: sd["param_groups"][0].__setitem__("eps", float("nan")), "'eps'"),
        (lambda sd: sd["param_groups"][1].__setitem__("betas", (0.9, 1.0)), r"'betas'\[1\]"),
        (lambda sd: sd["param_groups"][0].__setitem__("lr", True), "bool rejected"),
        (lambda sd: sd["param_groups"][0]["param_names"].reverse(), "names differ: the same names in another order"),
        (lambda sd: sd["state"].__setitem__(99, {}), "names no parameter"),
        (lambda sd: sd.__setitem__("extra", 1), "top-level keys"),
        (lambda sd: sd["state"][0].__setitem__("step", torch.empty((), device="meta")), "meta device"),
        (lambda sd: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"].to("meta")), "meta device"),
    ],
    ids=[
        "fractional_step",
        "negative_moment",
        "math_flag",
        "nan_eps",
        "beta_one",
        "bool_lr",
        "names",
        "id",
        "key",
        "meta_step",
        "meta_moment",
    ],
)
def test_invalid_checkpoints_are_refused_without_change(edit: Any, match: str) -> None:
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    edit(state)
    _refused(state, match)


def test_load_takes_hyperparameters_and_extras_keeps_execution_flags_and_never_aliases() -> None:
    _, source = _trained(foreach=True)
    source.param_groups[0]["lr"] = 7e-3
    source.param_groups[0]["initial_lr"] = 1e-2
    saved = source.state_dict()
    snapshot = copy.deepcopy(saved)
    model, optimizer = _trained(1, foreach=False)
    optimizer.load_state_dict(saved)
    group = optimizer.param_groups[0]
    assert group["lr"] == 7e-3 and group["initial_lr"] == 1e-2
    assert group["foreach"] is False  # this process's execution choice is kept
    loaded = optimizer.state_dict()
    _train(model, optimizer, 1, start=5)
    for pid, entry in snapshot["state"].items():  # the caller's tensors were copied, not adopted
        for key, value in entry.items():
            assert torch.equal(saved["state"][pid][key], value)
    assert loaded["state"][0]["exp_avg"].data_ptr() != saved["state"][0]["exp_avg"].data_ptr()


@pytest.mark.parametrize("rate", ["lr", "betas"])
def test_a_tensor_rate_is_refused_by_a_foreach_load_that_could_not_step_it(rate: str) -> None:
    # the execution flags stay this process's, so a checkpoint's tensor rate meets foreach=True,
    # which preflight_step (as torch's foreach step) refuses: refuse the load, not every step
    rates = {"lr": torch.tensor(1e-3)} if rate == "lr" else {"betas": (torch.tensor(0.9), torch.tensor(0.999))}
    source_model = _model(0)
    source = ContractedAdamW(_groups(source_model), **rates)  # type: ignore[arg-type]
    _train(source_model, source, 2)
    _refused(source.state_dict(), f"checkpoint holds {rate} as tensors.*foreach=False", foreach=True)
    capturable_model, capturable = _trained(1, foreach=False)
    capturable.load_state_dict(source.state_dict())  # the same checkpoint loads and steps without foreach
    _train(capturable_model, capturable, 1, start=5)


def test_foreach_none_is_judged_as_torch_resolves_it_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # the CPU twin of CUDA parameters: torch's default turns foreach on for them (and back off
    # for a tensor lr without capturable, but not for tensor betas)
    source_model = _model(0)
    source = ContractedAdamW(_groups(source_model), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    _train(source_model, source, 2)
    tensor_lr_model = _model(0)
    tensor_lr = ContractedAdamW(_groups(tensor_lr_model), lr=torch.tensor(1e-3))
    _train(tensor_lr_model, tensor_lr, 2)
    import torch.optim.optimizer as torch_optimizer

    monkeypatch.setattr(torch_optimizer, "_default_to_fused_or_foreach", lambda *args, **kwargs: (False, True))
    _refused(source.state_dict(), "checkpoint holds betas as tensors.*foreach=False")  # foreach=None
    _, optimizer = _trained(1)
    optimizer.load_state_dict(tensor_lr.state_dict())  # torch runs a tensor lr single-tensor: it steps
    optimizer.preflight_step()
    optimizer.param_groups[0]["lr"] = 1e-3  # a float lr: torch keeps the multi-tensor path
    optimizer.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.999))
    with pytest.raises(ValueError, match="beta1 as a Tensor"):  # refused before any group steps
        optimizer.preflight_step()


def test_resume_is_bit_exact_through_a_weights_only_file() -> None:
    model, optimizer = _trained()
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    twin_model, twin = _trained(1)
    twin_model.load_state_dict(model.state_dict())
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    _train(model, optimizer, 3, start=2)
    _train(twin_model, twin, 3, start=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_staged_transactions_are_single_use_owned_and_fresh() -> None:
    model, optimizer = _trained()
    valid = optimizer.state_dict()
    staged = optimizer.stage_state_dict(valid)
    _, other = _trained(1)
    with pytest.raises(StaleTransactionError, match="another optimizer"):
        other.commit_staged_state_dict(staged)
    _train(model, optimizer, 1, start=9)
    with pytest.raises(StaleTransactionError, match="changed"):
        optimizer.commit_staged_state_dict(staged)
    fresh = optimizer.stage_state_dict(valid)
    optimizer.commit_staged_state_dict(fresh)
    with pytest.raises(StaleTransactionError, match="consumed"):
        optimizer.commit_staged_state_dict(fresh)


def test_contract_names_and_negative_reasons() -> None:
    contract = ContractedAdamW(_model().named_parameters()).optimizer_contract()
    assert contract.implementation == ADAMW_IMPLEMENTATION == "gefen.ContractedAdamW"
    status = contract.capabilities.feature(FEATURE_COLLECTIVE_SCOPE)
    assert not status.supported and "learns nothing collectively" in status.reasons[0]
    for name, feature in contract.capabilities.features.items():
        assert feature.supported or feature.reasons, name


def test_conformance_kit_passes_on_contracted_adamw() -> None:
    waive = {**adamw_factory.conformance_waive, **CONTRIBUTED_WAIVERS}  # type: ignore[attr-defined]
    report = run_conformance(
        ConformanceTarget(adamw_factory, name="ContractedAdamW"), waive=waive, include_contributed=False
    )
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status.value == "passed"}
    assert {"checkpoint.native_atomic_load", "checkpoint.native_roundtrip", "state.declared_variants"} <= passed


class _WithScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.logit_scale = nn.Parameter(torch.tensor(1.0))  # 0-dim, as a CLIP-style temperature


def _with_scalar(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _WithScalar()


def test_the_kit_compares_0_dim_parameters_bit_for_bit() -> None:
    """The kit's bitwise comparison flattens first: a byte view of a 0-dim parameter is refused
    by torch, which failed every training check of a correct optimizer on such a model."""
    from gefen_contracts.testing.checks.training import ReplicatedTrainingCheck

    target = ConformanceTarget(adamw_factory, name="ContractedAdamW", model_builder=_with_scalar)
    report = run_conformance(target, checks=[ReplicatedTrainingCheck()], include_contributed=False)
    results = {r.name: r.status.value for r in report.results}
    assert results["training.replicated"] == "passed", report


def test_a_torch_2_6_checkpoint_without_decoupled_weight_decay_loads_as_torch_loads_it() -> None:
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    for group in state["param_groups"]:
        del group["decoupled_weight_decay"]  # what torch < 2.7 wrote; AdamW always decouples
    _, target = _trained()
    target.load_state_dict(state)
    assert all(group["decoupled_weight_decay"] is True for group in target.param_groups)


def test_a_checkpoint_of_an_older_torch_layout_loads_as_torch_loads_it() -> None:
    """torch before 1.13 saved no ``differentiable``/``fused`` (earlier still no ``capturable``,
    ``foreach`` or ``maximize``) and a number for ``step``; torch's ``__setstate__`` fills the
    defaults and makes the step a tensor. Such a checkpoint was refused for its missing keys."""
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    for group in state["param_groups"]:
        for key in ("differentiable", "fused", "capturable", "foreach", "maximize", "decoupled_weight_decay"):
            del group[key]
    for entry in state["state"].values():
        entry["step"] = int(entry["step"])
    model, target = _trained()
    reference_model, _ = _trained()
    reference = torch.optim.AdamW(_groups(reference_model), lr=1e-2)
    target.load_state_dict(copy.deepcopy(state))
    reference.load_state_dict(copy.deepcopy(state))
    assert all(isinstance(entry["step"], torch.Tensor) for entry in target.state.values())
    _train(model, target, 2, start=2)
    _train(reference_model, reference, 2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference_model.parameters()))


def test_a_numpy_group_value_loads_as_torch_keeps_it() -> None:
    """torch keeps any group value as saved; the load refused a numpy ``initial_lr`` (which a
    scheduler may write), so the optimizer could not reload its own state dict."""
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    state["param_groups"][0]["initial_lr"] = np.float64(1e-2)
    _, target = _trained()
    target.load_state_dict(state)
    assert type(target.param_groups[0]["initial_lr"]) is np.float64


def test_preflight_refuses_what_torch_refuses_only_after_stepping_earlier_groups() -> None:
    torch.manual_seed(0)
    real, other = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    complex_ = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    # a complex parameter trained with foreach, resumed fused: its loaded state made preflight skip the check
    source = ContractedAdamW([{"params": [("a", real)]}, {"params": [("c", complex_)]}], lr=1e-2, foreach=False)
    real.grad, complex_.grad = torch.randn(3), torch.randn(3, dtype=torch.complex64)
    source.step()
    fused = ContractedAdamW([{"params": [("a", real)]}, {"params": [("c", complex_)]}], lr=1e-2, fused=True)
    fused.load_state_dict(source.state_dict())
    before = deep_snapshot(fused, real, complex_)
    with pytest.raises(RuntimeError, match="fused=True"):
        fused.step()
    assert not snapshot_diff(before, fused, real, complex_)
    # tensor betas in a foreach group: torch raises after stepping the groups before it
    multi = ContractedAdamW([("a", real)], lr=1e-2, foreach=True)
    multi.add_param_group({"params": [("b", other)], "betas": (torch.tensor(0.9), torch.tensor(0.999))})
    real.grad, other.grad = torch.ones(3), torch.ones(3)
    before = deep_snapshot(multi, real, other)
    with pytest.raises(ValueError, match="beta1 as a Tensor"):
        multi.step()
    assert not snapshot_diff(before, multi, real, other)
    # the model moved to float64 after a step: torch fails on the float32 state mid-step
    moved = ContractedAdamW([{"params": [("a", real)]}, {"params": [("b", other)]}], lr=1e-2, foreach=False)
    real.grad, other.grad = torch.ones(3), torch.ones(3)
    moved.step()
    other.data = other.data.double()
    real.grad, other.grad = torch.ones(3), torch.ones(3, dtype=torch.float64)
    before = deep_snapshot(moved, real, other)
    with pytest.raises(RuntimeError, match=r"float64 parameter on cpu holds exp_avg as torch\.float32"):
        moved.step()
    assert not snapshot_diff(before, moved, real, other)


@pytest.mark.parametrize("rate", [np.float32(3e-3), torch.tensor(3e-3)], ids=["numpy", "tensor"])
def test_a_rate_set_mid_run_as_a_numpy_scalar_or_a_tensor_resumes_like_torch(rate: object) -> None:
    """A trainer may set ``param_groups[i]['lr']`` to a numpy scalar or a tensor between steps;
    torch's AdamW steps and resumes with it. The optimizer's own checkpoint must load into one
    built with a float, the rate in its saved form as torch adopts it (converted to a float it
    changed the resumed run's last bits), and into one built with a tensor rate, as a tensor."""
    model, optimizer = _trained()
    optimizer.param_groups[0]["lr"] = rate
    _train(model, optimizer, 1, start=2)
    twin_model, twin = _trained(1)
    twin_model.load_state_dict(model.state_dict())
    twin.load_state_dict(optimizer.state_dict())
    loaded = twin.param_groups[0]["lr"]
    assert type(loaded) is type(rate) and float(loaded) == float(rate)  # type: ignore[arg-type]
    assert not isinstance(rate, torch.Tensor) or loaded is not rate  # a copy, as torch deep-copies
    _train(model, optimizer, 2, start=3)
    _train(twin_model, twin, 2, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    tensor_model = _model()
    tensor_rate = ContractedAdamW(_groups(tensor_model), lr=torch.tensor(1e-2))
    tensor_rate.load_state_dict(optimizer.state_dict())  # numbers into a tensor-rate optimizer
    assert isinstance(tensor_rate.param_groups[0]["lr"], torch.Tensor)
    assert float(tensor_rate.param_groups[0]["lr"]) == pytest.approx(float(torch.as_tensor(rate)))


def test_a_fused_capturable_group_on_the_cpu_steps_as_torch_steps_it() -> None:
    """torch asserts a capturable device in its single-tensor and foreach paths only; its fused
    kernel steps on the CPU. The preflight refused every capturable group off CUDA."""
    torch.manual_seed(0)
    mine, theirs = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    theirs.data.copy_(mine.data)
    ours = ContractedAdamW([mine], lr=1e-2, fused=True, capturable=True)
    reference = torch.optim.AdamW([theirs], lr=1e-2, fused=True, capturable=True)
    for _ in range(2):
        mine.grad, theirs.grad = torch.ones(3), torch.ones(3)
        ours.step()
        reference.step()
    assert torch.equal(mine, theirs)


def test_a_compiled_step_is_traced_as_torchs_without_abandoned_frames() -> None:
    """Dynamo traces every group as capturable; the preflight's capturable device check then
    raised inside the traced step and dynamo fell back to eager for those frames."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = nn.Linear(4, 3)
    optimizer = ContractedAdamW(model.parameters(), lr=1e-2)
    step = torch.compile(optimizer.step)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).square().mean().backward()
        step()
    abandoned = [key for key in counters["unimplemented"] if "Observed exception" in key]
    assert abandoned == [], abandoned

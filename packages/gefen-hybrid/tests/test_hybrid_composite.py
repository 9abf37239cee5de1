"""The composite behaves as one torch optimizer: views, schedulers, GradScaler, hooks,
closure, state, resume, and a step that fails before any child mutates."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from hybrid_toys import SignMomentum, llama_loss, make_tiny_llama, single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn

MUON_LR, BACKUP_LR = 1e-3, 2.5e-4


def _build(seed: int = 0) -> tuple[nn.Module, CompositeOptimizer]:
    model = make_tiny_llama(seed)
    optimizer = CompositeOptimizer.from_factories(
        model,
        {
            "muon": lambda named: SignMomentum(named, lr=MUON_LR, momentum=0.9),
            "backup": lambda named: ContractedAdamW(named, lr=BACKUP_LR, weight_decay=0.01),
        },
    )
    return model, optimizer


def _backward(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> torch.Tensor:
    optimizer.zero_grad()
    loss = llama_loss(model, step)
    loss.backward()
    return loss


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        _backward(model, optimizer, step)
        optimizer.step()


def _values(model: nn.Module, optimizer: CompositeOptimizer) -> dict[str, torch.Tensor]:
    """Parameters and every child's state, cloned, by name."""
    values = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for role, child in optimizer.child_optimizers().items():
        for pid, entry in child.state_dict()["state"].items():
            for key, value in entry.items():
                values[f"{role}:{pid}:{key}"] = torch.as_tensor(value).clone()
    return values


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_param_groups_are_a_live_view_muon_first() -> None:
    _, optimizer = _build()
    muon, backup = optimizer.child_optimizers().values()
    groups = optimizer.param_groups
    assert [g["lr"] for g in groups] == [MUON_LR, BACKUP_LR]
    assert groups[0] is muon.param_groups[0] and groups[1] is backup.param_groups[0]
    assert optimizer.param_groups is not groups
    groups[1]["lr"] = 1.0
    assert backup.param_groups[0]["lr"] == 1.0
    with pytest.raises(TypeError, match="view"):
        optimizer.param_groups = []


def test_step_lr_keeps_each_childs_ratio() -> None:
    model, optimizer = _build()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    _train(model, optimizer, 1)
    scheduler.step()
    muon, backup = optimizer.child_optimizers().values()
    assert muon.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert backup.param_groups[0]["lr"] == pytest.approx(2.5e-5)


def test_reduce_lr_on_plateau_reaches_both_children() -> None:
    model, optimizer = _build()
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    _train(model, optimizer, 1)
    scheduler.step(1.0)
    scheduler.step(2.0)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([MUON_LR / 2, BACKUP_LR / 2])


def test_grad_scaler_finite_step_equals_the_unscaled_step() -> None:
    model, optimizer = _build()
    twin_model, twin = _build()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(2):
        optimizer.zero_grad()
        scaler.scale(llama_loss(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    _train(twin_model, twin, 2)
    _assert_equal(_values(model, optimizer), _values(twin_model, twin))


def test_grad_scaler_overflow_skips_both_children() -> None:
    model, optimizer = _build()
    _train(model, optimizer, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    before = _values(model, optimizer)
    optimizer.zero_grad()
    scaler.scale(llama_loss(model, 1)).backward()
    model.norm.bias.grad[0] = float("inf")  # a backup parameter overflows
    scaler.step(optimizer)
    scaler.update()
    _assert_equal(before, _values(model, optimizer))
    assert scaler.get_scale() == 2.0**9


def test_instance_hooks_fire_once_and_child_hooks_once_per_composite_call() -> None:
    model, optimizer = _build()
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    optimizer.register_state_dict_pre_hook(lambda *_: calls.append("sd_pre"))
    optimizer.register_state_dict_post_hook(lambda opt, sd: calls.append("sd_post:" + ",".join(sorted(sd))))
    optimizer.register_load_state_dict_pre_hook(lambda *_: calls.append("load_pre"))
    optimizer.register_load_state_dict_post_hook(lambda *_: calls.append("load_post"))
    for role, child in optimizer.child_optimizers().items():
        child.register_step_post_hook(lambda *_, role=role: calls.append(f"{role}_step"))
        child.register_load_state_dict_post_hook(lambda *_, role=role: calls.append(f"{role}_load"))
    _train(model, optimizer, 1)
    assert calls == ["pre", "muon_step", "backup_step", "post"]
    calls.clear()
    state = optimizer.state_dict()
    assert calls == ["sd_pre", "sd_post:child_implementations,format,format_version,param_groups,routing,state"]
    calls.clear()
    optimizer.load_state_dict(state)
    assert calls == ["load_pre", "muon_load", "backup_load", "load_post"]


def test_a_step_pre_hook_may_inject_a_closure_and_a_bogus_return_changes_nothing() -> None:
    model, optimizer = _build()
    _backward(model, optimizer, 0)
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: (args, {"closure": lambda: 42.0}))
    assert optimizer.step() == 42.0
    handle.remove()
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: "bogus")
    before = deep_snapshot(optimizer, model)
    with pytest.raises(RuntimeError, match="new_args"):
        optimizer.step()
    assert snapshot_diff(before, optimizer, model) == []


def test_the_closure_runs_once_with_grad_enabled_and_its_loss_is_returned() -> None:
    model, optimizer = _build()
    seen: list[bool] = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return _backward(model, optimizer, 0)

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert seen == [True]
    assert loss is not None and loss.requires_grad


def test_zero_grad_reaches_every_child() -> None:
    model, optimizer = _build()
    _backward(model, optimizer, 0)
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_state_is_a_routed_view() -> None:
    model, optimizer = _build()
    muon, backup = optimizer.child_optimizers().values()
    hidden, norm = model.layers[0].q_proj.weight, model.norm.weight
    assert optimizer.state.get(hidden) is None and hidden not in optimizer.state
    assert len(muon.state) == 0  # get and `in` create nothing
    _train(model, optimizer, 1)
    assert optimizer.state[hidden] is muon.state[hidden]
    assert optimizer.state[norm] is backup.state[norm]
    assert len(optimizer.state) == len(muon.state) + len(backup.state)
    with pytest.raises(KeyError, match="not a parameter"):
        optimizer.state[torch.zeros(1)]
    with pytest.raises(TypeError, match="view"):
        optimizer.state = {}  # type: ignore[assignment]


def test_resume_is_bit_exact_through_a_fresh_composite_and_a_weights_only_file() -> None:
    model, optimizer = _build()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(4):
        _train(model, optimizer, 1, start=step)
        scheduler.step()

    half_model, half = _build()
    half_scheduler = torch.optim.lr_scheduler.StepLR(half, step_size=1, gamma=0.5)
    for step in range(2):
        _train(half_model, half, 1, start=step)
        half_scheduler.step()
    buffer = io.BytesIO()
    torch.save(
        {"model": half_model.state_dict(), "opt": half.state_dict(), "sched": half_scheduler.state_dict()}, buffer
    )
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, resumed = _build(seed=7)
    resumed_scheduler = torch.optim.lr_scheduler.StepLR(resumed, step_size=1, gamma=0.5)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    resumed_scheduler.load_state_dict(saved["sched"])
    for step in range(2, 4):
        _train(resumed_model, resumed, 1, start=step)
        resumed_scheduler.step()
    _assert_equal(_values(model, optimizer), _values(resumed_model, resumed))
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in resumed.param_groups]


def test_a_preflight_failure_in_one_child_steps_neither_child() -> None:
    model, optimizer = _build()
    _train(model, optimizer, 1)
    _backward(model, optimizer, 1)
    model.layers[1].o_proj.weight.grad[0, 0] = float("nan")  # muon child refuses
    before = deep_snapshot(optimizer, model)
    with pytest.raises(ValueError, match="not finite"):  # single process: the child's own error
        optimizer.step()
    assert snapshot_diff(before, optimizer, model) == []


def test_deepcopy_gives_an_independent_composite_that_steps_identically() -> None:
    model, optimizer = _build()
    _train(model, optimizer, 1)
    twin_model, twin = copy.deepcopy((model, optimizer))
    _train(model, optimizer, 2, start=1)
    _train(twin_model, twin, 2, start=1)
    _assert_equal(_values(model, optimizer), _values(twin_model, twin))
    assert twin.child_optimizers()["muon"] is not optimizer.child_optimizers()["muon"]


def test_constructor_refuses_children_it_cannot_compose() -> None:
    w, b = nn.Parameter(torch.randn(2, 2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="ContractedAdamW"):
        CompositeOptimizer({"backup": torch.optim.AdamW([("b", b)])})
    with pytest.raises(TypeError, match="named parameters"):
        CompositeOptimizer({"backup": ContractedAdamW([b])})
    with pytest.raises(ValueError, match="both"):
        CompositeOptimizer({"muon": SignMomentum([("w", w)]), "backup": ContractedAdamW([("w2", w)])})
    with pytest.raises(ValueError, match="both"):
        CompositeOptimizer({"muon": SignMomentum([("w", w)]), "backup": ContractedAdamW([("w", b)])})
    same = ContractedAdamW([("w", w)])
    with pytest.raises(ValueError, match="two roles"):
        CompositeOptimizer({"muon": same, "backup": same})
    with pytest.raises(ValueError, match="child role"):
        CompositeOptimizer({"adam": same})


def test_repr_and_children_and_routing() -> None:
    _, optimizer = _build()
    assert repr(optimizer) == (
        "CompositeOptimizer(implementation='gefen.CompositeOptimizer', muon=SignMomentum(10 parameters), "
        "backup=ContractedAdamW(7 parameters))"
    )
    assert tuple(optimizer.child_optimizers()) == ("muon", "backup")
    routing = optimizer.parameter_routing()
    assert list(routing) == sorted(routing) and len(routing) == 17
    with pytest.raises(TypeError):
        optimizer.child_optimizers()["muon"] = None  # type: ignore[index]


def test_a_copy_leaves_hooks_and_a_schedulers_step_wrapper_behind_like_torch() -> None:
    """An LR scheduler wraps ``optimizer.step`` on the instance (a weak reference to the
    original) and hooks may be lambdas: torch's optimizers drop both on copy and pickling.
    A copied composite stepped the original, and pickling it failed."""
    model, optimizer = _build()
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    optimizer.register_step_post_hook(lambda opt, args, kwargs: None)
    _train(model, optimizer, 1)
    before = _values(model, optimizer)
    twin_model, twin = copy.deepcopy((model, optimizer))
    _train(twin_model, twin, 1, start=1)
    _assert_equal(_values(model, optimizer), before)  # the original did not move
    assert not twin._optimizer_step_post_hooks and "step" not in vars(twin)
    restored = pickle.loads(pickle.dumps(optimizer))
    assert isinstance(restored, CompositeOptimizer) and not restored._optimizer_step_post_hooks

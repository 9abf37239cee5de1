"""ContractedAdamW canonical local state: FQN routing across regrouped and reordered targets,
bit-exact continuation, no mutation by prepare, stale/reused/foreign preparations refused,
corrupted documents refused without change, and the document format pinned by a golden vector."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import StaleTransactionError, StateValidationError
from gefen_contracts.testing import deep_snapshot, install_parameters, replicated_copy_plan, snapshot_diff
from gefen_contracts.torch_support import BOUND_STATE_FORMAT
from gefen_hybrid import ContractedAdamW
from hybrid_golden import check_golden
from hybrid_toys import single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.Encoder = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.Encoder(x)))  # type: ignore[no-any-return]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return model(torch.randn(6, 5, generator=generator)).pow(2).mean()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        optimizer.step()


GroupsOf = Callable[[dict[str, torch.Tensor]], list[dict[str, Any]]]


def source_groups(named: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    encoder = [(n, p) for n, p in named.items() if n.startswith("Encoder")]
    head = [(n, p) for n, p in named.items() if n.startswith("head")]
    return [{"params": encoder}, {"params": head, "lr": 3e-3, "weight_decay": 0.0}]


def regrouped(named: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Groups swapped, parameters reversed inside them, other live options (the document's win)."""
    head = [(n, named[n]) for n in ("head.bias", "head.weight")]
    encoder = [(n, named[n]) for n in ("Encoder.bias", "Encoder.weight")]
    return [{"params": head, "lr": 0.5}, {"params": encoder, "lr": 0.25, "eps": 1e-3}]


def _bound(seed: int = 0, groups: GroupsOf = source_groups, **kwargs: Any) -> tuple[nn.Module, ContractedAdamW]:
    torch.manual_seed(seed)
    model = Net()
    named = dict(model.named_parameters())
    optimizer = ContractedAdamW(groups(named), lr=1e-2, **kwargs)
    plan = replicated_copy_plan(list(named.items()))
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in named.items()})
    return model, optimizer


def _trained(**kwargs: Any) -> tuple[nn.Module, ContractedAdamW]:
    model, optimizer = _bound(**kwargs)
    _train(model, optimizer, 3)
    optimizer.param_groups[1]["initial_lr"] = 3e-3  # an extra key (an LR scheduler's) travels along
    return model, optimizer


def _target(source: nn.Module, groups: GroupsOf = regrouped, **kwargs: Any) -> tuple[nn.Module, ContractedAdamW]:
    model, optimizer = _bound(1, groups, **kwargs)
    model.load_state_dict(source.state_dict())
    return model, optimizer


@pytest.mark.parametrize("flags", [{}, {"amsgrad": True, "foreach": True}], ids=["adamw", "amsgrad"])
def test_a_regrouped_reordered_target_continues_bit_exactly(flags: dict[str, Any]) -> None:
    model, optimizer = _trained(**flags)
    document = optimizer.export_local_state()
    assert document["format"] == BOUND_STATE_FORMAT and list(document["parameters"]) == sorted(document["parameters"])
    entry = document["parameters"]["Encoder.weight"]
    assert entry["compatibility_name"] == "Encoder.weight" and entry["variant"] == (
        "adamw_amsgrad" if flags else "adamw"
    )
    assert entry["state"]["step"] == 3 and type(entry["state"]["step"]) is int
    live = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
    assert entry["state"]["exp_avg"].data_ptr() != live.data_ptr()  # an owned copy
    twin_model, twin = _target(model, **flags)
    hooks: list[str] = []
    twin.register_load_state_dict_pre_hook(lambda *_: hooks.append("pre"))
    twin.register_load_state_dict_post_hook(lambda *_: hooks.append("post"))
    twin.commit_local_import(twin.prepare_local_import(document))
    assert hooks == []  # hooks are bypassed
    assert twin.param_groups[0]["lr"] == 3e-3 and twin.param_groups[0]["initial_lr"] == 3e-3
    assert twin.param_groups[1]["eps"] == 1e-8  # hyperparameters come from the document
    assert twin.param_groups[0]["param_names"] == ["head.bias", "head.weight"]  # names stay target-local
    _train(model, optimizer, 3, start=3)
    _train(twin_model, twin, 3, start=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True))


def test_prepare_changes_neither_the_target_nor_the_document() -> None:
    model, optimizer = _trained()
    document = optimizer.export_local_state()
    reference = copy.deepcopy(document)
    twin_model, twin = _target(model)
    before = deep_snapshot(twin, twin_model)
    twin.prepare_local_import(document)
    assert snapshot_diff(before, twin, twin_model) == []
    assert _same(reference, document)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_a_parameter_that_never_stepped_travels_as_uninitialized() -> None:
    model, optimizer = _bound()
    optimizer.zero_grad()
    _loss(model, 0).backward()
    model.head.bias.grad = None
    optimizer.step()
    document = optimizer.export_local_state()
    assert document["parameters"]["head.bias"] == {
        **document["parameters"]["head.bias"],
        "variant": "uninitialized",
        "state": {},
    }
    twin_model, twin = _target(model)
    twin.commit_local_import(twin.prepare_local_import(document))
    assert not twin.state.get(twin_model.head.bias)
    _train(model, optimizer, 2, start=1)
    _train(twin_model, twin, 2, start=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True))


STALE: dict[str, Callable[[nn.Module, ContractedAdamW], object]] = {
    "a step": lambda m, o: _train(m, o, 1, start=9),
    "an in-place parameter write": lambda m, o: m.head.weight.detach().add_(1),
    "a storage retarget": lambda m, o: setattr(m.head.weight, "data", m.head.weight.detach().clone()),
    "a state write": lambda m, o: o.state[m.head.weight]["exp_avg"].add_(1),
    "an option change": lambda m, o: o.param_groups[0].__setitem__("lr", 0.7),
    "a native load": lambda m, o: o.load_state_dict(o.state_dict()),
}


@pytest.mark.parametrize("change", sorted(STALE))
def test_a_preparation_outdated_by_a_change_is_refused_without_mutation(change: str) -> None:
    model, optimizer = _trained()
    document = optimizer.export_local_state()
    twin_model, twin = _target(model)
    _train(twin_model, twin, 1)
    staged = twin.prepare_local_import(document)
    STALE[change](twin_model, twin)
    before = deep_snapshot(twin, twin_model)
    with pytest.raises(StaleTransactionError, match="changed after"):
        twin.commit_local_import(staged)
    assert snapshot_diff(before, twin, twin_model) == []


def test_a_preparation_is_single_use_and_bound_to_its_optimizer() -> None:
    model, optimizer = _trained()
    document = optimizer.export_local_state()
    twin_model, twin = _target(model)
    staged = twin.prepare_local_import(document)
    with pytest.raises(StaleTransactionError, match="another optimizer"):
        optimizer.commit_local_import(staged)
    twin.commit_local_import(staged)
    before = deep_snapshot(twin, twin_model)
    with pytest.raises(StaleTransactionError, match="consumed"):
        twin.commit_local_import(staged)
    assert snapshot_diff(before, twin, twin_model) == []
    with pytest.raises(StaleTransactionError, match="expected"):
        twin.commit_post_sharding(twin.prepare_local_import(document))


def _state(document: dict[str, Any], fqn: str = "Encoder.weight") -> dict[str, Any]:
    return document["parameters"][fqn]["state"]  # type: ignore[no-any-return]


def _options(document: dict[str, Any], fqn: str = "Encoder.weight") -> dict[str, Any]:
    return document["parameters"][fqn]["group_options"]  # type: ignore[no-any-return]


_ENCODER = ("Encoder.weight", "Encoder.bias")
CORRUPTIONS: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "bool_step": (lambda d: _state(d).__setitem__("step", True), "'step' must be an int"),
    "zero_step": (lambda d: _state(d).__setitem__("step", 0), "'step' must be an int >= 1"),
    "float_step": (lambda d: _state(d).__setitem__("step", 3.0), "'step' must be an int"),
    "float64_moment": (
        lambda d: _state(d).__setitem__("exp_avg", _state(d)["exp_avg"].double()),
        "dtype torch.float64",
    ),
    "negative_second_moment": (lambda d: _state(d)["exp_avg_sq"].fill_(-1.0), "negative"),
    "nan_moment": (lambda d: _state(d)["exp_avg"].fill_(float("nan")), "non-finite"),
    "unknown_key": (lambda d: _state(d).__setitem__("extra", torch.zeros(1)), "not declared"),
    "missing_key": (lambda d: _state(d).pop("exp_avg_sq"), "variant"),
    "variant": (lambda d: d["parameters"]["Encoder.weight"].__setitem__("variant", "adamw_amsgrad"), "variant"),
    "math_flag": (lambda d: [_options(d, n).__setitem__("amsgrad", True) for n in _ENCODER], "different algorithm"),
    "group_mismatch": (lambda d: _options(d, "Encoder.bias").__setitem__("lr", 0.9), "differ; regroup"),
    "common": (lambda d: d.__setitem__("common", {"x": 1}), "'common' must be empty"),
    "policy": (lambda d: d.__setitem__("policy", {"x": 1}), "policy"),
    "missing_parameter": (lambda d: d["parameters"].pop("head.bias"), "missing"),
    "implementation": (lambda d: d.__setitem__("implementation", "torch.optim.AdamW"), "implementation"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupted_document_is_refused_without_mutation(corruption: str) -> None:
    model, optimizer = _trained()
    document = optimizer.export_local_state()
    edit, match = CORRUPTIONS[corruption]
    edit(document)
    twin_model, twin = _target(model, source_groups)
    before = deep_snapshot(twin, twin_model)
    with pytest.raises(StateValidationError, match=match):
        twin.prepare_local_import(document)
    assert snapshot_diff(before, twin, twin_model) == []


def test_a_fused_sources_document_imports_into_a_foreach_target() -> None:
    model, optimizer = _trained(fused=True)
    document = optimizer.export_local_state()
    assert _state(document)["step"] == 3
    twin_model, twin = _target(model, source_groups, foreach=True)
    twin.commit_local_import(twin.prepare_local_import(document))
    for name, parameter in twin_model.named_parameters():
        state = twin.state[parameter]
        assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"
        assert torch.equal(state["exp_avg"], _state(document, name)["exp_avg"])
    assert twin.param_groups[0]["foreach"] is True and not twin.param_groups[0]["fused"]


def _golden_optimizer() -> tuple[nn.Module, ContractedAdamW]:
    model = nn.Module()
    model.Layer = nn.Module()  # a capitalised FQN: names and FQNs keep their case
    model.Layer.Weight = nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    model.Layer.bias = nn.Parameter(torch.tensor([0.125, -1.0]))
    named = list(model.named_parameters())
    optimizer = ContractedAdamW(named, lr=0.01, betas=(0.5, 0.75), weight_decay=0.0)
    plan = replicated_copy_plan(named)
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in named})
    return model, optimizer


def test_the_document_format_is_pinned_by_a_golden_vector() -> None:
    _model, optimizer = _golden_optimizer()
    weight_id = optimizer.state_dict()["param_groups"][0]["params"][0]
    native = optimizer.state_dict()
    native["state"] = {
        weight_id: {
            "step": torch.tensor(2.0),
            "exp_avg": torch.tensor([[0.5, -0.25], [1.0, 0.0]]),
            "exp_avg_sq": torch.tensor([[0.25, 0.0625], [1.0, 0.0]]),
        }
    }
    optimizer.load_state_dict(native)  # exact values: no arithmetic reaches the document
    document = optimizer.export_local_state()
    golden = check_golden("adamw_bound_state.json", document)
    twin_model, twin = _golden_optimizer()
    twin.commit_local_import(twin.prepare_local_import(golden))  # the pinned format imports
    layer: Any = twin_model.Layer
    assert torch.equal(twin.state[layer.Weight]["exp_avg_sq"], torch.tensor([[0.25, 0.0625], [1.0, 0.0]]))
    assert not twin.state.get(layer.bias)

"""ContractedAdamW's PortableAdapter methods, called directly (no driver):
the dynamic claims, the implicit and sealed layouts, exact fp32 records, validating staged
imports and loads that change nothing when refused, and single-use transactions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import (
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    NotSupportedError,
    StaleTransactionError,
    StateValidationError,
)
from gefen_contracts.enums import CheckpointTransport, ParameterLayout
from gefen_contracts.exchange import PortableExport, PortableSlotState
from gefen_contracts.testing import deep_snapshot, flattened_plan, replicated_copy_plan, snapshot_diff
from gefen_hybrid import PARAMETER_SHAPED_SUPPORT, PORTABLE_SUPPORT, ContractedAdamW
from hybrid_toys import single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to(dtype)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad()
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(5, 4, generator=generator).to(next(model.parameters()).dtype)
        model(x).pow(2).mean().backward()
        optimizer.step()


def _trained(steps: int = 2, **options: Any) -> tuple[nn.Module, ContractedAdamW]:
    model = _model()
    optimizer = ContractedAdamW(model.named_parameters(), lr=1e-2, **options)
    _train(model, optimizer, steps)
    return model, optimizer


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _import(target: ContractedAdamW, exported: PortableExport) -> None:
    staged = target.portable_prepare_import(
        implementation=exported.implementation, policy=exported.policy, common=exported.common, slots=exported.slots
    )
    target.portable_commit_import(staged)


def _with(exported: PortableExport, fqn: str, **changes: Any) -> PortableExport:
    """The export with one slot's variant, counters, fields or options replaced."""
    slots = []
    for slot in exported.slots:
        if slot.fqn == fqn:
            values = {
                "options": slot.options,
                "variant": slot.variant,
                "counters": slot.counters,
                "element_fields": slot.element_fields,
                **changes,
            }
            slot = PortableSlotState(slot.layout, values["options"], values["variant"], values["counters"],
                                     element_fields=values["element_fields"])  # fmt: skip
        slots.append(slot)
    return PortableExport(exported.implementation, exported.policy, exported.common, exported.manifest, tuple(slots))


# -- claims -------------------------------------------------------------------------------------


def test_a_fresh_named_optimizer_claims_both_transports() -> None:
    capabilities = ContractedAdamW(_model().named_parameters()).optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_PORTABLE_STATE) and capabilities.supports(FEATURE_PARAMETER_SHAPED_STATE)
    entries = {e.transport: e for e in capabilities.checkpoints}
    assert entries[CheckpointTransport.CANONICAL_GLOBAL] == PORTABLE_SUPPORT
    assert entries[CheckpointTransport.PARAMETER_SHAPED] == PARAMETER_SHAPED_SUPPORT
    assert PORTABLE_SUPPORT.allows_transition(ParameterLayout.FLATTENED_ELEMENT_SHARD, ParameterLayout.REPLICATED)
    assert PARAMETER_SHAPED_SUPPORT.allows_transition(
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD, ParameterLayout.REPLICATED
    )


def _names_edited_to(names: list[str]) -> Callable[[nn.Module], ContractedAdamW]:
    """An optimizer whose names were edited after it was built (its constructor refuses them)."""

    def build(model: nn.Module) -> ContractedAdamW:
        optimizer = ContractedAdamW(model.named_parameters())
        optimizer.param_groups[0]["param_names"] = names
        return optimizer

    return build


@pytest.mark.parametrize(
    ("build", "features", "fragment"),
    [
        (lambda m: ContractedAdamW(m.parameters()), "both", "no parameter names"),
        (lambda m: ContractedAdamW(m.double().named_parameters()), "both", "float64"),
        (lambda m: ContractedAdamW(m.named_parameters(), lr=torch.tensor(0.01)), "both", "option 'lr' holds a Tensor"),
        (_names_edited_to(["a", "a", "b", " c"]), "both", "used twice"),
    ],
    ids=["unnamed", "float64", "tensor-lr", "bad-names"],
)
def test_negative_claims_say_why_and_the_methods_refuse(
    build: Callable[[nn.Module], ContractedAdamW], features: str, fragment: str
) -> None:
    model = _model()
    optimizer = build(model)
    capabilities = optimizer.optimizer_contract().capabilities
    status = capabilities.feature(FEATURE_PORTABLE_STATE)
    assert not status.supported and any(fragment in r for r in status.reasons), status.reasons
    transports = {e.transport for e in capabilities.checkpoints}
    assert CheckpointTransport.CANONICAL_GLOBAL not in transports
    assert capabilities.supports(FEATURE_PARAMETER_SHAPED_STATE)  # torch's AdamW state is always parameter-shaped
    with pytest.raises(NotSupportedError, match=fragment):
        optimizer.portable_export()


def test_flattened_shards_are_portable_but_not_parameter_shaped() -> None:
    model = _model()
    optimizer = ContractedAdamW(model.named_parameters())
    plan = flattened_plan(list(model.named_parameters()), 0)
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    capabilities = optimizer.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_PORTABLE_STATE)
    reasons = capabilities.feature(FEATURE_PARAMETER_SHAPED_STATE).reasons
    assert any("save_portable_dcp" in r for r in reasons)
    layout = optimizer.portable_layout()
    assert layout.manifest == plan.manifest
    assert [s.shard for s in layout.slots] == [r.shard for r in plan.rebindings]


def test_a_tampered_layout_disables_both_transports() -> None:
    model = _model()
    optimizer = ContractedAdamW(model.named_parameters())
    plan = replicated_copy_plan(list(model.named_parameters()))
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    optimizer.param_groups[0]["params"].reverse()
    capabilities = optimizer.optimizer_contract().capabilities
    for feature in (FEATURE_PORTABLE_STATE, FEATURE_PARAMETER_SHAPED_STATE):
        assert not capabilities.supports(feature)


# -- portable records ---------------------------------------------------------------------------


def test_the_implicit_layout_is_ungrouped_replicated_keyed_by_torch_names() -> None:
    model = _model()
    optimizer = ContractedAdamW(
        [
            {"params": [model[0].weight, model[1].weight], "param_names": ["0.weight", "1.weight"]},
            {"params": [model[0].bias], "param_names": ["0.bias"], "lr": 0.5},
        ]
    )
    layout = optimizer.portable_layout()
    assert layout.implementation == "gefen.ContractedAdamW"
    assert [(s.fqn, s.position, s.compatibility_name) for s in layout.slots] == [
        ("0.weight", (0, 0), "0.weight"),
        ("1.weight", (0, 1), "1.weight"),
        ("0.bias", (1, 0), "0.bias"),
    ]
    assert all(s.layout is ParameterLayout.REPLICATED and s.process_group is None for s in layout.manifest.shards)
    assert layout.manifest.fqns == ("0.bias", "0.weight", "1.weight")  # 1.bias is not optimized


def test_export_is_an_exact_owned_fp32_copy_of_the_state() -> None:
    model, optimizer = _trained(amsgrad=True)
    before = deep_snapshot(optimizer, model)
    exported = optimizer.portable_export()
    assert not snapshot_diff(before, optimizer, model)
    assert exported.policy == {} and exported.common == {}
    for slot, parameter in zip(exported.slots, model.parameters()):
        state = optimizer.state[parameter]
        assert slot.variant == "adamw_amsgrad" and dict(slot.counters) == {"step": 2}
        assert sorted(slot.element_fields) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
        for name, field in slot.element_fields.items():
            assert isinstance(field, torch.Tensor)
            assert _bitwise(field, state[name]) and field.data_ptr() != state[name].data_ptr()
        assert slot.options["amsgrad"] is True and slot.options["betas"] == (0.9, 0.999)
        assert "foreach" not in slot.options and "fused" not in slot.options


def test_bfloat16_state_travels_exactly_and_inexact_values_are_refused() -> None:
    model = _model(dtype=torch.bfloat16)
    optimizer = ContractedAdamW(model.named_parameters(), lr=1e-2)
    _train(model, optimizer, 2)
    exported = optimizer.portable_export()
    twin_model = _model(dtype=torch.bfloat16)
    twin = ContractedAdamW(twin_model.named_parameters(), lr=1e-2)
    _import(twin, exported)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert all(_bitwise(optimizer.state[a][k], twin.state[b][k]) for k in ("exp_avg", "exp_avg_sq"))
    slot = exported.slots[0]
    field = slot.element_fields["exp_avg"].clone()
    field.view(-1)[0] += 1e-5  # not a bfloat16 value any more
    before = deep_snapshot(twin)
    with pytest.raises(StateValidationError, match="cannot represent exactly"):
        _import(twin, _with(exported, slot.fqn, element_fields={**slot.element_fields, "exp_avg": field}))
    assert not snapshot_diff(before, twin)


def test_import_takes_hyperparameters_from_the_records_and_continues_bit_exactly() -> None:
    model, optimizer = _trained()
    exported = optimizer.portable_export()
    twin_model = _model()
    twin_model.load_state_dict(model.state_dict())
    twin = ContractedAdamW(twin_model.named_parameters(), lr=0.5, foreach=True)
    _import(twin, exported)
    assert twin.param_groups[0]["lr"] == 1e-2 and twin.param_groups[0]["foreach"] is True
    for parameter in twin_model.parameters():
        assert twin.state[parameter]["step"].dtype == torch.float32
    _train(model, optimizer, 2, start=2)
    _train(twin_model, twin, 2, start=2)
    assert all(_bitwise(a.detach(), b.detach()) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_uninitialized_parameters_round_trip_without_state() -> None:
    model = _model()
    optimizer = ContractedAdamW(model.named_parameters())
    exported = optimizer.portable_export()
    assert {slot.variant for slot in exported.slots} == {"uninitialized"}
    _, target = _trained()
    _import(target, exported)
    assert not any(target.state.values())


def _refusals() -> list[tuple[str, Callable[[PortableExport], dict[str, Any]], str]]:
    def slot(e: PortableExport) -> PortableSlotState:
        return e.slots[0]

    def edit(**changes: Any) -> Callable[[PortableExport], dict[str, Any]]:
        def apply(e: PortableExport) -> dict[str, Any]:
            edited = _with(e, slot(e).fqn, **{k: v(slot(e)) for k, v in changes.items()})
            return {"implementation": e.implementation, "policy": e.policy, "common": e.common, "slots": edited.slots}

        return apply

    def fields(**replace: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[PortableSlotState], dict[str, Any]]:
        def apply(s: PortableSlotState) -> dict[str, Any]:
            out = dict(s.element_fields)
            for name, fn in replace.items():
                out[name] = fn(out[name])  # type: ignore[arg-type]
            return out

        return apply

    def options(**replace: Any) -> Callable[[PortableSlotState], dict[str, Any]]:
        return lambda s: {**s.options, **replace}

    def every(**replace: Any) -> Callable[[PortableExport], dict[str, Any]]:
        def apply(e: PortableExport) -> dict[str, Any]:
            for s in e.slots:
                e = _with(e, s.fqn, options={**s.options, **replace})
            return {"implementation": e.implementation, "policy": e.policy, "common": e.common, "slots": e.slots}

        return apply

    def top(**replace: Any) -> Callable[[PortableExport], dict[str, Any]]:
        return lambda e: {
            "implementation": e.implementation, "policy": e.policy, "common": e.common, "slots": e.slots, **replace
        }  # fmt: skip

    negative = fields(exp_avg_sq=lambda t: -t - 1)
    return [
        ("foreign implementation", top(implementation="gefen.Gefen"), "exported by 'gefen.Gefen'"),
        ("non-empty policy", top(policy={"x": 1}), "policy and common must be empty"),
        ("unknown variant", edit(variant=lambda s: "adam_v2"), "unknown variant 'adam_v2'"),
        ("amsgrad variant on a plain group", edit(variant=lambda s: "adamw_amsgrad"), "needs the fields"),
        ("step zero", edit(counters=lambda s: {"step": 0}), "counters must be exactly"),
        ("extra counter", edit(counters=lambda s: {"step": 2, "other": 1}), "counters must be exactly"),
        ("wrong shape", edit(element_fields=fields(exp_avg=lambda t: t.reshape(-1)[:-1])), "has shape"),
        ("non-finite", edit(element_fields=fields(exp_avg=lambda t: t.clone().fill_(float("nan")))), "non-finite"),
        ("negative second moment", edit(element_fields=negative), "negative values"),
        ("wrong dtype", edit(element_fields=fields(exp_avg=lambda t: t.double())), "float32 tensor"),
        ("math flag", every(maximize=True), "option 'maximize'"),
        ("group options disagree", edit(options=options(lr=0.5)), "recorded group options"),
        ("slots out of order", top(slots=None), "slot records"),
    ]


@pytest.mark.parametrize(("name", "corrupt", "fragment"), _refusals(), ids=[r[0] for r in _refusals()])
def test_corrupted_records_are_refused_and_change_nothing(
    name: str, corrupt: Callable[[PortableExport], dict[str, Any]], fragment: str
) -> None:
    _, source = _trained()
    exported = source.portable_export()
    model, target = _trained(3)
    arguments = corrupt(exported)
    if arguments["slots"] is None:
        arguments["slots"] = tuple(reversed(exported.slots))
    before = deep_snapshot(target, model)
    with pytest.raises(StateValidationError, match=fragment):
        target.portable_prepare_import(**arguments)
    assert not snapshot_diff(before, target, model)


def test_staged_imports_are_single_use_owned_and_fresh() -> None:
    model, optimizer = _trained()
    exported = optimizer.portable_export()

    def prepare(target: ContractedAdamW) -> Any:
        return target.portable_prepare_import(
            implementation=exported.implementation, policy=exported.policy, common=exported.common, slots=exported.slots
        )

    staged = prepare(optimizer)
    _, other = _trained()
    with pytest.raises(StaleTransactionError, match="another optimizer"):
        other.portable_commit_import(staged)
    _train(model, optimizer, 1, start=5)
    with pytest.raises(StaleTransactionError, match="changed"):
        optimizer.portable_commit_import(staged)
    fresh = prepare(optimizer)
    optimizer.portable_commit_import(fresh)
    with pytest.raises(StaleTransactionError, match="consumed"):
        optimizer.portable_commit_import(fresh)

"""State-declaration truth: every live key is declared and every state matches one variant."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...enums import ParameterLayout, ParameterStateRole, StateGeometry, StateScope
from ...errors import StateValidationError
from ...protocols import IdentityBindable, ModeTaggedState
from ...state_layout import OptimizerStateLayout, match_variants, parameter_state_shape
from ..claims import CONTRACT_CLAIM
from ..context import CheckContext

__all__ = ["StateDeclarationCheck"]


def _layout_and_role(optimizer: object, parameter: torch.Tensor) -> tuple[ParameterLayout, ParameterStateRole]:
    if isinstance(optimizer, IdentityBindable) and optimizer.sharding_manifest() is not None:
        shard = optimizer.shard_identity(parameter)
        if shard.layout is ParameterLayout.WHOLE_PARAMETER_OWNER:
            return shard.layout, ParameterStateRole.OWNER if shard.is_owner else ParameterStateRole.NON_OWNER
        return shard.layout, ParameterStateRole.ANY
    if type(parameter).__name__ == "DTensor":
        return ParameterLayout.DTENSOR_1D_DEFAULT_WORLD, ParameterStateRole.ANY
    return ParameterLayout.REPLICATED, ParameterStateRole.ANY


def check_state_matches(optimizer: torch.optim.Optimizer, where: str) -> None:
    """Assert every per-parameter state of ``optimizer`` matches exactly one declared variant,
    live (``optimizer.state``) and as ``state_dict()`` writes it (the layout declares native keys)."""
    contract = optimizer.optimizer_contract()  # type: ignore[attr-defined]
    layout = contract.state_layout
    saved = optimizer.state_dict().get("state", {}) if not layout.composite_namespaces else {}
    index = -1
    for group_index, group in enumerate(optimizer.param_groups):
        for slot, parameter in enumerate(group["params"]):
            index += 1
            here = f"group {group_index} slot {slot}"
            live = optimizer.state.get(parameter)
            if live:
                _check_one(optimizer, layout, parameter, live, f"{where}: {here}")
            native = saved.get(index)
            if native:
                _check_one(optimizer, layout, parameter, native, f"{where} in state_dict(): {here}")
                _check_declared_values(layout, parameter, native, f"{where} in state_dict(): {here}")


_SHAPED = frozenset({StateGeometry.PARAMETER, StateGeometry.ROW, StateGeometry.COLUMN})
_TENSOR_DTYPES = {"uint8", "int8", "bfloat16", "float16", "float32", "float64"}


def _check_declared_values(
    layout: OptimizerStateLayout, parameter: torch.Tensor, state: Mapping[str, object], where: str
) -> None:
    """Each native value holds its field's declared dtype and, where the geometry fixes it from
    the parameter alone (``PARAMETER``, ``ROW``, ``COLUMN``; trailing dimensions of size 1
    aside), its shape; a ``SCALAR`` one value, and a ``BLOCK`` field a tensor."""
    for key, value in state.items():
        declared = layout.field(str(key))
        assert declared.checkpointed, f"{where}: {key!r} is declared a cache (never checkpointed) but is written"
        tensor = value if isinstance(value, torch.Tensor) else None
        if declared.dtype in _TENSOR_DTYPES:
            found = str(tensor.dtype).removeprefix("torch.") if tensor is not None else type(value).__name__
            assert found == declared.dtype, f"{where}: {key!r} holds {found}, declared {declared.dtype}"
        elif declared.dtype in ("int", "bool"):
            wanted = int if declared.dtype == "int" else bool
            ok = (
                type(value) is wanted
                if tensor is None
                else (tensor.dtype is torch.bool) == (wanted is bool) and not tensor.is_floating_point()
            )
            assert ok, (
                f"{where}: {key!r} holds {type(value).__name__ if tensor is None else tensor.dtype}, declared {declared.dtype}"
            )
        if declared.geometry is StateGeometry.SCALAR:
            assert tensor is None or tensor.numel() == 1, (
                f"{where}: {key!r} has shape {tuple(tensor.shape)}, declared a scalar (one value)"
            )
            continue
        if declared.geometry in _SHAPED or declared.geometry is StateGeometry.BLOCK:
            assert tensor is not None, (
                f"{where}: {key!r} holds a {type(value).__name__}, its {declared.geometry.value} geometry asks a tensor"
            )
        if tensor is None or declared.geometry not in _SHAPED:
            continue
        expected = parameter_state_shape(declared.geometry, tuple(parameter.shape))
        shape = tuple(tensor.shape)
        while len(shape) > len(expected or ()) and shape[-1] == 1:  # [rows, 1] is a row statistic
            shape = shape[:-1]
        assert shape == expected, (
            f"{where}: {key!r} has shape {tuple(tensor.shape)}, its {declared.geometry.value} geometry gives {expected}"
        )


def _check_one(
    optimizer: torch.optim.Optimizer,
    layout: OptimizerStateLayout,
    parameter: torch.Tensor,
    state: Mapping[str, object],
    where: str,
) -> None:
    param_layout, role = _layout_and_role(optimizer, parameter)
    tags = optimizer.state_mode_tags(parameter) if isinstance(optimizer, ModeTaggedState) else frozenset()
    try:
        matches = match_variants(
            layout,
            list(state.keys()),
            parameter_layout=param_layout,
            parameter_rank=parameter.dim(),
            role=role,
            mode_tags=tags,
        )
    except StateValidationError as exc:
        raise AssertionError(f"{where}: {exc}") from None
    names = [m.name for m in matches]
    declared = {variant.name: list(variant.fields) for variant in layout.parameter_variants}
    assert len(matches) == 1, (
        f"{where}: state keys {sorted(state)} match {len(matches)} declared variants {names} (exactly one "
        f"required; declared: {declared})"
    )


def check_native_keys(optimizer: torch.optim.Optimizer, where: str) -> None:
    contract = optimizer.optimizer_contract()  # type: ignore[attr-defined]
    layout = contract.state_layout
    if layout.composite_namespaces:
        return  # a composite's top level holds its namespaces; children are checked on their own
    state_dict = optimizer.state_dict()
    for key in state_dict:
        if key in ("state", "param_groups"):
            continue
        try:
            declared = layout.field(key)
        except KeyError:
            raise AssertionError(f"{where}: native state_dict key {key!r} is not declared") from None
        assert declared.scope is not StateScope.PARAMETER, (
            f"{where}: top-level native key {key!r} is declared as per-parameter state"
        )
        assert declared.checkpointed, f"{where}: native state_dict key {key!r} is declared a cache (never checkpointed)"


class StateDeclarationCheck:
    name = "state.declared_variants"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({CONTRACT_CLAIM})

    def run(self, context: CheckContext) -> None:
        model, optimizer = context.fresh()
        check_state_matches(optimizer, "after 0 steps")
        check_native_keys(optimizer, "after 0 steps")
        context.train(model, optimizer, 1)
        check_state_matches(optimizer, "after 1 step")
        check_native_keys(optimizer, "after 1 step")
        context.train(model, optimizer, context.target.steps, start=1)
        check_state_matches(optimizer, f"after {context.target.steps + 1} steps")
        check_native_keys(optimizer, f"after {context.target.steps + 1} steps")

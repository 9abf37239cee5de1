"""``Int8MomentumSGD``: SGD with a compact momentum, a reference ``ParameterShapedState``.

``m = momentum * m + g`` (``g`` includes weight decay), ``p -= lr * m``. For parameters of
rank >= 2 the momentum is stored as int8 codes shaped like the parameter with one fp32 scale
per row (about 1 byte per element); smaller parameters keep fp32. The update uses the stored
(quantised) momentum.

Works on plain tensors and on DTensor (FSDP2) parameters: each state tensor is then a DTensor
placed like its parameter (a row's scale lives with the row), so ``gefen_dcp.GefenDCPState``
(or plain DCP) reshards it N ranks to M bit for bit. About 150 lines: what an optimizer
author writes to get verified, resharding DCP checkpoints.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateValidationError,
    StateVariant,
    TrainingSupport,
)
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
    TopologyChange,
)
from gefen_contracts.torch_support import dtensor_from_local, load_with_hooks
from gefen_contracts.transactions import StagedTransaction

__all__ = ["IMPLEMENTATION", "Int8MomentumSGD", "conformance_factory"]

IMPLEMENTATION = "gefen_dcp_testing.Int8MomentumSGD"
_OPTIONS = ("lr", "momentum", "weight_decay")
_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.DTENSOR_1D_DEFAULT_WORLD})

_STATE_LAYOUT = OptimizerStateLayout(
    fields=(
        StateField("momentum_int8", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),
        StateField("momentum_scale", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.ROW),
        StateField("momentum", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),
        StateField("step", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
    ),
    parameter_variants=(
        StateVariant(
            "int8_rows",
            ("momentum_int8", "momentum_scale", "step"),
            _LAYOUTS,
            StateExtent.LOCAL_STORAGE,
            excluded_parameter_ranks=(0, 1),
        ),
        StateVariant("fp32", ("momentum", "step"), _LAYOUTS, StateExtent.LOCAL_STORAGE, parameter_ranks=(0, 1)),
    ),
)

CONTRACT = OptimizerContract(
    implementation=IMPLEMENTATION,
    state_layout=_STATE_LAYOUT,
    capabilities=OptimizerCapabilities(
        training=(
            TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),
            TrainingSupport(ParameterLayout.DTENSOR_1D_DEFAULT_WORLD, ProcessGroupScope.INFERRED_DEVICE_MESH),
        ),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.NATIVE_OPTIMIZER,
                frozenset({ParameterLayout.REPLICATED}),
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            ),
            CheckpointSupport(
                CheckpointTransport.PARAMETER_SHAPED,
                _LAYOUTS,
                ProcessGroupScope.DEFAULT_WORLD,
                LoadAtomicity.GROUP_VOTED,
                transitions=(TopologyTransition(_LAYOUTS, _LAYOUTS, frozenset({TopologyChange.PLACEMENT_RESHARD})),),
                requires_collective=True,
            ),
        ),
        precisions=frozenset({Precision.FLOAT32, Precision.BFLOAT16}),
        supported_parameter_ranks=None,
        features={
            FEATURE_PARAMETER_SHAPED_STATE: FeatureStatus.yes(),
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
            FEATURE_POST_SHARDING: FeatureStatus.no("it keeps no shard identity"),
            FEATURE_CANONICAL_IDENTITY: FeatureStatus.no("post_sharding is not implemented"),
            FEATURE_CANONICAL_LOCAL_STATE: FeatureStatus.no("no canonical local documents"),
            FEATURE_PORTABLE_STATE: FeatureStatus.no("no portable adapter"),
            FEATURE_COLLECTIVE_SCOPE: FeatureStatus.no("it learns nothing collectively"),
            FEATURE_COMPOSITE: FeatureStatus.no("it has no children"),
        },
    ),
)


def _local(tensor: Any) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor  # type: ignore[no-any-return]


def _like(param: Any, local: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``local`` as the optimizer holds it: a DTensor placed like a DTensor ``param``."""
    if not hasattr(param, "device_mesh"):
        return local
    return dtensor_from_local(local, param.device_mesh, param.placements, shape)


def _quantize(momentum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = momentum.reshape(momentum.shape[0], -1) if momentum.shape[0] else momentum.reshape(0, 1)
    scale = rows.abs().amax(dim=1) / 127.0 if rows.shape[1] else torch.zeros(rows.shape[0], dtype=momentum.dtype)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(momentum.shape), scale.to(torch.float32)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    view_shape = (codes.shape[0],) + (1,) * (codes.dim() - 1)
    return codes.to(torch.float32) * scale.reshape(view_shape)


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"Int8MomentumSGD state dict: {message}")


def _expected(param: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    shape = tuple(int(d) for d in param.shape)
    if len(shape) >= 2:
        return {"momentum_int8": (torch.int8, shape), "momentum_scale": (torch.float32, shape[:1])}
    return {"momentum": (torch.float32, shape)}


def _check_options(values: Mapping[str, object], who: str, error: type[Exception]) -> None:
    for name, value in values.items():
        if type(value) is not float or not math.isfinite(value) or value < 0:
            raise error(f"{who}: {name} must be a finite float >= 0, got {value!r}")
    if values["momentum"] >= 1.0:  # type: ignore[operator]
        raise error(f"{who}: momentum must be < 1, got {values['momentum']}")


class Int8MomentumSGD(torch.optim.Optimizer):
    """SGD with int8-row momentum over named parameters (see the module docstring).

    Implements ``ContractProvider``, ``StagedNativeLoad`` and ``ParameterShapedState``.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        named = list(named_parameters)
        _check_options({"lr": lr, "momentum": momentum, "weight_decay": weight_decay}, "Int8MomentumSGD", ValueError)
        if not named or any(type(n) is not str or not isinstance(p, torch.Tensor) for n, p in named):
            raise ValueError("Int8MomentumSGD needs a non-empty list of (name, parameter) pairs")
        super().__init__(named, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self._version = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch pickles (and deep-copies) only defaults, state and groups: a copy counts anew
        super().__setstate__(state)
        self._version = 0

    def optimizer_contract(self) -> OptimizerContract:
        return CONTRACT

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        # a load staged before the new group numbers its parameters without it: outdate it
        self._version = getattr(self, "_version", 0) + 1  # (torch's __init__ adds the first groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                local = _local(param)
                grad = _local(param.grad).to(torch.float32)
                if group["weight_decay"]:
                    grad = grad + group["weight_decay"] * local.to(torch.float32)
                state = self.state[param]
                if not state:
                    momentum = grad
                elif "momentum_int8" in state:
                    previous = _dequantize(_local(state["momentum_int8"]), _local(state["momentum_scale"]))
                    momentum = group["momentum"] * previous + grad
                else:
                    momentum = group["momentum"] * _local(state["momentum"]) + grad
                shape = tuple(int(d) for d in param.shape)
                if local.dim() >= 2:
                    codes, scale = _quantize(momentum)
                    state["momentum_int8"] = _like(param, codes, shape)
                    state["momentum_scale"] = _like(param, scale, shape[:1])
                    momentum = _dequantize(codes, scale)
                else:
                    state["momentum"] = _like(param, momentum.clone(), shape)
                state["step"] = state.get("step", 0) + 1
                local.add_((momentum * -group["lr"]).to(local.dtype))
        self._version += 1
        return loss

    # -- StagedNativeLoad ----------------------------------------------------------------

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        """Validate a native state dict completely and stage it (nothing changes)."""
        if set(state_dict) != {"state", "param_groups"}:
            raise _fail(f"keys must be state and param_groups, got {sorted(state_dict)}")
        groups, saved = state_dict["param_groups"], state_dict["state"]
        if type(groups) is not list or len(groups) != len(self.param_groups):
            raise _fail(f"expected {len(self.param_groups)} param groups")
        params = [p for group in self.param_groups for p in group["params"]]
        options: list[dict[str, object]] = []
        index = 0
        for live, group in zip(self.param_groups, groups):
            if type(group) is not dict:
                raise _fail("every param group must be a dict")
            _check_options({k: group.get(k) for k in _OPTIONS}, "Int8MomentumSGD checkpoint", StateValidationError)
            if group.get("params") != list(range(index, index + len(live["params"]))):
                raise _fail("the groups' parameter numbering differs from this optimizer's")
            index += len(live["params"])
            # every saved key but the numbering (a scheduler's initial_lr too) is the group's
            options.append({k: v for k, v in group.items() if k != "params"})
        if type(saved) is not dict or not set(saved) <= set(range(len(params))):
            raise _fail(f"state must be keyed by parameter numbers 0..{len(params) - 1}")
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for number, entry in saved.items():
            param = params[number]
            expected = _expected(param)
            if type(entry) is not dict or set(entry) != {*expected, "step"}:
                raise _fail(f"parameter {number}: keys must be {sorted({*expected, 'step'})}")
            if type(entry["step"]) is not int or entry["step"] < 1:
                raise _fail(f"parameter {number}: step must be an int >= 1")
            staged: dict[str, Any] = {"step": entry["step"]}
            for key, (dtype, shape) in expected.items():
                value = entry[key]
                if not isinstance(value, torch.Tensor) or value.dtype is not dtype or tuple(value.shape) != shape:
                    raise _fail(f"parameter {number}: {key} must be a {dtype} tensor of shape {shape}")
                if hasattr(param, "device_mesh") != hasattr(value, "device_mesh"):
                    raise _fail(f"parameter {number}: {key} must be a DTensor exactly when the parameter is one")
                local = _local(value).detach().to(_local(param).device, copy=True)
                if not bool(torch.isfinite(local.to(torch.float32)).all()):
                    raise _fail(f"parameter {number}: {key} is not finite")
                staged[key] = _like(param, local, shape)
            new_state[param] = staged
        return StagedTransaction(self, kind="native_load", token=self._version, payload=(options, new_state))

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        payload = staged.claim(self, kind="native_load", current_token=self._version)
        options: list[dict[str, object]]
        state: dict[torch.Tensor, dict[str, Any]]
        options, state = payload  # type: ignore[misc]
        for live, values in zip(self.param_groups, options, strict=True):
            live.update(values)
        # torch's state is a defaultdict(dict): a parameter without saved state gets an entry at its step
        self.state = defaultdict(dict, state)
        self._version += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_with_hooks(self, state_dict, lambda loaded: self.commit_staged_state_dict(self.stage_state_dict(loaded)))


def conformance_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Int8MomentumSGD:
    """The conformance kit's factory for the reference adopter."""
    return Int8MomentumSGD(named_parameters, lr=0.05, momentum=0.9, weight_decay=0.01)

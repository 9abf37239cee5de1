"""``Int8MomentumSGD``: SGD with a compact momentum, a reference ``DenseShardCodec``.

``m = momentum * m + g`` (``g`` includes weight decay), ``p -= lr * m``. For parameters of
rank >= 2 the local momentum is stored as int8 rows with one fp32 scale per local row
(about 1 byte per element); smaller parameters keep fp32. The update uses the stored
(quantised) momentum, so the dense field is the whole truth: saving it densely and
re-quantising it after a row-preserving reshard reproduces the state exactly.

Works on plain tensors and on DTensor (FSDP2) parameters, whose local shards it updates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_DENSE_SHARD_CODEC,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    CheckpointSupport,
    CheckpointTransport,
    DenseShardLoad,
    DenseShardSlot,
    FeatureStatus,
    LoadAtomicity,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StagedTransaction,
    StateExtent,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
    StateValidationError,
    StateVariant,
    TopologyChange,
    TopologyTransition,
    TrainingSupport,
)

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
                CheckpointTransport.DENSE_SHARD,
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
            FEATURE_DENSE_SHARD_CODEC: FeatureStatus.yes(),
            FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.no("a reference adopter for dense-shard checkpoints only"),
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


def _quantize(momentum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = momentum.reshape(momentum.shape[0], -1) if momentum.shape[0] else momentum.reshape(0, 1)
    scale = rows.abs().amax(dim=1) / 127.0 if rows.shape[1] else torch.zeros(rows.shape[0], dtype=momentum.dtype)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(momentum.shape), scale.to(torch.float32)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    view_shape = (codes.shape[0],) + (1,) * (codes.dim() - 1)
    return codes.to(torch.float32) * scale.reshape(view_shape)


class _CompactSnapshot:
    """A frozen copy of the compact momentum state (``dense_shard_snapshot``)."""

    def __init__(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        self._entries = entries

    def materialize_dense_field(self, fqn: str, field: str) -> torch.Tensor:
        return _dense(self._entries[fqn], field)

    def materialize_dense_field_rows(self, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
        return _dense_rows(self._entries[fqn], field, start, stop)


def _dense(entry: Mapping[str, Any], field: str) -> torch.Tensor:
    if field != "momentum":
        raise KeyError(field)
    if "momentum_int8" in entry:
        return _dequantize(entry["momentum_int8"], entry["momentum_scale"])
    return entry["momentum"].to(torch.float32, copy=True)  # type: ignore[no-any-return]


def _dense_rows(entry: Mapping[str, Any], field: str, start: int, stop: int) -> torch.Tensor:
    if field != "momentum":
        raise KeyError(field)
    if "momentum_int8" in entry:
        return _dequantize(entry["momentum_int8"][start:stop], entry["momentum_scale"][start:stop])
    return entry["momentum"][start:stop].to(torch.float32, copy=True)  # type: ignore[no-any-return]


class Int8MomentumSGD(torch.optim.Optimizer):
    """SGD with int8-row momentum over named parameters (see the module docstring).

    Implements ``ContractProvider`` and ``DenseShardCodec`` plus gefen-dcp's optional
    ``materialize_dense_field_rows`` and ``dense_shard_snapshot``.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        named = list(named_parameters)
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if type(value) is not float or not math.isfinite(value) or value < 0:
                raise ValueError(f"Int8MomentumSGD: {name} must be a finite float >= 0, got {value!r}")
        if momentum >= 1.0:
            raise ValueError(f"Int8MomentumSGD: momentum must be < 1, got {momentum}")
        if not named or any(type(n) is not str or not isinstance(p, torch.Tensor) for n, p in named):
            raise ValueError("Int8MomentumSGD needs a non-empty list of (name, parameter) pairs")
        super().__init__(named, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self._version = 0

    def optimizer_contract(self) -> OptimizerContract:
        return CONTRACT

    def _named(self) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        return [
            (name, param, group)
            for group in self.param_groups
            for name, param in zip(group["param_names"], group["params"], strict=True)
        ]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, param, group in self._named():
            if param.grad is None:
                continue
            local = _local(param)
            grad = _local(param.grad).to(torch.float32)
            if group["weight_decay"]:
                grad = grad + group["weight_decay"] * local.to(torch.float32)
            state = self.state[param]
            momentum = grad if not state else group["momentum"] * _dense(state, "momentum") + grad
            if local.dim() >= 2:
                codes, scale = _quantize(momentum)
                state.update(momentum_int8=codes, momentum_scale=scale)
                momentum = _dequantize(codes, scale)
            else:
                state["momentum"] = momentum.clone()
            state["step"] = state.get("step", 0) + 1
            local.add_((momentum * -group["lr"]).to(local.dtype))
        self._version += 1
        return loss

    # -- DenseShardCodec --------------------------------------------------------------

    def dense_shard_common(self) -> Mapping[str, Any]:
        return {}

    def dense_shard_slots(self) -> tuple[DenseShardSlot, ...]:
        slots = []
        for name, param, group in self._named():
            state = self.state.get(param) or {}
            options = {key: group[key] for key in _OPTIONS}
            if not state:
                slots.append(DenseShardSlot(name, param, options, "pristine"))
                continue
            variant = "int8_rows" if "momentum_int8" in state else "fp32"
            slots.append(DenseShardSlot(name, param, options, variant, {"step": state["step"]}, ("momentum",)))
        return tuple(slots)

    def _entry(self, fqn: str) -> dict[str, Any]:
        for name, param, _ in self._named():
            if name == fqn:
                return self.state[param]  # type: ignore[no-any-return]
        raise KeyError(fqn)

    def materialize_dense_field(self, fqn: str, field: str) -> torch.Tensor:
        return _dense(self._entry(fqn), field)

    def materialize_dense_field_rows(self, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
        return _dense_rows(self._entry(fqn), field, start, stop)

    def dense_shard_snapshot(self) -> _CompactSnapshot:
        return _CompactSnapshot(
            {
                name: {
                    key: value.detach().to("cpu", copy=True)
                    for key, value in self.state[param].items()
                    if isinstance(value, torch.Tensor)
                }
                for name, param, _ in self._named()
                if self.state.get(param)
            }
        )

    def prepare_dense_shard_load(
        self, common: Mapping[str, Any], slots: Mapping[str, DenseShardLoad]
    ) -> StagedTransaction:
        """Re-quantise loaded dense momenta for the local shards; validate; stage (no mutation)."""
        if dict(common) != {}:
            raise StateValidationError(f"Int8MomentumSGD has no common state, got keys {sorted(common)}")
        named = self._named()
        names = {name for name, _, _ in named}
        if set(slots) != names:
            raise StateValidationError(
                f"dense-shard load parameters differ (missing {sorted(names - set(slots))[:5]}, "
                f"unexpected {sorted(set(slots) - names)[:5]})"
            )
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        group_options: dict[int, dict[str, object]] = {}
        for name, param, group in named:
            load = slots[name]
            options = dict(load.options)
            if set(options) != set(_OPTIONS) or any(type(options[k]) is not float for k in _OPTIONS):
                raise StateValidationError(f"{name}: options must be floats {list(_OPTIONS)}, got {options}")
            previous = group_options.setdefault(id(group), options)
            if previous != options:
                raise StateValidationError(f"{name}: options differ from other parameters of its group")
            local = _local(param)
            if load.variant == "pristine":
                if len(load.counters) or len(load.fields):
                    raise StateValidationError(f"{name}: a pristine parameter has no counters or fields")
                continue
            expected = "int8_rows" if local.dim() >= 2 else "fp32"
            if load.variant != expected:
                raise StateValidationError(
                    f"{name}: variant {load.variant!r} does not fit a rank-{local.dim()} parameter"
                )
            counters = {key: load.counters[key] for key in load.counters}
            step = counters.get("step")
            if set(counters) != {"step"} or type(step) is not int or step < 1:
                raise StateValidationError(f"{name}: counters must be {{'step': int >= 1}}, got {counters}")
            if set(load.fields) != {"momentum"}:
                raise StateValidationError(f"{name}: expected the field 'momentum', got {sorted(load.fields)}")
            dense = load.fields["momentum"]
            if (
                type(dense) is not torch.Tensor
                or dense.dtype is not torch.float32
                or tuple(dense.shape) != tuple(local.shape)
            ):
                raise StateValidationError(f"{name}: momentum must be float32 of local shape {tuple(local.shape)}")
            if not bool(torch.isfinite(dense).all()):
                raise StateValidationError(f"{name}: momentum is not finite")
            dense = dense.to(local.device)
            if local.dim() >= 2:
                codes, scale = _quantize(dense)
                new_state[param] = {"momentum_int8": codes, "momentum_scale": scale, "step": step}
            else:
                new_state[param] = {"momentum": dense.clone(), "step": step}
        groups: list[dict[str, object]] = [
            group_options.get(id(group), {k: group[k] for k in _OPTIONS}) for group in self.param_groups
        ]
        return StagedTransaction(self, kind="dense_shard_load", token=self._version, payload=(groups, new_state))

    def commit_dense_shard_load(self, staged: StagedTransaction) -> None:
        payload = staged.claim(self, kind="dense_shard_load", current_token=self._version)
        groups: list[dict[str, object]]
        state: dict[torch.Tensor, dict[str, Any]]
        groups, state = payload  # type: ignore[misc]
        for live, options in zip(self.param_groups, groups, strict=True):
            live.update(options)
        fresh: Any = type(self.state)()
        fresh.update(state)
        self.state = fresh
        self._version += 1


def conformance_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> Int8MomentumSGD:
    """The conformance kit's factory for the reference adopter."""
    return Int8MomentumSGD(named_parameters, lr=0.05, momentum=0.9, weight_decay=0.01)

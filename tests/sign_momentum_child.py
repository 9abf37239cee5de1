"""``SignMomentumChild``: a small test-local child for composites with ContractedAdamW.

``buf = momentum * buf + grad``, ``p -= lr * sign(buf)``, elementwise, so it trains plain and
DTensor (FSDP2) parameters alike (on the local shard). It keeps the convention just far
enough to sit in a composite that moves portable and parameter-shaped state: a dynamic
contract, ``PortableAdapter`` over an implicit ungrouped replicated layout keyed by parameter
names, and a staged native load of parameter-shaped state (``momentum_buffer`` a DTensor
placed like a DTensor parameter, counter ``step``). Importable by spawned gloo ranks
(module-level names only).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
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
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotLayout, PortableSlotState
from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.transactions import StagedTransaction

IMPLEMENTATION = "gefen_tests.SignMomentumChild"
_R, _F, _D = (
    ParameterLayout.REPLICATED,
    ParameterLayout.FLATTENED_ELEMENT_SHARD,
    ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
)
_PORTABLE = frozenset({_R, _F})
_SHAPED = frozenset({_R, _D})
_RESHARD = frozenset({TopologyChange.PLACEMENT_RESHARD})


def _contract(dtensors: bool) -> OptimizerContract:
    no = FeatureStatus.no
    portable = no("DTensor parameters have no implicit replicated layout") if dtensors else FeatureStatus.yes()
    checkpoints = [
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER,
            frozenset({_R}),
            ProcessGroupScope.NONE,
            LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
        ),
        CheckpointSupport(
            CheckpointTransport.PARAMETER_SHAPED,
            _SHAPED,
            ProcessGroupScope.DEFAULT_WORLD,
            LoadAtomicity.GROUP_VOTED,
            transitions=(TopologyTransition(_SHAPED, _SHAPED, _RESHARD),),
            requires_collective=True,
        ),
    ]
    if not dtensors:
        checkpoints.append(
            CheckpointSupport(
                CheckpointTransport.CANONICAL_GLOBAL,
                _PORTABLE,
                ProcessGroupScope.ADAPTER_DEFINED,
                LoadAtomicity.GROUP_VOTED,
                transitions=(TopologyTransition(_PORTABLE, _PORTABLE, _RESHARD),),
                requires_collective=True,
            )
        )
    return OptimizerContract(
        implementation=IMPLEMENTATION,
        state_layout=OptimizerStateLayout(
            fields=(
                StateField("momentum_buffer", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),
                StateField("step", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.SCALAR),
            ),
            parameter_variants=(
                StateVariant("sign", ("momentum_buffer", "step"), frozenset({_R, _D}), StateExtent.LOCAL_STORAGE),
            ),
        ),
        capabilities=OptimizerCapabilities(
            training=(
                TrainingSupport(_R, ProcessGroupScope.NONE),
                TrainingSupport(_D, ProcessGroupScope.NONE),
            ),
            checkpoints=tuple(checkpoints),
            precisions=frozenset({Precision.FLOAT32}),
            supported_parameter_ranks=None,
            features={
                FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(),
                FEATURE_POST_SHARDING: no("test child: no identity binding"),
                FEATURE_CANONICAL_IDENTITY: no("test child: no post_sharding"),
                FEATURE_CANONICAL_LOCAL_STATE: no("test child: no canonical local state"),
                FEATURE_PORTABLE_STATE: portable,
                FEATURE_PARAMETER_SHAPED_STATE: FeatureStatus.yes(),
                FEATURE_COLLECTIVE_SCOPE: no("test child: learns nothing collectively"),
                FEATURE_COMPOSITE: no("test child: no children"),
            },
        ),
    )


_CONTRACTS = {flag: _contract(flag) for flag in (False, True)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor  # type: ignore[no-any-return]


class SignMomentumChild(torch.optim.Optimizer):
    """See the module docstring. Built from ``(name, parameter)`` pairs."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], lr: float = 1e-2, momentum: float = 0.9) -> None:
        self._version = 0
        super().__init__(list(named), {"lr": lr, "momentum": momentum})

    def _named(self) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
        return [(n, p, g) for g in self.param_groups for n, p in zip(g["param_names"], g["params"], strict=True)]

    def optimizer_contract(self) -> OptimizerContract:
        return _CONTRACTS[any(hasattr(p, "to_local") for _, p, _ in self._named())]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, parameter, group in self._named():
            if parameter.grad is None:
                continue
            state = self.state[parameter]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(parameter)  # a DTensor like a DTensor parameter
                state["step"] = 0
            buffer = state["momentum_buffer"]
            buffer.mul_(group["momentum"]).add_(parameter.grad)
            state["step"] += 1
            parameter.add_(buffer.sign(), alpha=-group["lr"])
        self._version += 1
        return loss

    def _options(self, group: Mapping[str, Any]) -> dict[str, float]:
        return {"lr": group["lr"], "momentum": group["momentum"]}

    def _records(self) -> list[tuple[str, torch.Tensor, dict[str, float], str, dict[str, int], dict[str, Any]]]:
        out = []
        for name, parameter, group in self._named():
            state = self.state.get(parameter) or {}
            if not state:
                out.append((name, parameter, self._options(group), "pristine", {}, {}))
            else:
                out.append((name, parameter, self._options(group), "sign", {"step": state["step"]}, state))
        return out

    def _stage(
        self, incoming: Sequence[tuple[str, Mapping[str, Any], str, Mapping[str, int], Mapping[str, Any]]]
    ) -> Any:
        named = {name: (parameter, group) for name, parameter, group in self._named()}
        if sorted(named) != sorted(item[0] for item in incoming):
            raise StateValidationError("SignMomentumChild: the records' parameters differ from the live ones")
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for name, options, variant, counters, fields in incoming:
            parameter, group = named[name]
            if dict(options) != self._options(group):
                raise StateValidationError(f"SignMomentumChild: {name!r} options differ")
            if variant == "pristine":
                continue
            buffer = fields.get("momentum_buffer")
            if variant != "sign" or set(counters) != {"step"} or not isinstance(buffer, torch.Tensor):
                raise StateValidationError(f"SignMomentumChild: {name!r} has an invalid record")
            if buffer.dtype is not torch.float32 or tuple(buffer.shape) != tuple(parameter.shape):
                raise StateValidationError(f"SignMomentumChild: {name!r} momentum_buffer has the wrong shape or dtype")
            if hasattr(parameter, "device_mesh") != hasattr(buffer, "device_mesh"):
                raise StateValidationError(f"SignMomentumChild: {name!r} momentum_buffer must be placed like it")
            state[parameter] = {"momentum_buffer": buffer.clone(), "step": int(counters["step"])}
        return StagedTransaction(self, kind="sign_child_load", token=self._version, payload=state)

    def _publish(self, staged: StagedTransaction) -> None:
        payload = staged.claim(self, kind="sign_child_load", current_token=self._version)
        fresh: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        fresh.update(payload)  # type: ignore[call-overload]
        self.state = fresh
        self._version += 1

    # -- PortableAdapter ---------------------------------------------------------------------------

    def portable_layout(self) -> PortableLayout:
        shards, slots = [], []
        for g, group in enumerate(self.param_groups):
            for k, (name, parameter) in enumerate(zip(group["param_names"], group["params"])):
                identity = ParameterIdentity(name, tuple(parameter.shape))
                shard = ShardIdentity(identity, _R, LogicalSlice.full(identity))
                shards.append(shard)
                slots.append(PortableSlotLayout(shard, (g, k), name))
        return PortableLayout(IMPLEMENTATION, ShardingManifest(tuple(shards)), tuple(slots))

    def portable_export(self) -> PortableExport:
        layout = self.portable_layout()
        slots = []
        for slot, (_, _, options, variant, counters, state) in zip(layout.slots, self._records()):
            fields = {"momentum_buffer": _local(state["momentum_buffer"]).clone()} if state else {}
            slots.append(PortableSlotState(slot, options, variant, counters, element_fields=fields))
        return PortableExport(IMPLEMENTATION, {}, {}, layout.manifest, tuple(slots))

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        if implementation != IMPLEMENTATION or dict(policy) or dict(common):
            raise StateValidationError("SignMomentumChild: foreign implementation, policy or common state")
        return self._stage(
            [(s.fqn, s.options, s.variant, s.counters, s.element_fields) for s in slots]  # type: ignore[misc]
        )

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        self._publish(staged)

    # -- StagedNativeLoad (torch's numbering; parameter-shaped state) --------------------------

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        records = []
        numbered = dict(state_dict.get("state", {}))
        for number, (name, _, group) in enumerate(self._named()):
            entry = numbered.pop(number, None)
            if entry is None:
                records.append((name, self._options(group), "pristine", {}, {}))
                continue
            if (
                not isinstance(entry, dict)
                or set(entry) != {"momentum_buffer", "step"}
                or type(entry["step"]) is not int
            ):
                raise StateValidationError(f"SignMomentumChild: parameter {number} has an invalid state entry")
            fields = {"momentum_buffer": entry["momentum_buffer"]}
            records.append((name, self._options(group), "sign", {"step": entry["step"]}, fields))
        if numbered:
            raise StateValidationError(f"SignMomentumChild: state for unknown parameters {sorted(numbered)[:5]}")
        return self._stage(records)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        self._publish(staged)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.commit_staged_state_dict(self.stage_state_dict(state_dict))


def sign_child_factory(named: list[tuple[str, torch.Tensor]]) -> SignMomentumChild:
    return SignMomentumChild(named, lr=5e-3, momentum=0.8)

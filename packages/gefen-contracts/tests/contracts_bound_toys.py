"""``BoundSGD``: a small adopter of the identity Protocols built on the generic machinery
(the ``IdentityBinding`` role, the ``gefen.bound_state`` envelope and ``state_version_token``),
and broken variants that each lie about one promise.

Importable by the kit (module-level factories only).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_POST_SHARDING,
    CheckpointSupport,
    ContractError,
    FeatureStatus,
    NotSupportedError,
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
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
)
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import (
    BoundParameter,
    IdentityBinding,
    SealedLayout,
    build_bound_state,
    parse_bound_state,
    state_version_token,
)
from gefen_contracts.transactions import StagedTransaction

REPL, FLAT = ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD
IMPLEMENTATION = "gefen_tests.BoundSGD"
LAYOUT = OptimizerStateLayout(
    fields=(StateField("momentum_buffer", StateScope.PARAMETER, StateRole.AUTHORITATIVE, StateGeometry.PARAMETER),),
    parameter_variants=(
        StateVariant("momentum", ("momentum_buffer",), frozenset({REPL, FLAT}), StateExtent.LOCAL_STORAGE),
    ),
)


def _contract(post: FeatureStatus, identity: FeatureStatus, layouts: frozenset[ParameterLayout]) -> OptimizerContract:
    checkpoints = [
        CheckpointSupport(CheckpointTransport.NATIVE_OPTIMIZER, {REPL}, ProcessGroupScope.NONE, LoadAtomicity.NONE)
    ]
    if identity.supported:
        checkpoints.append(
            CheckpointSupport(
                CheckpointTransport.CANONICAL_LOCAL,
                layouts,
                ProcessGroupScope.NONE,
                LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
            )
        )
    return OptimizerContract(
        IMPLEMENTATION,
        LAYOUT,
        OptimizerCapabilities(
            training=(TrainingSupport(REPL, ProcessGroupScope.NONE), TrainingSupport(FLAT, ProcessGroupScope.NONE)),
            checkpoints=tuple(checkpoints),
            precisions=frozenset({Precision.FLOAT32}),
            supported_parameter_ranks=None,
            features={
                FEATURE_POST_SHARDING: post,
                FEATURE_CANONICAL_IDENTITY: identity,
                FEATURE_CANONICAL_LOCAL_STATE: identity,
            },
        ),
    )


def _accept_layout(shard: ShardIdentity, target: torch.Tensor | None) -> None:
    if shard.layout not in (REPL, FLAT):
        raise ContractError(f"BoundSGD binds replicated and flattened shards, not {shard.layout.value}")


class BoundSGD(torch.optim.Optimizer):
    """``buf = m * buf + g; p -= lr * buf`` with identity binding and canonical local state."""

    def __init__(self, params: Iterable[Any], lr: float = 0.05, momentum: float = 0.9) -> None:
        self._version = 0
        self._binding = IdentityBinding("BoundSGD", _accept_layout)
        super().__init__(params, {"lr": lr, "momentum": momentum})

    def __getstate__(self) -> dict[str, Any]:  # torch keeps only defaults, state and groups
        return {**super().__getstate__(), "_identity_record": self._binding.record()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        record = state.pop("_identity_record", None)
        super().__setstate__(state)
        self._version = 0
        self._binding = IdentityBinding("BoundSGD", _accept_layout)
        self._binding.restore(self, record)

    @property
    def _sealed(self) -> SealedLayout | None:
        return self._binding.sealed

    # contract

    def optimizer_contract(self) -> OptimizerContract:
        if self._sealed is None:
            post = FeatureStatus.no("state exists") if any(self.state.values()) else FeatureStatus.yes()
            return _contract(post, FeatureStatus.no("call post_sharding first"), frozenset())
        return _contract(
            FeatureStatus.yes(), FeatureStatus.yes(), frozenset(s.layout for _, s in self._sealed.bindings)
        )

    def _verify(self, where: str) -> None:
        self._binding.verify(self, where)

    def _token(self) -> Hashable:
        return (self._version, id(self.state), state_version_token(self.param_groups, self.state))

    def _lr(self, group: Mapping[str, Any]) -> float:
        return float(group["lr"])

    # torch optimizer

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self._verify("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._verify_after_closure()
        try:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = p.grad.detach().clone()
                    else:
                        state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                    p.add_(state["momentum_buffer"], alpha=-self._lr(group))
        finally:
            self._version += 1
        return loss

    def _verify_after_closure(self) -> None:
        self._verify("step")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        binding = getattr(self, "_binding", None)  # torch's __init__ adds the first groups
        if binding is not None:
            binding.refuse_new_group()
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        self._verify("state_dict")
        return super().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._verify("load_state_dict")
        self._check_saved(state_dict)  # torch's load would take a wrong shape, dtype or a NaN
        super().load_state_dict(dict(state_dict))
        self._version += 1

    def _check_saved(self, state_dict: Mapping[str, Any]) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ValueError("BoundSGD state dict: its param groups differ from this optimizer's")
        ids = [i for group in groups for i in group["params"]]
        by_id = dict(zip(ids, params))
        if len(ids) != len(params) or len(by_id) != len(params):
            raise ValueError("BoundSGD state dict: its parameter numbering differs from this optimizer's")
        for group in groups:
            for key in ("lr", "momentum"):
                if type(group.get(key)) is not float or not math.isfinite(group[key]):
                    raise ValueError(f"BoundSGD state dict: group option {key} must be a finite float")
        for number, entry in state_dict["state"].items():
            param = by_id.get(number)
            buffer = entry.get("momentum_buffer") if isinstance(entry, dict) else None
            if param is None or set(entry) != {"momentum_buffer"} or not isinstance(buffer, torch.Tensor):
                raise ValueError(f"BoundSGD state dict: entry {number!r} must hold exactly its momentum_buffer")
            if buffer.dtype != param.dtype or buffer.shape != param.shape or not bool(torch.isfinite(buffer).all()):
                raise ValueError(f"BoundSGD state dict: entry {number!r} must be finite and shaped like its parameter")

    # IdentityBindable

    def _blockers(self) -> tuple[str, ...]:
        return ("state exists",) if any(self.state.values()) else ()

    def prepare_post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> StagedTransaction:
        return self._binding.prepare(
            self, rebindings, manifest=manifest, scope=scope, blockers=self._blockers(), token=self._token()
        )

    def commit_post_sharding(self, staged: StagedTransaction) -> None:
        self._binding.commit(self, staged, token=self._token())
        self._version += 1

    def post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> None:
        self.commit_post_sharding(self.prepare_post_sharding(rebindings, manifest=manifest, scope=scope))

    def sharding_manifest(self) -> ShardingManifest | None:
        return self._binding.manifest(self)

    def shard_bindings(self) -> tuple[tuple[Any | None, ShardIdentity], ...]:
        return self._binding.bindings(self)

    def shard_identity(self, parameter: Any) -> ShardIdentity:
        return self._binding.shard_identity(self, parameter)

    # CanonicalLocalState

    def _ready(self) -> SealedLayout:
        self._verify("canonical")
        if self._sealed is None:
            raise NotSupportedError(FEATURE_CANONICAL_LOCAL_STATE, ("call post_sharding first",))
        return self._sealed

    def _exported_state(self, buffer: torch.Tensor) -> dict[str, Any]:
        return {"momentum_buffer": buffer}

    def export_local_state(self) -> dict[str, Any]:
        sealed = self._ready()
        parameters = {}
        for group in self.param_groups:
            for p in group["params"]:
                shard = sealed.shard_identity(p)
                state = self.state.get(p) or {}
                exported = self._exported_state(state["momentum_buffer"]) if state else {}
                options = {"lr": group["lr"], "momentum": group["momentum"]}
                parameters[shard.fqn] = BoundParameter("", shard, options, "momentum" if state else "none", exported)
        return build_bound_state(
            implementation=IMPLEMENTATION, policy={}, common={}, manifest=sealed.manifest, parameters=parameters
        )

    def _check_state(self, state: Mapping[str, Any], p: torch.Tensor, where: str) -> None:
        if set(state) - {"momentum_buffer"}:
            raise StateValidationError(f"{where}: unknown state keys")
        buffer = state.get("momentum_buffer")
        if buffer is not None and (buffer.shape != p.shape or buffer.dtype != p.dtype):
            raise StateValidationError(f"{where}: momentum_buffer shape or dtype differs")

    def prepare_local_import(self, document: Mapping[str, Any]) -> StagedTransaction:
        sealed = self._ready()
        parsed = parse_bound_state(document, implementation=IMPLEMENTATION, policy={}, manifest=sealed.manifest)
        local = {s.fqn: s for _, s in sealed.bindings}
        if set(parsed.parameters) != set(local):
            raise StateValidationError("the document's parameters differ from the local ones")
        staged: dict[torch.Tensor, dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                shard = sealed.shard_identity(p)
                entry = parsed.parameters[shard.fqn]
                where = f"parameter {shard.fqn!r}"
                if entry.shard != shard:
                    raise StateValidationError(f"{where}: another shard")
                if entry.variant != ("momentum" if entry.state else "none"):
                    raise StateValidationError(f"{where}: variant {entry.variant!r} does not match its state")
                if dict(entry.group_options) != {"lr": group["lr"], "momentum": group["momentum"]}:
                    raise StateValidationError(f"{where}: group options differ")
                self._check_state(entry.state, p, where)
                if entry.state:
                    staged[p] = {"momentum_buffer": entry.state["momentum_buffer"].to(p.device, copy=True)}
        return StagedTransaction(self, kind="import", token=self._token(), payload=staged)

    def _import_token(self) -> Hashable:
        return self._token()

    def commit_local_import(self, staged: StagedTransaction) -> None:
        self._verify("commit_local_import")
        payload = staged.claim(self, kind="import", current_token=self._import_token())
        fresh: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        fresh.update(payload)  # type: ignore[call-overload]
        self.state = fresh
        self._version += 1


class UnguardedStep(BoundSGD):
    """Never verifies the sealed layout in ``step``."""

    def _verify(self, where: str) -> None:
        if where != "step":
            super()._verify(where)


class GuardBeforeClosureOnly(BoundSGD):
    """Verifies before the closure but not after it."""

    def _verify_after_closure(self) -> None:
        return None


class MutatingPrepare(BoundSGD):
    """``prepare_post_sharding`` writes into the live groups."""

    def prepare_post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> StagedTransaction:
        self.param_groups[0]["prepared"] = True
        return super().prepare_post_sharding(rebindings, manifest=manifest, scope=scope)


class BindsAfterSteps(BoundSGD):
    """Accepts ``post_sharding`` on an optimizer that already has state."""

    def _blockers(self) -> tuple[str, ...]:
        return ()

    def optimizer_contract(self) -> OptimizerContract:
        contract = super().optimizer_contract()
        if self._sealed is None:
            return _contract(FeatureStatus.yes(), FeatureStatus.no("call post_sharding first"), frozenset())
        return contract


class StaleImport(BoundSGD):
    """Commits an import whatever happened since it was prepared."""

    def _import_token(self) -> Hashable:
        return _Anything()


class _Anything:
    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


class LossyExport(BoundSGD):
    """Exports a zero momentum buffer."""

    def _exported_state(self, buffer: torch.Tensor) -> dict[str, Any]:
        return {"momentum_buffer": torch.zeros_like(buffer)}


class LaxImport(BoundSGD):
    """Ignores unknown per-parameter state keys and wrong shapes on import."""

    def _check_state(self, state: Mapping[str, Any], p: torch.Tensor, where: str) -> None:
        return None


class FlatLie(BoundSGD):
    """Takes twice the learning rate on flattened shards."""

    def _lr(self, group: Mapping[str, Any]) -> float:
        flat = self._sealed is not None and any(s.layout is FLAT for _, s in self._sealed.bindings)
        return float(group["lr"]) * (2.0 if flat else 1.0)


class ContractFailsWhenBound(BoundSGD):
    """Its contract raises once post_sharding sealed the layout (a bug on the bound path only)."""

    def optimizer_contract(self) -> Any:
        if self._sealed is not None:
            raise AttributeError("'NoneType' object has no attribute 'layout'")
        return super().optimizer_contract()


def _factory(cls: type[BoundSGD]) -> Any:
    def factory(named: list[tuple[str, torch.nn.Parameter]]) -> BoundSGD:
        return cls([p for _, p in named])

    return factory


bound_sgd = _factory(BoundSGD)
unguarded_step = _factory(UnguardedStep)
guard_before_closure_only = _factory(GuardBeforeClosureOnly)
mutating_prepare = _factory(MutatingPrepare)
binds_after_steps = _factory(BindsAfterSteps)
stale_import = _factory(StaleImport)
lossy_export = _factory(LossyExport)
lax_import = _factory(LaxImport)
flat_lie = _factory(FlatLie)
contract_fails_when_bound = _factory(ContractFailsWhenBound)

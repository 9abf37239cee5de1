"""Deliberately broken adopters: each lies about one claim, and the kit must name it."""

from __future__ import annotations

from typing import Any

import torch
from gefen_contracts import FEATURE_STAGED_NATIVE_LOAD, FeatureStatus, OptimizerCapabilities, OptimizerContract
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.transactions import StagedTransaction
from gefen_example_sgd import CONTRACT, ContractedSGD
from gefen_hybrid import ContractedAdamW


class FalseRoundTripClaim(ContractedSGD):
    """Claims bit-exact native checkpoints but forgets the momentum on save."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        saved["state"] = {
            pid: {**entry, "momentum_buffer": torch.zeros_like(entry["momentum_buffer"])}
            for pid, entry in saved["state"].items()
        }
        return saved


class MutatingQuery(ContractedSGD):
    """optimizer_contract() writes into the param groups."""

    def optimizer_contract(self) -> OptimizerContract:
        for group in self.param_groups:
            group["queries"] = group.get("queries", 0) + 1
        return super().optimizer_contract()


class NonAtomicLoad(ContractedSGD):
    """Claims an atomic load but publishes group options before validating the state."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        for live, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            if isinstance(saved, dict) and type(saved.get("lr")) is float:
                live["lr"] = saved["lr"] * 2.0
        return super().stage_state_dict(state_dict)


class UndeclaredStateKey(ContractedSGD):
    """Keeps a per-parameter key its contract never declares."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    self.state[p]["grad_norm"] = float(p.grad.norm()) if p.grad is not None else 0.0
        return loss


class UndeclaredProtocol(ContractedSGD):
    """Implements CollectiveScoped without stating the collective_scope feature at all."""

    def optimizer_contract(self) -> OptimizerContract:
        capabilities = CONTRACT.capabilities
        features = {k: v for k, v in capabilities.features.items() if k != "collective_scope"}
        return OptimizerContract(
            CONTRACT.implementation,
            CONTRACT.state_layout,
            OptimizerCapabilities(
                capabilities.training,
                capabilities.checkpoints,
                capabilities.precisions,
                capabilities.supported_parameter_ranks,
                {**features, FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes()},
            ),
        )

    def collective_scope(self) -> object | None:
        return None

    def initialize_collective_state(self) -> bool:
        return False

    def refresh_collective_state(self) -> bool:
        return False

    def collective_budget(self) -> int:
        return 0


class PrecisionLiar(ContractedSGD):
    """Claims every precision (the example's contract) but steps only float32 parameters
    (lie p of issue 22: claimed precisions were never exercised)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(f"only float32 parameters are supported, got {p.dtype}")
        return super().step(closure)


class OffsetZeroIdentity(ContractedAdamW):
    """Answers every identity query with member 0's shard of the parameter (lie c of issue 22:
    every rank bound to the offset-0 shard)."""

    def shard_identity(self, parameter: object) -> ShardIdentity:
        shard = super().shard_identity(parameter)
        manifest = self.sharding_manifest()
        assert manifest is not None
        return next(s for s in manifest.shards if s.fqn == shard.fqn)


class AliasingExport(ContractedAdamW):
    """Its canonical document holds the live state tensors instead of copies (lie m of issue
    22, on the transport that replaced the dense-shard codec): an async save of it is torn."""

    def export_local_state(self) -> dict[str, Any]:
        document = super().export_local_state()
        tensors = {shard.fqn: tensor for tensor, shard in self.shard_bindings() if tensor is not None}
        for fqn, entry in document["parameters"].items():
            live = self.state.get(tensors[fqn], {})
            for key, value in entry["state"].items():
                if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor):
                    entry["state"][key] = live[key]
        return document


def aliasing_export_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return AliasingExport(named_parameters, lr=1e-2, weight_decay=0.01)


def offset_zero_identity_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return OffsetZeroIdentity(named_parameters, lr=1e-2, weight_decay=0.01)


def _factory(cls: type[ContractedSGD]) -> Any:
    def factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedSGD:
        return cls([p for _, p in named_parameters], lr=0.05, momentum=0.9, weight_decay=0.01)

    factory.__name__ = factory.__qualname__ = f"{cls.__name__}_factory"
    return factory


false_roundtrip_factory = _factory(FalseRoundTripClaim)
mutating_query_factory = _factory(MutatingQuery)
non_atomic_load_factory = _factory(NonAtomicLoad)
undeclared_state_key_factory = _factory(UndeclaredStateKey)
undeclared_protocol_factory = _factory(UndeclaredProtocol)
precision_liar_factory = _factory(PrecisionLiar)

#: factory name -> (the check that must fail, a fragment its detail must contain)
EXPECTED_FAILURES = {
    "false_roundtrip_factory": ("checkpoint.native_roundtrip", "continuation after a native round trip"),
    "mutating_query_factory": ("contract.deterministic_and_pure", "changed the optimizer"),
    "non_atomic_load_factory": ("checkpoint.native_atomic_load", "changed the optimizer"),
    "undeclared_state_key_factory": ("state.declared_variants", "'grad_norm' is not declared"),
    "undeclared_protocol_factory": ("contract.protocols_declared", "CollectiveScoped"),
    "precision_liar_factory": ("training.precisions", "precision:bfloat16 is claimed but TypeError"),
    "offset_zero_identity_factory": ("identity.flattened_training", "member 1: shard_identity() of its"),
    "aliasing_export_factory": ("checkpoint.canonical_local", "aliases live state"),
}

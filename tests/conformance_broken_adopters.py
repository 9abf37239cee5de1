"""Deliberately broken adopters: each lies about one claim, and the kit must name it. Those whose
loads or steps go wrong live in :mod:`conformance_broken_loads`; every factory and the check it
must fail (``EXPECTED_FAILURES``) are here."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from conformance_broken_loads import (
    AliasingLoad,
    ChecksKeysAndDtypesWhileWriting,
    ChecksTheRateOnly,
    CommitKeepsToken,
    CountsOnlyInInit,
    DecaysWithoutTheRate,
    DropsSchedulerKeys,
    FirstGroupOptionsEverywhere,
    FlatBufferAboveTwoDimensions,
    KeepsItsOwnRates,
    LaxNonAtomicLoad,
    MergingCommit,
    PeeksAtStateWhileStaging,
    ReadsTheRateOnce,
    RequiresFullState,
    ReshapesSameCount,
    RestoresOnlyTheRate,
    SkipsLoadHooks,
    TestsForNaNOnly,
    UncheckedOptions,
    WritesEntriesInTurn,
    WritesGroupsInTurn,
    WritesSavedRatesFirst,
)
from gefen_contracts import (
    FEATURE_STAGED_NATIVE_LOAD,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
)
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


class PartialInPlaceLoad(ContractedSGD):
    """Validates and copies one state entry at a time into the live buffers, the groups last:
    a load refused at the groups has already written the state."""

    def load_state_dict(self, state_dict: Any) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, entry in state_dict["state"].items():
            buffer = entry.get("momentum_buffer") if isinstance(entry, dict) else None
            if set(entry) != {"momentum_buffer", "step"} or not isinstance(buffer, torch.Tensor):
                raise ValueError(f"bad state entry {pid}")
            if buffer.dtype is not torch.float32 or not torch.isfinite(buffer).all():
                raise ValueError(f"bad state entry {pid}")
            live = self.state[params[pid]]
            if "momentum_buffer" in live and live["momentum_buffer"].shape == entry["momentum_buffer"].shape:
                live["momentum_buffer"].copy_(entry["momentum_buffer"])
        super().load_state_dict(state_dict)


class PublishesAtStage(ContractedSGD):
    """Validates on a shadow, then publishes at stage time; commit only consumes the token."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        staged = super().stage_state_dict(state_dict)
        groups, state = staged._payload
        for live, new in zip(self.param_groups, groups):
            live.update({k: new[k] for k in ("lr", "momentum", "weight_decay")})
        for param, entry in state.items():
            self.state[param] = {"momentum_buffer": entry["momentum_buffer"].clone(), "step": entry["step"]}
        return StagedTransaction(self, kind="native_load", token=self._version, payload=None)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        staged.claim(self, kind="native_load", current_token=self._version)
        self._version += 1


class UncheckedStagedLoad(ContractedSGD):
    """load_state_dict is right, but stage_state_dict checks nothing and commit publishes nothing."""

    def load_state_dict(self, state_dict: Any) -> None:
        ContractedSGD.commit_staged_state_dict(self, ContractedSGD.stage_state_dict(self, state_dict))

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        return StagedTransaction(self, kind="native_load", token=self._version, payload=state_dict)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        staged.claim(self, kind="native_load", current_token=self._version)
        self._version += 1


class RefusesWithRuntimeError(ContractedSGD):
    """Refuses corrupted checkpoints, but with a RuntimeError (StagedNativeLoad asks for a
    ValueError, TypeError or KeyError naming the problem)."""

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        try:
            return super().stage_state_dict(state_dict)
        except ValueError as exc:
            raise RuntimeError(f"device-side assert triggered ({exc})") from None


class UndeclaredCheckpointKey(ContractedSGD):
    """Writes a per-parameter key into every state_dict() entry that its contract never declares."""

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        saved["state"] = {pid: {**entry, "ema_norm": 0.0} for pid, entry in saved["state"].items()}
        return saved

    def stage_state_dict(self, state_dict: Any) -> StagedTransaction:
        if isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict):
            entries = state_dict["state"].items()
            state_dict = {
                **state_dict,
                "state": {
                    p: {k: v for k, v in e.items() if k != "ema_norm"} if isinstance(e, dict) else e for p, e in entries
                },
            }
        return super().stage_state_dict(state_dict)


def _declared_as(name: str, **changes: Any) -> OptimizerContract:
    fields = tuple(dataclasses.replace(f, **changes) if f.name == name else f for f in CONTRACT.state_layout.fields)
    return dataclasses.replace(CONTRACT, state_layout=dataclasses.replace(CONTRACT.state_layout, fields=fields))


class GeometryLiar(ContractedSGD):
    """Declares its momentum buffer a bfloat16 per-row statistic; keeps a float32 buffer of the
    parameter's shape."""

    def optimizer_contract(self) -> OptimizerContract:
        return _declared_as("momentum_buffer", dtype="bfloat16")


class ShapeLiar(ContractedSGD):
    """Declares its momentum buffer a per-row statistic; keeps one of the parameter's shape."""

    def optimizer_contract(self) -> OptimizerContract:
        return _declared_as("momentum_buffer", geometry=StateGeometry.ROW)


class ScalarLiar(ContractedSGD):
    """Declares its momentum buffer a scalar and its step count parameter-shaped: the
    geometries the kit did not check (it checked PARAMETER, ROW and COLUMN shapes only)."""

    def optimizer_contract(self) -> OptimizerContract:
        swapped = {"momentum_buffer": StateGeometry.SCALAR, "step": StateGeometry.PARAMETER}
        fields = tuple(
            dataclasses.replace(f, geometry=swapped[f.name]) if f.name in swapped else f
            for f in CONTRACT.state_layout.fields
        )
        return dataclasses.replace(CONTRACT, state_layout=dataclasses.replace(CONTRACT.state_layout, fields=fields))


_WITH_A_CACHE = dataclasses.replace(
    CONTRACT,
    state_layout=dataclasses.replace(
        CONTRACT.state_layout,
        fields=(
            *CONTRACT.state_layout.fields,
            StateField("momentum_norm", StateScope.PARAMETER, StateRole.CACHE, StateGeometry.SCALAR, dtype="float32"),
        ),
    ),
)


class CacheLiar(ContractedSGD):
    """Declares a per-parameter ``momentum_norm`` a cache (rebuilt, never checkpointed) and
    writes it into every checkpoint: a transport trusting the declaration drops it, a loader
    that does not know it refuses the checkpoint."""

    def optimizer_contract(self) -> OptimizerContract:
        return _WITH_A_CACHE

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        for entry in saved["state"].values():
            entry["momentum_norm"] = entry["momentum_buffer"].norm()
        return saved


class RankLiar(ContractedSGD):
    """Claims every parameter rank (``supported_parameter_ranks=None``) but steps 1-D and 2-D only."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() not in (1, 2):
                    raise RuntimeError(f"only 1-D and 2-D parameters, got a {p.dim()}-D one")
        return super().step(closure)


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


class KeepsItsOwnBetas(ContractedAdamW):
    """Loads everything but keeps its live ``betas`` (a momentum that ``OneCycleLR`` cycled
    restarts); passed while the kit scheduled float options only, not tuples of floats."""

    def load_state_dict(self, state_dict: Any) -> None:
        betas = [group["betas"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, live in zip(self.param_groups, betas, strict=True):
            group["betas"] = live


def keeps_its_own_betas_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return KeepsItsOwnBetas(named_parameters, lr=1e-2, weight_decay=0.01)


def aliasing_export_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return AliasingExport(named_parameters, lr=1e-2, weight_decay=0.01)


def offset_zero_identity_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return OffsetZeroIdentity(named_parameters, lr=1e-2, weight_decay=0.01)


class Float32OnlyInFloat32(ContractedSGD):
    """Declares a float32 momentum buffer but keeps it in the parameter's dtype, and claims no
    native checkpoint: only the state check under each claimed precision can see it."""

    def optimizer_contract(self) -> OptimizerContract:
        declared = _declared_as("momentum_buffer", dtype="float32")
        features = {**declared.capabilities.features, FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.no("no checkpoints")}
        capabilities = dataclasses.replace(declared.capabilities, checkpoints=(), features=features)
        return dataclasses.replace(declared, capabilities=capabilities)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for parameter, state in self.state.items():
            state["momentum_buffer"] = state["momentum_buffer"].to(parameter.dtype)
        return loss


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
partial_in_place_load_factory = _factory(PartialInPlaceLoad)
publishes_at_stage_factory = _factory(PublishesAtStage)
unchecked_staged_load_factory = _factory(UncheckedStagedLoad)
refuses_with_runtime_error_factory = _factory(RefusesWithRuntimeError)
undeclared_checkpoint_key_factory = _factory(UndeclaredCheckpointKey)
geometry_liar_factory = _factory(GeometryLiar)
shape_liar_factory = _factory(ShapeLiar)
rank_liar_factory = _factory(RankLiar)
keeps_its_own_rates_factory = _factory(KeepsItsOwnRates)
writes_saved_rates_first_factory = _factory(WritesSavedRatesFirst)
float32_only_in_float32_factory = _factory(Float32OnlyInFloat32)
flat_buffer_above_two_dimensions_factory = _factory(FlatBufferAboveTwoDimensions)
counts_only_in_init_factory = _factory(CountsOnlyInInit)
aliasing_load_factory = _factory(AliasingLoad)
restores_only_the_rate_factory = _factory(RestoresOnlyTheRate)
drops_scheduler_keys_factory = _factory(DropsSchedulerKeys)
merging_commit_factory = _factory(MergingCommit)
requires_full_state_factory = _factory(RequiresFullState)
commit_keeps_token_factory = _factory(CommitKeepsToken)
skips_load_hooks_factory = _factory(SkipsLoadHooks)
unchecked_options_factory = _factory(UncheckedOptions)
writes_entries_in_turn_factory = _factory(WritesEntriesInTurn)
cache_liar_factory = _factory(CacheLiar)
first_group_options_everywhere_factory = _factory(FirstGroupOptionsEverywhere)
lax_non_atomic_load_factory = _factory(LaxNonAtomicLoad)
decays_without_the_rate_factory = _factory(DecaysWithoutTheRate)
peeks_at_state_while_staging_factory = _factory(PeeksAtStateWhileStaging)
reshapes_same_count_factory = _factory(ReshapesSameCount)
reads_the_rate_once_factory = _factory(ReadsTheRateOnce)
scalar_liar_factory = _factory(ScalarLiar)
checks_keys_and_dtypes_while_writing_factory = _factory(ChecksKeysAndDtypesWhileWriting)
checks_the_rate_only_factory = _factory(ChecksTheRateOnly)
tests_for_nan_only_factory = _factory(TestsForNaNOnly)


def writes_groups_in_turn_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedSGD:
    """Two groups (matrices decayed, the rest not), as training scripts build them."""
    decayed = [p for _, p in named_parameters if p.dim() >= 2]
    rest = [p for _, p in named_parameters if p.dim() < 2]
    return WritesGroupsInTurn(
        [{"params": decayed}, {"params": rest, "weight_decay": 0.0}], lr=0.05, momentum=0.9, weight_decay=0.01
    )


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
    # each passed the kit before it loaded from a source trained further than its targets,
    # fed the corruptions to stage_state_dict too and required the protocol's exception types
    "partial_in_place_load_factory": ("checkpoint.native_atomic_load", "a rejected load_state_dict"),
    "publishes_at_stage_factory": ("checkpoint.native_atomic_load", "stage_state_dict changed the optimizer"),
    "unchecked_staged_load_factory": ("checkpoint.native_atomic_load", "accepted a corrupted checkpoint"),
    "refuses_with_runtime_error_factory": ("checkpoint.native_atomic_load", "raised RuntimeError, not a ValueError"),
    "undeclared_checkpoint_key_factory": ("state.declared_variants", "in state_dict(): group 0 slot 0"),
    "geometry_liar_factory": ("state.declared_variants", "'momentum_buffer' holds float32, declared bfloat16"),
    "shape_liar_factory": ("state.declared_variants", "its row geometry gives"),
    "rank_liar_factory": ("training.parameter_ranks", "ranks:0 is claimed but a 0-D parameter raised RuntimeError"),
    # each passed the kit before its loads came from a source whose rates were scheduled, and
    # before the state was checked under every claimed precision and parameter rank
    "keeps_its_own_rates_factory": ("checkpoint.native_roundtrip", "state_dict after load"),
    "writes_saved_rates_first_factory": ("checkpoint.native_atomic_load", "a rejected load_state_dict"),
    "float32_only_in_float32_factory": ("training.precisions", "'momentum_buffer' holds bfloat16, declared float32"),
    "flat_buffer_above_two_dimensions_factory": ("training.parameter_ranks", "its parameter geometry gives (2, 3, 4)"),
    "counts_only_in_init_factory": ("training.copies", "cannot step after copy.deepcopy: AttributeError"),
    # each passed the kit before its 2026-12-06 mutation review
    "aliasing_load_factory": ("checkpoint.native_roundtrip", "after the loaded optimizer stepped"),
    "restores_only_the_rate_factory": ("checkpoint.native_roundtrip", "['momentum']"),
    "drops_scheduler_keys_factory": ("checkpoint.native_roundtrip", "initial_lr"),
    "merging_commit_factory": ("checkpoint.native_roundtrip", "after loading a step-0 checkpoint"),
    "requires_full_state_factory": ("checkpoint.native_roundtrip", "saved before the first step was refused"),
    "commit_keeps_token_factory": ("checkpoint.native_atomic_load", "before another load was committed"),
    "skips_load_hooks_factory": ("checkpoint.native_roundtrip", "load hooks as []"),
    "unchecked_options_factory": ("checkpoint.native_atomic_load", "(non_finite_option)"),
    "writes_entries_in_turn_factory": ("checkpoint.native_atomic_load", "(last_entry_non_finite) changed"),
    "cache_liar_factory": ("state.declared_variants", "'momentum_norm' is declared a cache"),
    "first_group_options_everywhere_factory": ("checkpoint.native_roundtrip", "two-group state_dict after load"),
    "lax_non_atomic_load_factory": ("checkpoint.native_refusals", "accepted a corrupted checkpoint"),
    # passed the kit before it ran torch's recipe (2026-12-06)
    "decays_without_the_rate_factory": ("checkpoint.torch_recipe", "nested recipe (its template step)"),
    # each passed the kit before a probe of it (2026-12-07)
    "peeks_at_state_while_staging_factory": ("checkpoint.native_atomic_load", "changed a fresh optimizer"),
    "reshapes_same_count_factory": (
        "checkpoint.native_atomic_load",
        "accepted a corrupted checkpoint: load_state_dict (transposed)",
    ),
    "writes_groups_in_turn_factory": ("checkpoint.native_atomic_load", "(last_group_non_finite_option) changed"),
    "reads_the_rate_once_factory": (
        "training.replicated",
        "halving every group's lr after the first step changed nothing",
    ),
    "scalar_liar_factory": ("state.declared_variants", "'momentum_buffer' has shape (16, 8), declared a scalar"),
    # each passed the kit before a probe of adopting the convention (2026-12-07, sixth session)
    "checks_keys_and_dtypes_while_writing_factory": (
        "checkpoint.native_atomic_load",
        "(last_entry_missing_key) changed",
    ),
    "checks_the_rate_only_factory": (
        "checkpoint.native_atomic_load",
        "accepted a corrupted checkpoint: load_state_dict (non_finite_other_option)",
    ),
    "tests_for_nan_only_factory": (
        "checkpoint.native_atomic_load",
        "accepted a corrupted checkpoint: load_state_dict (non_finite)",
    ),
    "keeps_its_own_betas_factory": ("checkpoint.native_roundtrip", "['betas']"),
}

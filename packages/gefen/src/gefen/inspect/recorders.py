"""Stand-in optimizers that let gefen-dcp's own loaders verify a checkpoint without a model.

Verification must use the code paths real loads use, not a second reading of the formats,
so ``gefen inspect`` loads a DCP checkpoint into a *recorder*: an object that implements
the Protocol the loader drives (:class:`gefen_contracts.protocols.ParameterShapedState` or
:class:`gefen_contracts.protocols.PortableAdapter`, or a :class:`gefen_contracts.protocols.Composite`
of portable recorders), takes its implementation name and parameter shapes from the
checkpoint's own records, holds every parameter as one whole ``REPLICATED`` piece in this
process, accepts whatever options and variants were saved, and keeps only a summary of what
it was handed (bytes and non-finite values per parameter). Everything the loader checks
(envelope digests, chunk digests, catalog and fragment digests, coverage, shapes, limits)
is checked exactly as it would be for a real optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    TrainingSupport,
)
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    TopologyChange,
)
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotLayout, PortableSlotState
from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.torch_support import as_imported
from gefen_contracts.transactions import StagedTransaction

__all__ = ["LoadedParameter", "RecordingComposite", "RecordingNativeState", "RecordingPortableAdapter"]

_REPLICATED = frozenset({ParameterLayout.REPLICATED})


@dataclass(frozen=True, slots=True)
class LoadedParameter:
    """What a recorder was handed for one parameter."""

    fqn: str
    variant: str
    counters: Mapping[str, int]
    nonfinite: Mapping[str, int]


def _contract(
    implementation: str, features: Mapping[str, FeatureStatus], transport: CheckpointTransport
) -> OptimizerContract:
    entry = CheckpointSupport(
        transport,
        _REPLICATED,
        ProcessGroupScope.NONE,
        LoadAtomicity.GROUP_VOTED,
        transitions=(TopologyTransition(frozenset(ParameterLayout), _REPLICATED, frozenset(TopologyChange)),),
    )
    return OptimizerContract(
        implementation=implementation,
        state_layout=OptimizerStateLayout(fields=(), parameter_variants=()),
        capabilities=OptimizerCapabilities(
            training=(TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),),
            checkpoints=(entry,),
            precisions=frozenset(Precision),
            supported_parameter_ranks=None,
            features=dict(features),
        ),
    )


def _expanded(slot: PortableSlotState) -> PortableSlotState:
    """``slot`` with block fields that passed through unexpanded (an import onto the exporting
    layout) expanded per element like the piece's element fields."""
    if not slot.block_fields or not slot.element_fields:
        return slot
    shape = next(iter(slot.element_fields.values())).shape  # type: ignore[attr-defined]
    return as_imported(slot, tuple(shape))


def _summary(fqn: str, variant: str, counters: Mapping[str, int], fields: Mapping[str, object]) -> LoadedParameter:
    nonfinite: dict[str, int] = {}
    for name, tensor in fields.items():
        assert isinstance(tensor, torch.Tensor)
        bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
        if bad:
            nonfinite[name] = bad
    return LoadedParameter(fqn, variant, dict(counters), nonfinite)


class RecordingNativeState:
    """A :class:`gefen_contracts.protocols.ParameterShapedState` with ``parameters`` plain placeholder
    parameters, recording what a ``GefenDCPState`` load hands its ``stage_state_dict``."""

    def __init__(self, implementation: str, parameters: int) -> None:
        self._implementation = implementation
        self.param_groups: list[dict[str, Any]] = [{"params": [torch.empty(0) for _ in range(parameters)]}]
        self.loaded: dict[str, LoadedParameter] = {}

    def optimizer_contract(self) -> OptimizerContract:
        return _contract(
            self._implementation,
            {FEATURE_PARAMETER_SHAPED_STATE: FeatureStatus.yes()},
            CheckpointTransport.PARAMETER_SHAPED,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        state = state_dict.get("state", {})
        summaries = {}
        for index, entry in sorted(state.items()) if isinstance(state, dict) else ():
            if not isinstance(entry, dict):
                continue
            tensors = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
            counters = {k: v for k, v in entry.items() if type(v) is int}
            summaries[f"state/{index}"] = _summary(f"state/{index}", "", counters, tensors)
        return StagedTransaction(self, kind="inspect", token=0, payload=summaries)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        loaded = staged.claim(self, kind="inspect", current_token=0)
        assert isinstance(loaded, dict)
        self.loaded = loaded


class RecordingPortableAdapter:
    """A :class:`gefen_contracts.protocols.PortableAdapter` holding every parameter of a catalog whole."""

    def __init__(self, implementation: str, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self._implementation = implementation
        shards = [
            ShardIdentity(ParameterIdentity(fqn, shape), ParameterLayout.REPLICATED, LogicalSlice(0, _numel(shape)))
            for fqn, shape in shapes
        ]
        self._layout = PortableLayout(
            implementation,
            ShardingManifest(tuple(shards)),
            tuple(PortableSlotLayout(shard, (0, index), shard.fqn) for index, shard in enumerate(shards)),
        )
        self.loaded: dict[str, LoadedParameter] = {}

    def optimizer_contract(self) -> OptimizerContract:
        return _contract(
            self._implementation, {FEATURE_PORTABLE_STATE: FeatureStatus.yes()}, CheckpointTransport.CANONICAL_GLOBAL
        )

    def portable_layout(self) -> PortableLayout:
        return self._layout

    def portable_export(self) -> PortableExport:
        raise NotImplementedError("a recorder only loads")

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        summaries = {
            slot.fqn: _summary(slot.fqn, slot.variant, slot.counters, {**slot.element_fields, **slot.replica_fields})
            for slot in map(_expanded, slots)
        }
        return StagedTransaction(self, kind="inspect", token=0, payload=summaries)

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        loaded = staged.claim(self, kind="inspect", current_token=0)
        assert isinstance(loaded, dict)
        self.loaded = loaded


class RecordingComposite:
    """A :class:`gefen_contracts.protocols.Composite` of portable recorders, one per role."""

    def __init__(
        self, implementation: str, children: Mapping[str, RecordingPortableAdapter], routing: Mapping[str, str]
    ) -> None:
        self._implementation = implementation
        self._children = dict(children)
        self._routing = tuple(sorted(routing.items()))

    def optimizer_contract(self) -> OptimizerContract:
        features = {FEATURE_PORTABLE_STATE: FeatureStatus.yes(), FEATURE_COMPOSITE: FeatureStatus.yes()}
        return _contract(self._implementation, features, CheckpointTransport.CANONICAL_GLOBAL)

    def child_optimizers(self) -> dict[str, RecordingPortableAdapter]:
        return dict(self._children)

    def parameter_routing(self) -> tuple[tuple[str, str], ...]:
        return self._routing


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total

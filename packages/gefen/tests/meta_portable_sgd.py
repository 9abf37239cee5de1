"""A test adopter of the portable Protocol for the command line's tests (one process, replicated).

``PortableMomentumSGD`` is torch's SGD with momentum plus :class:`gefen_contracts.protocols.PortableAdapter`
over an ungrouped ``REPLICATED`` layout of its named parameters: enough to write portable
documents and portable DCP checkpoints for ``gefen inspect`` and to run ``gefen bench
portable`` on one rank, before Gefen or ContractedAdamW claim ``portable_state`` on this branch.
Module-level names only, so spawned benchmark ranks can import ``meta_portable_sgd:factory``.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_PORTABLE_STATE,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    StateValidationError,
    TrainingSupport,
)
from gefen_contracts.enums import CheckpointTransport, LoadAtomicity, ParameterLayout, Precision, ProcessGroupScope
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotLayout, PortableSlotState
from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.transactions import StagedTransaction

IMPLEMENTATION = "tests.PortableMomentumSGD"
_REPLICATED = frozenset({ParameterLayout.REPLICATED})
CONTRACT = OptimizerContract(
    implementation=IMPLEMENTATION,
    state_layout=OptimizerStateLayout(fields=(), parameter_variants=()),
    capabilities=OptimizerCapabilities(
        training=(TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),),
        checkpoints=(
            CheckpointSupport(
                CheckpointTransport.CANONICAL_GLOBAL, _REPLICATED, ProcessGroupScope.NONE, LoadAtomicity.GROUP_VOTED
            ),
        ),
        precisions=frozenset({Precision.FLOAT32}),
        supported_parameter_ranks=None,
        features={FEATURE_PORTABLE_STATE: FeatureStatus.yes()},
    ),
)


class PortableMomentumSGD(torch.optim.SGD):
    """SGD with momentum whose state exports and imports as portable documents."""

    def __init__(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], **options: Any) -> None:
        super().__init__(list(named_parameters), **options)  # torch keeps the names in param_names
        shards = [
            ShardIdentity(
                ParameterIdentity(name, tuple(p.shape)), ParameterLayout.REPLICATED, LogicalSlice(0, p.numel())
            )
            for name, p in named_parameters
        ]
        slots = tuple(PortableSlotLayout(shard, (0, i), shard.fqn) for i, shard in enumerate(shards))
        self._layout = PortableLayout(IMPLEMENTATION, ShardingManifest(tuple(shards)), slots)
        self._version = 0

    def step(self, closure: Any = None) -> Any:
        self._version += 1
        return super().step(closure)

    def optimizer_contract(self) -> OptimizerContract:
        return CONTRACT

    def _options(self) -> dict[str, float]:
        group = self.param_groups[0]
        return {"lr": float(group["lr"]), "momentum": float(group["momentum"])}

    def portable_layout(self) -> PortableLayout:
        return self._layout

    def portable_export(self) -> PortableExport:
        slots = []
        for slot, p in zip(self._layout.slots, self.param_groups[0]["params"]):
            buffer = self.state.get(p, {}).get("momentum_buffer")
            if buffer is None:
                slots.append(PortableSlotState(slot, self._options(), "pristine"))
            else:
                fields = {"momentum_buffer": buffer.detach().clone()}
                slots.append(PortableSlotState(slot, self._options(), "momentum", element_fields=fields))
        return PortableExport(IMPLEMENTATION, {}, {}, self._layout.manifest, tuple(slots))

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        staged = {}
        for slot, p in zip(slots, self.param_groups[0]["params"]):
            if dict(slot.options) != self._options():
                raise StateValidationError(f"options of {slot.fqn!r} differ")
            if slot.variant == "momentum":
                staged[p] = {"momentum_buffer": slot.element_fields["momentum_buffer"].clone()}  # type: ignore[attr-defined]
            elif slot.variant != "pristine":
                raise StateValidationError(f"unknown variant {slot.variant!r}")
        return StagedTransaction(self, kind="portable", token=self._version, payload=staged)

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        state = staged.claim(self, kind="portable", current_token=self._version)
        self.state = collections.defaultdict(dict, state)  # type: ignore[arg-type]
        self._version += 1


def factory(named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> PortableMomentumSGD:
    """The benchmark / conformance-kit factory."""
    return PortableMomentumSGD(list(named_parameters), lr=0.01, momentum=0.9)

"""Third-party adopters of portable resharding for the kit's multi-process portable checks.

``ThirdPartyAdamW`` is ``ContractedAdamW`` with a contract that leaves out the claims no kit
check executes (same-topology *native* checkpoints of DTensor parameters, and torch's recipe on
them): everything it
claims, portable resharding included, must pass the kit with zero waivers.
``ShardBlindImport`` lies about portable state on flattened shards: bound to them, it
imports every moment as zeros, so the kit must name the flattened and transition claims.
Module-level names only: spawned gloo ranks import ``conformance_portable_adopters:FACTORY``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import OptimizerContract
from gefen_contracts.enums import CheckpointTransport, ParameterLayout
from gefen_contracts.exchange import PortableSlotState
from gefen_contracts.transactions import StagedTransaction
from gefen_hybrid import ContractedAdamW

_DTENSOR = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD


class ThirdPartyAdamW(ContractedAdamW):
    """``ContractedAdamW`` without its DTensor checkpoint claims (module docstring)."""

    def optimizer_contract(self) -> OptimizerContract:
        contract = super().optimizer_contract()
        kept = []
        for entry in contract.capabilities.checkpoints:
            if entry.transport in (CheckpointTransport.NATIVE_OPTIMIZER, CheckpointTransport.PYTORCH_RANK_LOCAL):
                same = entry.same_topology - {_DTENSOR}
                transitions = tuple(t for t in entry.transitions if _DTENSOR not in t.source_layouts | t.target_layouts)
                if not same and not transitions:
                    continue
                entry = dataclasses.replace(entry, same_topology=same, transitions=transitions)
            kept.append(entry)
        capabilities = dataclasses.replace(contract.capabilities, checkpoints=tuple(kept))
        return dataclasses.replace(contract, capabilities=capabilities)


class ShardBlindImport(ThirdPartyAdamW):
    """Bound to flattened shards, imports every moment as zeros (module docstring)."""

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        flattened = any(s.layout.shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD for s in slots)
        if flattened:
            slots = [
                dataclasses.replace(s, element_fields={k: torch.zeros_like(v) for k, v in s.element_fields.items()})
                for s in slots
            ]
        return super().portable_prepare_import(implementation=implementation, policy=policy, common=common, slots=slots)


def third_party_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return ThirdPartyAdamW(named_parameters, lr=1e-2, weight_decay=0.01)


def shard_blind_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedAdamW:
    return ShardBlindImport(named_parameters, lr=1e-2, weight_decay=0.01)

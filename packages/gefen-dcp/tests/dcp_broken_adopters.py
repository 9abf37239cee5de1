"""Dense-shard adopters that break one promise each (for the conformance checks' proof)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts import DenseShardLoad, StagedTransaction
from gefen_dcp.testing import Int8MomentumSGD


class ForgetfulCodec(Int8MomentumSGD):
    """Loads zeros instead of the loaded momentum."""

    def prepare_dense_shard_load(
        self, common: Mapping[str, Any], slots: Mapping[str, DenseShardLoad]
    ) -> StagedTransaction:
        zeroed = {
            fqn: DenseShardLoad(
                load.fqn,
                load.options,
                load.variant,
                load.counters,
                {k: torch.zeros_like(v) for k, v in load.fields.items()},  # type: ignore[arg-type]
            )
            for fqn, load in slots.items()
        }
        return super().prepare_dense_shard_load(common, zeroed)


class MutatingPrepare(Int8MomentumSGD):
    """Stages by writing into the live state."""

    def prepare_dense_shard_load(
        self, common: Mapping[str, Any], slots: Mapping[str, DenseShardLoad]
    ) -> StagedTransaction:
        for state in self.state.values():
            if "momentum" in state:
                state["momentum"].mul_(0.5)
        return super().prepare_dense_shard_load(common, slots)


class StaleCommit(Int8MomentumSGD):
    """Commits whatever it is handed, stale or foreign."""

    def commit_dense_shard_load(self, staged: StagedTransaction) -> None:
        payload = staged._payload
        if payload is None:
            return
        _groups, state = payload  # type: ignore[misc]
        fresh: Any = type(self.state)()
        fresh.update({k: v for k, v in state.items() if any(k is p for g in self.param_groups for p in g["params"])})
        self.state = fresh


def forgetful(named: list[tuple[str, torch.nn.Parameter]]) -> ForgetfulCodec:
    return ForgetfulCodec(named, lr=0.05, momentum=0.9)


def mutating(named: list[tuple[str, torch.nn.Parameter]]) -> MutatingPrepare:
    return MutatingPrepare(named, lr=0.05, momentum=0.9)


def stale(named: list[tuple[str, torch.nn.Parameter]]) -> StaleCommit:
    return StaleCommit(named, lr=0.05, momentum=0.9)

"""``ContractedAdamW``'s ``PortableAdapter`` methods.

Functions of the optimizer, which :class:`~gefen_hybrid.adamw.ContractedAdamW`'s four
methods delegate to (one concept: handing AdamW's state to the optimizer-agnostic driver
``gefen_portable`` and taking it back). The format is described in
:mod:`gefen_hybrid.adamw_portable`. Every method first
verifies the sealed layout (if any) and requires its feature to be supported
(``NotSupportedError`` with the contract's reasons otherwise). Imports and loads are staged on
fresh containers through the native-load validation and published by the same swap as a
native load; a staged transaction is single use and refused (``StaleTransactionError``, nothing
changed) when it is foreign or the optimizer changed since staging.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gefen_contracts import FEATURE_PORTABLE_STATE, FeatureStatus, NotSupportedError
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .adamw_portable import native_state_from_portable, portable_export_of, portable_layout_of
from .adamw_state import StagedAdamWState, stage_adamw_state

if TYPE_CHECKING:
    from .adamw import ContractedAdamW

__all__ = ["portable_commit_import", "portable_export", "portable_layout", "portable_prepare_import"]

_PORTABLE_KIND = "gefen.ContractedAdamW.portable_import"


def _require(optimizer: ContractedAdamW, feature: str, where: str) -> None:
    optimizer._verify_layout(where)
    readiness = optimizer._readiness()
    status: FeatureStatus = readiness.portable
    if not status.supported:
        raise NotSupportedError(feature, status.reasons)


def _staged(optimizer: ContractedAdamW, kind: str, native: Mapping[str, Any]) -> StagedTransaction:
    staged = stage_adamw_state(optimizer.param_groups, native)
    return StagedTransaction(optimizer, kind=kind, token=optimizer._freshness(), payload=staged)


def _commit(optimizer: ContractedAdamW, kind: str, staged: StagedTransaction, where: str) -> None:
    optimizer._verify_layout(where)
    payload = require_transaction(staged).claim(optimizer, kind=kind, current_token=optimizer._freshness())
    assert isinstance(payload, StagedAdamWState)
    optimizer._publish_state(payload)


# -- PortableAdapter (ContractedAdamW's methods delegate here) ------------------------------


def portable_layout(optimizer: ContractedAdamW) -> PortableLayout:
    """The local target layout: the sealed one after ``post_sharding``, else one ungrouped
    ``REPLICATED`` shard per parameter keyed by its torch name (no state, no collective)."""
    _require(optimizer, FEATURE_PORTABLE_STATE, "portable_layout")
    return portable_layout_of(optimizer.param_groups, optimizer._identity_binding.sealed)


def portable_export(optimizer: ContractedAdamW) -> PortableExport:
    """Every local slot's options, variant, ``step`` and fp32 moments (fresh CPU copies; no
    collective, nothing mutated)."""
    _require(optimizer, FEATURE_PORTABLE_STATE, "portable_export")
    layout = portable_layout_of(optimizer.param_groups, optimizer._identity_binding.sealed)
    return portable_export_of(optimizer.param_groups, optimizer.state, layout)


def portable_prepare_import(
    optimizer: ContractedAdamW,
    *,
    implementation: str,
    policy: Mapping[str, Any],
    common: Mapping[str, Any],
    slots: Sequence[PortableSlotState],
) -> StagedTransaction:
    """Validate records projected onto ``portable_layout().slots`` and stage them (no mutation).

    Each group takes its hyperparameters from its parameters' records (which must agree),
    math flags must equal this optimizer's, fields are converted to each parameter's dtype
    only when that is exact; ``StateValidationError`` names the first problem.
    """
    _require(optimizer, FEATURE_PORTABLE_STATE, "portable_prepare_import")
    layout = portable_layout_of(optimizer.param_groups, optimizer._identity_binding.sealed)
    native = native_state_from_portable(
        optimizer.param_groups, layout, implementation=implementation, policy=policy, common=common, slots=slots
    )
    return _staged(optimizer, _PORTABLE_KIND, native)


def portable_commit_import(optimizer: ContractedAdamW, staged: StagedTransaction) -> None:
    """Publish a prepared portable import by swaps that cannot raise (single use)."""
    _commit(optimizer, _PORTABLE_KIND, staged, "portable_commit_import")

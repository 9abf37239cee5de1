"""``ContractedAdamW``'s ``PortableAdapter`` methods.

:class:`AdamWExchangeMethods` is a base class of :class:`~gefen_hybrid.adamw.ContractedAdamW`
(kept apart because it is one concept: handing AdamW's state to the optimizer-agnostic
driver ``gefen_portable`` and taking it back). The format is described in
:mod:`gefen_hybrid.adamw_portable`. Every method first
verifies the sealed layout (if any) and requires its feature to be supported
(``NotSupportedError`` with the contract's reasons otherwise). Imports and loads are staged on
fresh containers through the native-load validation and published by the same swap as a
native load; a staged transaction is single use and refused (``StaleTransactionError``, nothing
changed) when it is foreign or the optimizer changed since staging.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from gefen_contracts import FEATURE_PORTABLE_STATE, FeatureStatus, NotSupportedError
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.torch_support import SealedLayout
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .adamw_contract import AdamWReadiness
from .adamw_portable import native_state_from_portable, portable_export_of, portable_layout_of
from .adamw_state import StagedAdamWState, stage_adamw_state

__all__ = ["AdamWExchangeMethods"]

_PORTABLE_KIND = "gefen.ContractedAdamW.portable_import"


class AdamWExchangeMethods:
    """Portable state for ``ContractedAdamW`` (see the module docstring)."""

    param_groups: list[dict[str, Any]]
    state: Any
    _sealed: SealedLayout | None

    def _verify_layout(self, where: str) -> None:
        raise NotImplementedError

    def _readiness(self) -> AdamWReadiness:
        raise NotImplementedError

    def _freshness(self) -> Hashable:
        raise NotImplementedError

    def _publish_state(self, payload: StagedAdamWState) -> None:
        raise NotImplementedError

    def _require(self, feature: str, where: str) -> None:
        self._verify_layout(where)
        readiness = self._readiness()
        status: FeatureStatus = readiness.portable
        if not status.supported:
            raise NotSupportedError(feature, status.reasons)

    def _staged(self, kind: str, native: Mapping[str, Any]) -> StagedTransaction:
        staged = stage_adamw_state(self.param_groups, native)
        return StagedTransaction(self, kind=kind, token=self._freshness(), payload=staged)

    def _commit(self, kind: str, staged: StagedTransaction, where: str) -> None:
        self._verify_layout(where)
        payload = require_transaction(staged).claim(self, kind=kind, current_token=self._freshness())
        assert isinstance(payload, StagedAdamWState)
        self._publish_state(payload)

    # -- PortableAdapter ----------------------------------------------------------------------

    def portable_layout(self) -> PortableLayout:
        """The local target layout: the sealed one after ``post_sharding``, else one ungrouped
        ``REPLICATED`` shard per parameter keyed by its torch name (no state, no collective)."""
        self._require(FEATURE_PORTABLE_STATE, "portable_layout")
        return portable_layout_of(self.param_groups, self._sealed)

    def portable_export(self) -> PortableExport:
        """Every local slot's options, variant, ``step`` and fp32 moments (fresh CPU copies; no
        collective, nothing mutated)."""
        self._require(FEATURE_PORTABLE_STATE, "portable_export")
        layout = portable_layout_of(self.param_groups, self._sealed)
        return portable_export_of(self.param_groups, self.state, layout)

    def portable_prepare_import(
        self,
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
        self._require(FEATURE_PORTABLE_STATE, "portable_prepare_import")
        layout = portable_layout_of(self.param_groups, self._sealed)
        native = native_state_from_portable(
            self.param_groups, layout, implementation=implementation, policy=policy, common=common, slots=slots
        )
        return self._staged(_PORTABLE_KIND, native)

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        """Publish a prepared portable import by swaps that cannot raise (single use)."""
        self._commit(_PORTABLE_KIND, staged, "portable_commit_import")

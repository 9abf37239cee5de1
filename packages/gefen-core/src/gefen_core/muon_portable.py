"""``GefenMuon``'s side of portable state: the :class:`gefen_contracts.protocols.PortableAdapter` Protocol.

The same records as ``Gefen``'s (:mod:`gefen_core.transport_records`: policy
``{"schema_version", "deterministic"}``, common ``{"global_step", "codebook"}``), with
implementation ``"gefen.GefenMuon"`` and the variants, counters and fields of
:mod:`gefen_core.muon_exchange`. Layouts: the sealed ``post_sharding`` layout
(``REPLICATED`` and ``WHOLE_PARAMETER_OWNER``: the owner exports and imports the whole
matrix, non-owners hold nothing), or before it the implicit one, an ungrouped
``REPLICATED`` shard per named matrix. Whole matrices keep their blocks across any change of
owners or members, so a portable round trip of GefenMuon is exact whenever the document's
codebook re-encodes them (always, for state GefenMuon exported). DTensor (FSDP2) matrices use
parameter-shaped native state (``gefen_dcp.GefenDCPState``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from gefen_contracts import FEATURE_PORTABLE_STATE, FeatureStatus, StateValidationError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.torch_support import SealedLayout, as_imported
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .distributed import is_dtensor
from .muon_exchange import (
    EXECUTION_OPTIONS,
    PRISTINE,
    check_incoming_muon,
    live_muon_piece,
    muon_entry,
    plan_muon_piece,
)
from .muon_native_state import export_muon_state_dict, slot_layouts
from .transport_records import checked_import_records, portable_common, portable_layout_of, portable_policy
from .transport_slots import (
    BoundLayoutHook,
    adopted_groups,
    named_slots,
    naming_blockers,
    option_blockers,
    plain_options,
    require_feature,
    transport_options,
)

__all__ = ["MUON_IMPORT_KIND", "GefenMuonPortableState"]

#: The kind of the staged transaction ``portable_prepare_import`` returns.
MUON_IMPORT_KIND = "gefen.GefenMuon.portable_import"
_IMPLEMENTATION = "gefen.GefenMuon"
_WHO = "GefenMuon portable state"
_PORTABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER})


class _Host(Protocol):
    param_groups: Any
    state: Any
    _codebook: torch.Tensor | None
    _deterministic: bool
    _version: int

    @property
    def global_step(self) -> int: ...

    def _bound_layout(self) -> SealedLayout | None: ...

    def _with_identity_guard(self, native: dict[str, Any]) -> dict[str, Any]: ...

    def _verify_layout(self, where: str) -> None: ...

    def _portable_status(self) -> FeatureStatus: ...

    def portable_layout(self) -> PortableLayout: ...

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction: ...

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None: ...


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"{_WHO}: {message}")


class GefenMuonPortableState(BoundLayoutHook):
    """Mixin of ``GefenMuon``: the ``PortableAdapter`` Protocol (see the module docstring)."""

    def _portable_status(self: _Host) -> FeatureStatus:
        """Whether ``portable_state`` is supported now, with the reasons when not (cheap)."""
        reasons: list[str] = []
        sealed = self._bound_layout()
        if sealed is None:
            reasons.extend(naming_blockers(self.param_groups))
            dtensors = sum(1 for group in self.param_groups for p in group["params"] if is_dtensor(p))
            if dtensors:
                reasons.append(
                    f"{dtensors} matrix(es) are DTensor (FSDP2) shards, which the implicit replicated layout cannot "
                    "describe: checkpoint their parameter-shaped native state (gefen_dcp.GefenDCPState)"
                )
        else:
            others = sorted({s.layout.value for _, s in sealed.bindings} - {x.value for x in _PORTABLE_LAYOUTS})
            if others:
                reasons.append(f"GefenMuon's portable state covers replicated and whole-owner layouts, not {others}")
        reasons.extend(option_blockers(self.param_groups, "portable"))
        return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

    def portable_layout(self: _Host) -> PortableLayout:
        """The local target layout: the sealed one, or the implicit one (no state, no tensors)."""
        return portable_layout_of(self.param_groups, self._bound_layout(), _IMPLEMENTATION)

    def portable_export(self: _Host) -> PortableExport:
        """This member's compact state (codes, block scales, NorMuon statistic: fresh CPU copies); no collective."""
        self._verify_layout("portable_export")
        require_feature(FEATURE_PORTABLE_STATE, self._portable_status())
        layout = self.portable_layout()
        exported = []
        for slot, slot_layout in zip(named_slots(self.param_groups, self._bound_layout()), layout.slots):
            options = transport_options(self.param_groups[slot.group_index])
            state = None if slot.tensor is None else self.state.get(slot.tensor)
            shape = () if slot.tensor is None else tuple(slot.tensor.shape)
            variant, counters, piece = live_muon_piece(state, shape, self._codebook)
            if piece is None:
                exported.append(PortableSlotState(slot_layout, options, PRISTINE))
                continue
            exported.append(piece.portable_slot(slot_layout, options, variant, counters))
        policy = portable_policy(self._deterministic)
        common = portable_common(self.global_step, self._codebook)
        return PortableExport(_IMPLEMENTATION, policy, common, layout.manifest, tuple(exported))

    def portable_prepare_import(
        self: _Host,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        """Re-encode projected records for this optimizer's layout and stage them (no mutation).

        Raises :class:`~gefen_contracts.StateValidationError` naming the problem
        (``LayoutTamperedError`` when a sealed layout was changed outside ``post_sharding``).
        """
        global_step, codebook, pairs = checked_import_records(
            self,
            implementation=implementation,
            expected_implementation=_IMPLEMENTATION,
            policy=policy,
            common=common,
            slots=slots,
            who=_WHO,
        )
        records: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in self.param_groups]
        entries: dict[tuple[int, int], dict[str, Any]] = {}
        for slot, record in pairs:
            records[slot.group_index].append((slot.fqn, plain_options(record.options)))
            if slot.tensor is None:
                continue
            rows, cols = (int(d) for d in slot.tensor.shape)
            if record.block_fields:  # passed through unexpanded: GefenMuon re-blocks from the expanded form
                record = as_imported(record, (rows, cols))
            piece = check_incoming_muon(
                slot.fqn,
                record.variant,
                record.counters,
                record.element_fields,
                record.replica_fields,
                shape=(rows, cols),
                global_step=global_step,
                codebook=codebook,
            )
            if piece is None:
                continue
            choice = plan_muon_piece(piece, search_shape=(rows, cols), codebook=codebook)
            assert slot.live_index is not None
            entries[(slot.group_index, slot.live_index)] = muon_entry(
                piece, choice.period, codebook, device=slot.tensor.device, encoding=choice.encoding
            )
        groups = adopted_groups(self.param_groups, records, keep=EXECUTION_OPTIONS)
        layouts, scope = slot_layouts(groups)
        positions = [(g, k) for g, group in enumerate(groups) for k in range(len(group["params"]))]
        states = [entries.get(position) for position in positions]
        native = export_muon_state_dict(
            groups,
            states,
            layouts,
            scope,
            codebook=codebook,
            global_step=global_step,
            deterministic=self._deterministic,
        )
        try:
            inner = self.stage_state_dict(self._with_identity_guard(native))
        except StateValidationError as exc:
            raise _fail(str(exc)) from None
        return StagedTransaction(self, kind=MUON_IMPORT_KIND, token=self._version, payload=inner)

    def portable_commit_import(self: _Host, staged: StagedTransaction) -> None:
        """Publish a staged import by the native load's swaps (``StaleTransactionError`` and no
        change for a foreign, consumed or stale one)."""
        inner = require_transaction(staged).claim(self, kind=MUON_IMPORT_KIND, current_token=self._version)
        assert isinstance(inner, StagedTransaction)
        self.commit_staged_state_dict(inner)

"""``GefenMuon``'s side of dense-shard checkpoints: :class:`gefen_contracts.DenseShardCodec`
with :class:`~gefen_contracts.DenseFieldRows` and :class:`~gefen_contracts.DenseShardSnapshot`.

Where a matrix's state lives decides how DCP stores its dense fields
(:mod:`gefen_core.muon_distributed`):

* plain and replicated matrices, and ``"exact"`` ``Shard(0)`` DTensors: the state describes
  the whole matrix (identical on every rank in exact mode), so the slot's ``parameter`` is a
  ``meta`` tensor of the global shape: DCP stores each field once and every rank reads it
  whole on load, whatever the new world size;
* ``"approx"`` ``Shard(0)`` DTensors: the state describes the local rows; the slot's
  ``parameter`` is the DTensor and DCP reshards the rows;
* ``"distributed"`` matrices keep state on their owner only; they make
  ``dense_shard_codec`` negative (their native ``state_dict`` is consolidated and loads under
  any world size, and portable state moves owners exactly).

Records: :mod:`gefen_core.transport_records` (common) and :mod:`gefen_core.muon_transport`
(variants, counters, the fields ``momentum`` and ``normuon_v``). On load each matrix is
re-blocked (:mod:`gefen_core.reblocking`: the memory-safe fallback period, no collective)
and one codebook is learned from the loaded momenta of the whole-matrix ``"exact"`` state
(identical on every rank, as the per-step agreement requires), or from every matrix when
there is none; then everything is validated and staged by the native staged load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from gefen_contracts import (
    FEATURE_DENSE_SHARD_CODEC,
    DenseShardLoad,
    DenseShardSlot,
    FeatureStatus,
    StagedTransaction,
    StateValidationError,
    require_transaction,
)
from gefen_contracts.torch_support import SealedLayout

from .compact_piece import CompactPiece, FrozenDenseShards, stateful_piece
from .distributed import local_tensor
from .muon_distributed import APPROX, DISTRIBUTED, EXACT
from .muon_native_state import SlotLayout, export_muon_state_dict, slot_layouts
from .muon_transport import EXECUTION_OPTIONS, check_incoming_muon, live_muon_piece, muon_entry, plan_muon_piece
from .ops import KernelDispatch
from .reblocking import learn_momentum_codebook
from .transport_records import check_dense_common, dense_common
from .transport_slots import (
    BoundLayoutHook,
    NamedSlot,
    adopted_groups,
    named_slots,
    naming_blockers,
    option_blockers,
    plain_options,
    require_feature,
    transport_options,
)

__all__ = ["MUON_LOAD_KIND", "GefenMuonDenseShard"]

#: The kind of the staged transaction ``prepare_dense_shard_load`` returns.
MUON_LOAD_KIND = "gefen.GefenMuon.dense_shard_load"
_WHO = "GefenMuon dense-shard state"

_Entry = tuple[NamedSlot, SlotLayout, str, dict[str, int], CompactPiece | None]


class _Host(Protocol):
    param_groups: Any
    state: Any
    _codebook: torch.Tensor | None
    _deterministic: bool
    _version: int
    _dispatch: KernelDispatch

    @property
    def global_step(self) -> int: ...

    def _bound_layout(self) -> SealedLayout | None: ...

    def _with_identity_guard(self, native: dict[str, Any]) -> dict[str, Any]: ...

    def _dense_shard_status(self) -> FeatureStatus: ...

    def _dense_entries(self) -> dict[str, _Entry]: ...

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction: ...

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None: ...


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"{_WHO}: {message}")


def _state_shape(layout: SlotLayout) -> tuple[int, int]:
    """The matrix (or rows) the slot's state describes."""
    rows = layout.rows
    return rows, int(layout.param.shape[1])


def _dcp_parameter(layout: SlotLayout) -> object:
    """What DCP takes the slot's geometry from (see the module docstring)."""
    if layout.mode == APPROX:
        return layout.param
    return torch.empty(tuple(int(d) for d in layout.param.shape), device="meta")


class GefenMuonDenseShard(BoundLayoutHook):
    """Mixin of ``GefenMuon``: the ``DenseShardCodec`` Protocol and its optional extensions."""

    def _dense_shard_status(self: _Host) -> FeatureStatus:
        """Whether ``dense_shard_codec`` is supported now, with the reasons when not (cheap)."""
        reasons: list[str] = []
        sealed = self._bound_layout()
        if sealed is None:
            reasons.extend(naming_blockers(self.param_groups))
        else:
            reasons.append(
                "a post_sharding layout (replicated copies or whole-parameter owners) is checkpointed as portable "
                "state (gefen_dcp.save_portable_dcp); the dense-shard codec covers DTensor (FSDP2) matrices"
            )
        if not reasons:
            try:
                layouts = slot_layouts(self.param_groups)[0]
            except Exception as exc:  # an invalid layout is reported by step(); here it only blocks the claim
                layouts = []
                reasons.append(f"the matrices' layout is invalid: {exc}")
            if any(layout.mode == DISTRIBUTED for layout in layouts):
                reasons.append(
                    "sharded_mode='distributed' keeps each matrix's state on its owner only; checkpoint it with the "
                    "native state_dict (consolidated, loads under any world size) or as portable state"
                )
        reasons.extend(option_blockers(self.param_groups, "dense-shard"))
        return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

    def _dense_entries(self: _Host) -> dict[str, _Entry]:
        named = named_slots(self.param_groups, self._bound_layout())
        layouts = slot_layouts(self.param_groups)[0]
        entries = {}
        for slot, layout in zip(named, layouts):
            variant, counters, piece = live_muon_piece(
                self.state.get(layout.param), _state_shape(layout), self._codebook
            )
            entries[slot.fqn] = (slot, layout, variant, counters, piece)
        return entries

    def dense_shard_common(self: _Host) -> dict[str, Any]:
        """``{"schema_version", "global_step", "deterministic"}`` (identical on every rank)."""
        require_feature(FEATURE_DENSE_SHARD_CODEC, self._dense_shard_status())
        return dense_common(self.global_step, self._deterministic)

    def dense_shard_slots(self: _Host) -> tuple[DenseShardSlot, ...]:
        """One slot per matrix in ``(group, slot)`` order (nothing is materialised)."""
        require_feature(FEATURE_DENSE_SHARD_CODEC, self._dense_shard_status())
        slots = []
        for fqn, (slot, layout, variant, counters, piece) in self._dense_entries().items():
            options = transport_options(self.param_groups[slot.group_index])
            fields = piece.fields if piece is not None else ()
            slots.append(DenseShardSlot(fqn, _dcp_parameter(layout), options, variant, counters, fields))
        return tuple(slots)

    def materialize_dense_field(self: _Host, fqn: str, field: str) -> torch.Tensor:
        """A fresh fp32 CPU copy of one field of ``fqn``'s state (``KeyError`` when absent)."""
        return stateful_piece(self._dense_entries()[fqn][4], f"matrix {fqn!r}", field).dense(field)

    def materialize_dense_field_rows(self: _Host, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of :meth:`materialize_dense_field`, decoding only those rows."""
        return stateful_piece(self._dense_entries()[fqn][4], f"matrix {fqn!r}", field).dense(field, start, stop)

    def dense_shard_snapshot(self: _Host) -> FrozenDenseShards:
        """A frozen host copy of the compact state serving the dense fields as they are now."""
        return FrozenDenseShards({fqn: e[4] for fqn, e in self._dense_entries().items() if e[4] is not None})

    def prepare_dense_shard_load(
        self: _Host, common: Mapping[str, Any], slots: Mapping[str, DenseShardLoad]
    ) -> StagedTransaction:
        """Re-block, re-encode and stage loaded dense fields for the live layout (no mutation,
        no collective). Raises :class:`~gefen_contracts.StateValidationError` naming the problem."""
        require_feature(FEATURE_DENSE_SHARD_CODEC, self._dense_shard_status())
        global_step = check_dense_common(common, self._deterministic, _WHO)
        live = self._dense_entries()
        if set(slots) != set(live):
            missing, extra = sorted(set(live) - set(slots)), sorted(set(slots) - set(live))
            raise _fail(
                f"the loaded matrices differ from the live ones (missing {missing[:5]}, unexpected {extra[:5]})"
            )
        records: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in self.param_groups]
        planned = []
        for fqn, (slot, layout, _, _, _) in live.items():
            load = slots[fqn]
            if type(load) is not DenseShardLoad or load.fqn != fqn:
                raise _fail(f"matrix {fqn!r}: expected a DenseShardLoad for it")
            records[slot.group_index].append((fqn, plain_options(load.options)))
            shape = _state_shape(layout)
            piece = check_incoming_muon(
                fqn, load.variant, load.counters, load.fields, {}, shape=shape, global_step=global_step
            )
            if piece is None:
                continue
            global_shape = (int(layout.param.shape[0]), int(layout.param.shape[1]))
            choice = plan_muon_piece(piece, search_shape=global_shape, codebook=None)
            planned.append((slot, layout, piece, choice.period))
        whole = [(p.momentum, period) for _, layout, p, period in planned if layout.mode == EXACT]
        sources = whole or [(p.momentum, period) for _, _, p, period in planned]
        codebook = learn_momentum_codebook(sources, self._dispatch, deterministic=self._deterministic)
        entries = {
            (slot.group_index, slot.live_index): muon_entry(
                piece, period, codebook, device=local_tensor(layout.param).device
            )
            for slot, layout, piece, period in planned
        }
        groups = adopted_groups(self.param_groups, records, keep=EXECUTION_OPTIONS)
        layouts, scope = slot_layouts(groups)
        positions = [(g, k) for g, group in enumerate(groups) for k in range(len(group["params"]))]
        native = export_muon_state_dict(
            groups,
            [entries.get(position) for position in positions],
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
        return StagedTransaction(self, kind=MUON_LOAD_KIND, token=self._version, payload=inner)

    def commit_dense_shard_load(self: _Host, staged: StagedTransaction) -> None:
        """Publish a staged load by the native load's swaps (``StaleTransactionError`` and no
        change for a foreign, consumed or stale one)."""
        inner = require_transaction(staged).claim(self, kind=MUON_LOAD_KIND, current_token=self._version)
        assert isinstance(inner, StagedTransaction)
        self.commit_staged_state_dict(inner)

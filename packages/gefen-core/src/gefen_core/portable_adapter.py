"""``Gefen``'s side of portable state: the :class:`gefen_contracts.protocols.PortableAdapter` Protocol.

An optimizer-agnostic driver (``gefen_portable``) runs the collectives, assembles and
projects fields by shard identity and digests everything; Gefen describes its local layout
and exports its compact state (codes, block scales, second moments: about one byte per
element, :mod:`gefen_core.gefen_exchange`) and re-encodes what it receives for its own
layout. What Gefen puts into a ``gefen.portable_state`` document:

* ``implementation``: ``"gefen.Gefen"``;
* ``policy``: ``{"schema_version": 2, "deterministic": bool}``; an import requires the
  target's ``deterministic`` to be the same, as native loads do (the reference adopted the
  source's flag silently);
* ``common``: ``{"global_step": int, "codebook": fp32[256] | None}``, identical on every
  member of the checkpoint group: a multi-member layout needs one codebook on all members
  (an explicit codebook scope, or the codebook of an imported document);
* per slot: the group's options (:func:`gefen_core.transport_slots.transport_options`)
  and the variant, counters and fields of :mod:`gefen_core.gefen_exchange`.

Layouts (:mod:`gefen_core.transport_slots`): the sealed ``post_sharding`` layout
(``REPLICATED`` and ``FLATTENED_ELEMENT_SHARD``), or before it the implicit one, an
ungrouped ``REPLICATED`` shard per named parameter, which a single process exports and
imports with a one-member checkpoint binding. DTensor (FSDP2) parameters use the
parameter-shaped native state instead (``gefen_dcp.GefenDCPState``).

Import: every target piece is re-blocked (:mod:`gefen_core.reblocking`) and re-encoded
with the document's codebook, so a piece whose blocks are the source's is restored bit for
bit; target groups adopt the options recorded for their parameters (they must agree within
a group), the global step and the codebook; the result is validated and staged by the
native staged load (nothing changes until :meth:`portable_commit_import`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from gefen_contracts import FEATURE_PORTABLE_STATE, FeatureStatus, StateValidationError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.identity import LogicalSlice
from gefen_contracts.torch_support import SealedLayout, as_imported
from gefen_contracts.transactions import StagedTransaction, require_transaction

from . import native_format as F
from .distributed import is_dtensor
from .gefen_exchange import (
    PRISTINE,
    check_incoming,
    complete_factors,
    live_piece,
    native_entry,
    own_blocks_entry,
    period_policy,
    plan_piece,
    slot_options,
)
from .native_records import native_state_dict
from .param_state import FACTORED, second_moment_variant
from .transport_records import checked_import_records, portable_common, portable_layout_of, portable_policy
from .transport_slots import (
    BoundLayoutHook,
    NamedSlot,
    adopted_groups,
    named_slots,
    naming_blockers,
    option_blockers,
    positional_state,
    require_feature,
    transport_options,
)

__all__ = ["IMPORT_KIND", "GefenPortableState", "live_name"]

#: The kind of the staged transaction ``portable_prepare_import`` returns.
IMPORT_KIND = "gefen.Gefen.portable_import"
_IMPLEMENTATION = "gefen.Gefen"
_WHO = "Gefen portable state"
_PORTABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD})


class _Host(Protocol):
    """What the mixin needs from the optimizer it is part of (``Gefen``)."""

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


def live_name(param_groups: Sequence[Mapping[str, Any]], slot: NamedSlot) -> str | None:
    names = param_groups[slot.group_index].get("param_names")
    if names is None or slot.live_index is None:
        return None
    return str(names[slot.live_index])


class GefenPortableState(BoundLayoutHook):
    """Mixin of ``Gefen``: the ``PortableAdapter`` Protocol (see the module docstring)."""

    def _portable_status(self: _Host) -> FeatureStatus:
        """Whether ``portable_state`` is supported now, with the reasons when not (cheap)."""
        reasons: list[str] = []
        sealed = self._bound_layout()
        if sealed is None:
            reasons.extend(naming_blockers(self.param_groups))
            dtensors = sum(1 for group in self.param_groups for p in group["params"] if is_dtensor(p))
            if dtensors:
                reasons.append(
                    f"{dtensors} parameter(s) are DTensor (FSDP2) shards, which the implicit replicated layout cannot "
                    "describe: checkpoint their parameter-shaped native state (gefen_dcp.GefenDCPState)"
                )
        else:
            others = sorted({s.layout.value for _, s in sealed.bindings} - {x.value for x in _PORTABLE_LAYOUTS})
            if others:
                reasons.append(f"Gefen's portable state covers replicated and flattened layouts, not {others}")
        reasons.extend(option_blockers(self.param_groups, "portable"))
        return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

    def portable_layout(self: _Host) -> PortableLayout:
        """The local target layout: the sealed one, or the implicit one (no state, no tensors)."""
        return portable_layout_of(self.param_groups, self._bound_layout(), _IMPLEMENTATION)

    def portable_export(self: _Host) -> PortableExport:
        """This member's state in compact form (codes, block scales, second moments): fresh CPU
        copies, nothing aliasing live state.

        ``NotSupportedError`` when ``portable_state`` is not supported now; no collective.
        """
        self._verify_layout("portable_export")
        require_feature(FEATURE_PORTABLE_STATE, self._portable_status())
        layout = self.portable_layout()
        exported = []
        for slot, slot_layout in zip(named_slots(self.param_groups, self._bound_layout()), layout.slots):
            options = transport_options(self.param_groups[slot.group_index])
            state = None if slot.tensor is None else self.state.get(slot.tensor)
            shape = () if slot.tensor is None else tuple(slot.tensor.shape)
            variant, counters, piece = live_piece(state, shape, self._codebook)
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
            where = f"parameter {slot.fqn!r}"
            plain, options = slot_options(record.options, where)
            records[slot.group_index].append((slot.fqn, plain))
            if slot.tensor is None:
                continue
            tensor = slot.tensor
            target = second_moment_variant(tensor.shape, options)
            assert slot.live_index is not None
            if record.block_fields:  # the piece is the fragment that exported it: keep its own blocks
                name = live_name(self.param_groups, slot)
                forced = period_policy(options).forces_period_one(name, tensor.dim())
                kept = own_blocks_entry(record, param=tensor, target=target, forced_one=forced, global_step=global_step)
                if kept is not None:
                    entries[(slot.group_index, slot.live_index)] = kept
                    continue
                record = as_imported(record, tuple(tensor.shape))
            shard = record.layout.shard
            extent = shard.extent
            offset = extent.flat_offset if type(extent) is LogicalSlice else 0
            piece = check_incoming(
                slot.fqn,
                record.variant,
                record.counters,
                record.element_fields,
                record.replica_fields,
                piece_shape=tuple(tensor.shape),
                flat_offset=offset,
                global_shape=shard.parameter.global_shape,
                global_step=global_step,
                codebook=codebook,
            )
            if piece is None:
                continue
            choice = plan_piece(
                piece,
                search_shape=tuple(tensor.shape),
                policy=period_policy(options),
                name=live_name(self.param_groups, slot),
                ndim=tensor.dim(),
                codebook=codebook,
            )
            factors = complete_factors(piece, *tensor.shape) if target == FACTORED else None
            entries[(slot.group_index, slot.live_index)] = native_entry(
                piece, choice.period, codebook, param=tensor, target=target, factors=factors, encoding=choice.encoding
            )
        groups = adopted_groups(self.param_groups, records)
        state = positional_state(groups, entries)
        record_fields = {
            "global_step": global_step,
            "codebook": codebook,
            "deterministic": self._deterministic,
        }
        native = native_state_dict(F.FORMAT, groups, state, record_fields)
        try:
            inner = self.stage_state_dict(self._with_identity_guard(native))
        except StateValidationError as exc:
            raise _fail(str(exc)) from None
        return StagedTransaction(self, kind=IMPORT_KIND, token=self._version, payload=inner)

    def portable_commit_import(self: _Host, staged: StagedTransaction) -> None:
        """Publish a staged import by the native load's swaps (``StaleTransactionError`` and no
        change for a foreign, consumed or stale one: the optimizer stepped or loaded since)."""
        inner = require_transaction(staged).claim(self, kind=IMPORT_KIND, current_token=self._version)
        assert isinstance(inner, StagedTransaction)
        self.commit_staged_state_dict(inner)

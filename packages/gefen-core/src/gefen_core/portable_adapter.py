"""The :class:`gefen_contracts.protocols.PortableAdapter` role of ``Gefen`` and ``GefenMuon``, written once.

An optimizer-agnostic driver (``gefen_portable``) runs the collectives, assembles and
projects fields by shard identity and digests everything; the optimizer describes its local
layout, exports its compact state and re-encodes what it receives for its own layout.
:class:`PortableRole` is that part for both optimizers: each owns one (``Gefen``'s
:data:`gefen_core.gefen.PORTABLE`, ``GefenMuon``'s :data:`gefen_core.muon.PORTABLE`) and its
four Protocol methods delegate to it. What differs between the two is data: the
implementation name, the layouts it covers, how one live state entry becomes an exchange
piece (:func:`gefen_core.gefen_exchange.live_piece`, :func:`gefen_core.muon_exchange.live_muon_piece`)
and how checked records become a native state dict
(:func:`gefen_core.gefen_exchange.native_from_records`,
:func:`gefen_core.muon_exchange.muon_native_from_records`).

What a ``gefen.portable_state`` document holds for either optimizer:

* ``implementation``: ``"gefen.Gefen"`` or ``"gefen.GefenMuon"``;
* ``policy``: ``{"schema_version": 2, "deterministic": bool}``; an import requires the
  target's ``deterministic`` to be the same, as native loads do (the reference adopted the
  source's flag silently);
* ``common``: ``{"global_step": int, "codebook": fp32[256] | None}``, identical on every
  member of the checkpoint group: a multi-member layout needs one codebook on all members
  (an explicit codebook scope, or the codebook of an imported document);
* per slot: the group's options (:func:`gefen_contracts.torch_support.option_records.recorded_options`)
  and the variant, counters and fields of :mod:`gefen_core.gefen_exchange` (about one byte
  per element) or :mod:`gefen_core.muon_exchange`.

Layouts (:mod:`gefen_contracts.torch_support.portable_slots`): the sealed ``post_sharding`` layout (Gefen:
``REPLICATED`` and ``FLATTENED_ELEMENT_SHARD``; GefenMuon: ``REPLICATED`` and
``WHOLE_PARAMETER_OWNER``, where the owner exports and imports the whole matrix and
non-owners hold nothing), or before it the implicit one, an ungrouped ``REPLICATED`` shard
per named parameter, which a single process exports and imports with a one-member checkpoint
binding. DTensor (FSDP2) parameters use the parameter-shaped native state instead
(``gefen_dcp.GefenDCPState``).

Import: every target piece is re-blocked (:mod:`gefen_core.reblocking`) and re-encoded with
the document's codebook, so a piece whose blocks are the source's is restored bit for bit
(GefenMuon's whole matrices always are); target groups adopt the options recorded for their
parameters (they must agree within a group), the global step and the codebook; the result is
validated and staged by the native staged load (nothing changes until
:meth:`PortableRole.commit_import`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import FEATURE_PORTABLE_STATE, FeatureStatus, StateValidationError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.naming import param_group_naming_blockers
from gefen_contracts.torch_support.option_records import option_blockers, recorded_options
from gefen_contracts.torch_support.portable_slots import NamedSlot, named_slots, portable_layout_of
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .distributed import is_dtensor
from .gefen_exchange import PRISTINE
from .identity import bound_layout, verify_layout
from .transport_records import check_common, check_policy, portable_common, portable_policy
from .transport_slots import require_feature

__all__ = ["PortableRole"]

#: Group keys that are not options (the rest travel with each slot).
_NOT_OPTIONS = frozenset({"params", "param_names"})

Pairs = list[tuple[NamedSlot, PortableSlotState]]


@dataclass(frozen=True, slots=True)
class PortableRole:
    """One optimizer class's portable adapter (see the module docstring); holds no state of its
    own, every method takes the optimizer (its ``param_groups``, ``state``, ``_codebook``,
    ``_deterministic``, ``_version``, ``global_step`` and staged native load)."""

    #: The ``implementation`` its documents name.
    implementation: str
    #: What its tensors are called in messages (``"parameter(s)"``, ``"matrix(es)"``).
    tensors: str
    #: The sealed layouts it covers.
    layouts: frozenset[ParameterLayout]
    #: ``(state entry or None, local shape, codebook) -> (variant, counters, piece or None)``.
    live_piece: Callable[[Any, tuple[int, ...], torch.Tensor | None], tuple[str, dict[str, int], Any]]
    #: ``(optimizer, global step, codebook, checked pairs) -> native state dict``.
    native_from_records: Callable[[Any, int, torch.Tensor | None, Pairs], dict[str, Any]]

    @property
    def _who(self) -> str:
        return f"{self.implementation.removeprefix('gefen.')} portable state"

    @property
    def _import_kind(self) -> str:
        return f"{self.implementation}.portable_import"

    def _fail(self, message: str) -> StateValidationError:
        return StateValidationError(f"{self._who}: {message}")

    def status(self, optimizer: Any) -> FeatureStatus:
        """Whether ``portable_state`` is supported now, with the reasons when not (cheap)."""
        reasons: list[str] = []
        sealed = bound_layout(optimizer)
        if sealed is None:
            reasons.extend(param_group_naming_blockers(optimizer.param_groups, optimizer="the optimizer"))
            dtensors = sum(1 for group in optimizer.param_groups for p in group["params"] if is_dtensor(p))
            if dtensors:
                reasons.append(
                    f"{dtensors} {self.tensors} are DTensor (FSDP2) shards, which the implicit replicated layout "
                    "cannot describe: checkpoint their parameter-shaped native state (gefen_dcp.GefenDCPState)"
                )
        else:
            others = sorted({s.layout.value for _, s in sealed.bindings} - {x.value for x in self.layouts})
            if others:
                covered = " and ".join(sorted(x.value for x in self.layouts))
                name = self.implementation.removeprefix("gefen.")
                reasons.append(f"{name}'s portable state covers the {covered} layouts, not {others}")
        reasons.extend(option_blockers(optimizer.param_groups, "portable", excluded=_NOT_OPTIONS))
        return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

    def layout(self, optimizer: Any) -> PortableLayout:
        """The local target layout: the sealed one, or the implicit one (no state, no tensors)."""
        return portable_layout_of(
            optimizer.param_groups, bound_layout(optimizer), self.implementation, optimizer="the optimizer"
        )

    def export(self, optimizer: Any) -> PortableExport:
        """This member's compact state: fresh CPU copies, nothing aliasing live state.
        ``NotSupportedError`` when ``portable_state`` is not supported now; no collective."""
        verify_layout(optimizer, "portable_export")
        require_feature(FEATURE_PORTABLE_STATE, self.status(optimizer))
        layout = self.layout(optimizer)
        exported = []
        for slot, slot_layout in zip(named_slots(optimizer.param_groups, bound_layout(optimizer)), layout.slots):
            options = recorded_options(optimizer.param_groups[slot.group_index], _NOT_OPTIONS)
            state = None if slot.tensor is None else optimizer.state.get(slot.tensor)
            shape = () if slot.tensor is None else tuple(slot.tensor.shape)
            variant, counters, piece = self.live_piece(state, shape, optimizer._codebook)
            if piece is None:
                exported.append(PortableSlotState(slot_layout, options, PRISTINE))
                continue
            exported.append(piece.portable_slot(slot_layout, options, variant, counters))
        policy = portable_policy(optimizer._deterministic)
        common = portable_common(optimizer.global_step, optimizer._codebook)
        return PortableExport(self.implementation, policy, common, layout.manifest, tuple(exported))

    def prepare_import(
        self,
        optimizer: Any,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        """Check the records (the sealed layout first: ``LayoutTamperedError``; the claim, the
        implementation, policy, common records, and slot records that follow :meth:`layout` one
        to one), re-encode them for the optimizer's layout and stage them by the native staged
        load. Raises :class:`~gefen_contracts.StateValidationError` naming the problem; mutates
        nothing."""
        verify_layout(optimizer, "portable_prepare_import")
        require_feature(FEATURE_PORTABLE_STATE, self.status(optimizer))
        if implementation != self.implementation:
            raise self._fail(f"the state was exported by {implementation!r}, not {self.implementation!r}")
        check_policy(policy, optimizer._deterministic, self._who)
        global_step, codebook = check_common(common, self._who)
        layout = self.layout(optimizer)
        named = named_slots(optimizer.param_groups, bound_layout(optimizer))
        incoming = tuple(slots)
        if len(incoming) != len(layout.slots):
            raise self._fail(f"expected {len(layout.slots)} slot records, got {len(incoming)}")
        pairs: Pairs = []
        for slot, record, expected in zip(named, incoming, layout.slots):
            if type(record) is not PortableSlotState or record.layout != expected:
                raise self._fail(
                    f"slot records must follow portable_layout() one to one; {expected.fqn!r} is out of place"
                )
            pairs.append((slot, record))
        native = self.native_from_records(optimizer, global_step, codebook, pairs)
        try:
            # the transport matched every slot by shard identity: the live guard is the right one
            inner = optimizer.stage_state_dict(optimizer._identity_binding.guard(native))
        except StateValidationError as exc:
            raise self._fail(str(exc)) from None
        return StagedTransaction(optimizer, kind=self._import_kind, token=optimizer._version, payload=inner)

    def commit_import(self, optimizer: Any, staged: StagedTransaction) -> None:
        """Publish a staged import by the native load's swaps (``StaleTransactionError`` and no
        change for a foreign, consumed or stale one: the optimizer stepped or loaded since)."""
        inner = require_transaction(staged).claim(optimizer, kind=self._import_kind, current_token=optimizer._version)
        assert isinstance(inner, StagedTransaction)
        optimizer.commit_staged_state_dict(inner)

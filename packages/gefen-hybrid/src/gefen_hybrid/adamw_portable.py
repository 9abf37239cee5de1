"""``ContractedAdamW``'s side of portable state (the ``PortableAdapter`` Protocol).

An optimizer-agnostic driver (``gefen_portable``) does the collectives, assembly, projection
and digests; ContractedAdamW describes its layout and its state in dense, topology-neutral
form and takes it back for its own layout:

* **layout**: after ``post_sharding``, the sealed manifest and one slot per bound local
  tensor (``REPLICATED`` or ``FLATTENED_ELEMENT_SHARD``). Before it, an *implicit* layout:
  one ungrouped ``REPLICATED`` shard per parameter, keyed by torch's parameter names, so a
  single-process optimizer exports and imports with a one-member checkpoint binding and no
  ``post_sharding``. Slot positions are ``(group, index)``; native names are torch's names.
* **policy** and **common**: ``{}`` (AdamW has no optimizer-wide policy or shared state;
  whatever changes the meaning of its state is a group option).
* **per slot**: the group options (as in :mod:`gefen_hybrid.adamw_records`), the variant
  (``"adamw"``, ``"adamw_amsgrad"`` or ``"uninitialized"``), the counter ``step`` and the
  element fields ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) as fp32 tensors shaped
  like the local piece. AdamW state is already dense and elementwise, so this is a copy:
  exact for float32, bfloat16 and float16 parameters (float64 and complex parameters make
  ``portable_state`` negative rather than round).

Import rebuilds a native state dict from the projected records (each target group takes its
options from its parameters' records; fields are converted to the parameter's dtype only when
that is exact) and stages it through the same validation as a native load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gefen_contracts import StateValidationError
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.naming import param_group_naming_blockers
from gefen_contracts.torch_support import SealedLayout
from gefen_contracts.torch_support.option_records import option_blockers, plain_options, recorded_options
from gefen_contracts.torch_support.portable_slots import portable_layout_of as slot_layout

from .adamw_contract import ADAMW_IMPLEMENTATION
from .adamw_records import (
    NOT_OPTIONS,
    AdamWRecord,
    dtype_blockers,
    incoming_entry,
    live_record,
    native_state_dict,
    to_dense_fp32,
)
from .tensor_checks import is_dtensor

__all__ = ["native_state_from_portable", "portable_blockers", "portable_export_of", "portable_layout_of"]


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"ContractedAdamW portable state: {message}")


def portable_blockers(param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None) -> tuple[str, ...]:
    """Why ``portable_state`` is not supported now (cheap: names, kinds, dtypes, option types)."""
    reasons: list[str] = []
    if sealed is None:
        reasons.extend(param_group_naming_blockers(param_groups, optimizer="ContractedAdamW"))
        dtensors = sum(1 for group in param_groups for p in group["params"] if is_dtensor(p))
        if dtensors:
            reasons.append(
                f"{dtensors} parameter(s) are DTensor (FSDP2) shards, which the implicit replicated layout cannot "
                "describe: checkpoint their parameter-shaped native state (gefen_dcp.GefenDCPState), or bind replicated "
                "or flattened local tensors with post_sharding"
            )
    reasons.extend(dtype_blockers(param_groups, "portable element"))
    reasons.extend(option_blockers(param_groups, "portable", excluded=NOT_OPTIONS))
    return tuple(reasons)


def portable_layout_of(param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None) -> PortableLayout:
    """The local target layout: the sealed one, or the implicit one (see the module docstring)."""
    return slot_layout(param_groups, sealed, ADAMW_IMPLEMENTATION, optimizer="ContractedAdamW")


def portable_export_of(
    param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], layout: PortableLayout
) -> PortableExport:
    """Every local slot's options, variant, counter and fp32 moments (fresh CPU copies)."""
    exported = []
    slots = iter(layout.slots)
    for group in param_groups:
        options = recorded_options(group, NOT_OPTIONS)
        for tensor in group["params"]:
            slot = next(slots)
            record = live_record(group, state.get(tensor), f"parameter {slot.fqn!r}")
            fields = {name: to_dense_fp32(value) for name, value in record.moments.items()}
            exported.append(PortableSlotState(slot, options, record.variant, record.counters, element_fields=fields))
    return PortableExport(ADAMW_IMPLEMENTATION, {}, {}, layout.manifest, tuple(exported))


def native_state_from_portable(
    param_groups: Sequence[Mapping[str, Any]],
    layout: PortableLayout,
    *,
    implementation: str,
    policy: Mapping[str, Any],
    common: Mapping[str, Any],
    slots: Sequence[PortableSlotState],
) -> dict[str, Any]:
    """Validate projected records for ``layout`` and rebuild them as a torch-style state dict
    keyed by the target's own positional ids (to be staged by ``stage_adamw_state``).

    Raises ``StateValidationError`` naming the problem; reads its inputs only.
    """
    if implementation != ADAMW_IMPLEMENTATION:
        raise _fail(f"the state was exported by {implementation!r}, not {ADAMW_IMPLEMENTATION!r}")
    if dict(policy) or dict(common):
        raise _fail(f"policy and common must be empty, got policy keys {sorted(policy)}, common keys {sorted(common)}")
    slots = tuple(slots)
    if len(slots) != len(layout.slots):
        raise _fail(f"expected {len(layout.slots)} slot records, got {len(slots)}")
    records: list[list[AdamWRecord]] = [[] for _ in param_groups]
    for incoming, expected in zip(slots, layout.slots):
        if type(incoming) is not PortableSlotState or incoming.layout != expected:
            raise _fail(f"slot records must follow portable_layout() one to one; {expected.fqn!r} is out of place")
        where = f"parameter {expected.fqn!r}"
        if incoming.replica_fields:
            raise _fail(f"{where}: AdamW keeps no replica fields, got {sorted(incoming.replica_fields)}")
        group_index, slot_index = expected.position
        tensor = param_groups[group_index]["params"][slot_index]
        try:
            entry = incoming_entry(
                tensor, incoming.variant, dict(incoming.counters), dict(incoming.element_fields), where
            )
        except StateValidationError as exc:
            raise _fail(str(exc)) from None
        records[group_index].append(AdamWRecord(expected.fqn, plain_options(incoming.options), entry))
    try:
        return native_state_dict(param_groups, records)
    except StateValidationError as exc:
        raise _fail(str(exc)) from None

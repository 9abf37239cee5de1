"""``ContractedAdamW``'s side of dense-shard checkpoints (the ``DenseShardCodec`` Protocol).

A driver such as ``gefen_dcp.GefenDCPState`` saves each parameter's dense fp32 fields at its
DTensor (FSDP2) shard's global offsets, lets DCP reshard them onto any later layout, and
hands the loaded local shards back. For AdamW that is a copy both ways:

* **common**: ``{}``;
* **per parameter** (keyed by torch's parameter name, or the canonical FQN once a
  replicated layout is bound with ``post_sharding``): the group options, the variant
  (``"adamw"``, ``"adamw_amsgrad"`` or ``"uninitialized"``), the counter ``step`` and the
  fields ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``), each a fresh fp32 CPU tensor
  shaped like the parameter's local shard;
* **load**: every field is checked (fp32, the local shard's shape, finite, exactly
  representable in the parameter's dtype) and placed like the parameter (a DTensor with the
  parameter's mesh and placements), then the whole state is staged through the same
  validation as a native load. Nothing is re-quantised, so a reshard is exact.

Flattened element shards have no DTensor geometry for DCP to reshard: while such shards are
bound, ``dense_shard_codec`` is negative and the reason points to portable state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_DENSE_SHARD_CODEC,
    DenseShardLoad,
    DenseShardSlot,
    NotSupportedError,
    ParameterLayout,
    StateValidationError,
)
from gefen_contracts.torch_support import SealedLayout

from .adamw_records import (
    TRANSPORTABLE_DTYPES,
    AdamWRecord,
    document_options,
    dtype_blockers,
    incoming_entry,
    live_record,
    native_state_dict,
    plain_options,
    primitive_option_blockers,
    to_dense_fp32,
)
from .adamw_slots import find_slot, named_slots, naming_blockers

__all__ = ["dense_blockers", "dense_slots_of", "materialize_field", "native_state_from_dense"]


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"ContractedAdamW dense-shard state: {message}")


def dense_blockers(
    param_groups: Sequence[Mapping[str, Any]],
    sealed: SealedLayout | None,
    local_layouts: frozenset[ParameterLayout],
) -> tuple[str, ...]:
    """Why ``dense_shard_codec`` is not supported now (cheap: names, layouts, dtypes, option types)."""
    reasons: list[str] = []
    if sealed is None:
        reasons.extend(naming_blockers(param_groups))
    elif ParameterLayout.FLATTENED_ELEMENT_SHARD in local_layouts:
        reasons.append(
            "flattened element shards have no DTensor geometry for DCP to reshard; save them as portable state "
            "(gefen_dcp.save_portable_dcp)"
        )
    reasons.extend(dtype_blockers(param_groups, "dense-shard"))
    reasons.extend(primitive_option_blockers(param_groups, "dense-shard"))
    return tuple(reasons)


def dense_slots_of(
    param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], sealed: SealedLayout | None
) -> tuple[DenseShardSlot, ...]:
    """One slot per live parameter, in (group, slot) order (nothing materialised)."""
    slots = []
    for slot in named_slots(param_groups, sealed):
        group = param_groups[slot.group_index]
        record = live_record(group, state.get(slot.tensor), f"parameter {slot.fqn!r}")
        slots.append(
            DenseShardSlot(
                slot.fqn,
                slot.tensor,
                document_options(group),
                record.variant,
                record.counters,
                tuple(record.moments),
            )
        )
    return tuple(slots)


def materialize_field(
    param_groups: Sequence[Mapping[str, Any]],
    state: Mapping[Any, Any],
    sealed: SealedLayout | None,
    fqn: str,
    field: str,
) -> torch.Tensor:
    """A fresh fp32 CPU copy of one moment of one parameter's local shard (``KeyError`` if absent;
    ``NotSupportedError`` for a flattened shard or a dtype the fp32 field would round)."""
    slot = find_slot(param_groups, sealed, fqn)
    if slot.shard is not None and slot.shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD:
        raise NotSupportedError(FEATURE_DENSE_SHARD_CODEC, (f"{fqn!r} is a flattened element shard",))
    if slot.tensor.dtype not in TRANSPORTABLE_DTYPES:
        raise NotSupportedError(FEATURE_DENSE_SHARD_CODEC, (f"{fqn!r} is {slot.tensor.dtype}",))
    record = live_record(param_groups[slot.group_index], state.get(slot.tensor), f"parameter {fqn!r}")
    if field not in record.moments:
        raise KeyError(f"parameter {fqn!r} ({record.variant}) has no dense field {field!r}")
    return to_dense_fp32(record.moments[field])


def native_state_from_dense(
    param_groups: Sequence[Mapping[str, Any]],
    sealed: SealedLayout | None,
    common: Mapping[str, Any],
    loads: Mapping[str, DenseShardLoad],
) -> dict[str, Any]:
    """Validate loaded dense shards for the live layout and rebuild them as a torch-style state
    dict keyed by the target's own positional ids (to be staged by ``stage_adamw_state``).

    Raises ``StateValidationError`` naming the problem; reads its inputs only.
    """
    if dict(common):
        raise _fail(f"common must be empty, got keys {sorted(common)}")
    slots = named_slots(param_groups, sealed)
    live = {slot.fqn for slot in slots}
    if set(loads) != live:
        missing, extra = sorted(live - set(loads)), sorted(set(loads) - live)
        raise _fail(f"the loaded parameters differ from the live ones (missing {missing[:5]}, unexpected {extra[:5]})")
    records: list[list[AdamWRecord]] = [[] for _ in param_groups]
    for slot in slots:
        load = loads[slot.fqn]
        where = f"parameter {slot.fqn!r}"
        if type(load) is not DenseShardLoad or load.fqn != slot.fqn:
            raise _fail(f"{where}: expected a DenseShardLoad for it")
        try:
            entry = incoming_entry(slot.tensor, load.variant, dict(load.counters), dict(load.fields), where)
        except StateValidationError as exc:
            raise _fail(str(exc)) from None
        records[slot.group_index].append(AdamWRecord(slot.fqn, plain_options(load.options), entry))
    try:
        return native_state_dict(param_groups, records)
    except StateValidationError as exc:
        raise _fail(str(exc)) from None

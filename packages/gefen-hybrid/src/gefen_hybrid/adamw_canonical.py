"""``ContractedAdamW``'s canonical local state: its part of a ``gefen.bound_state`` document.

The envelope is gefen-contracts' (``build_bound_state`` / ``parse_bound_state``, format
version 1); ContractedAdamW supplies:

* ``policy``: ``{}``. AdamW has no optimizer-wide policy; everything that changes the
  meaning of its state (``amsgrad``, ``maximize``, ``decoupled_weight_decay``) is a group
  option and travels with each parameter;
* ``common``: ``{}`` (no optimizer-common state);
* per parameter (keyed by exact FQN): its compatibility name (torch's ``param_names``
  entry, or ``""``), its shard, ``group_options`` (every group key except ``params``,
  ``param_names`` and the execution flags ``foreach``/``fused``/``capturable``/
  ``differentiable``, which are this process's choice; tuples such as ``betas`` become
  lists), ``variant`` (``"adamw"``, ``"adamw_amsgrad"``, or ``"uninitialized"`` for a
  parameter that has not stepped) and ``state``: ``step`` as an exact int and
  ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq`` as tight CPU tensors of the parameter's
  dtype and local shape.

Import routes by FQN into the target's own groups, so a regrouped or reordered target works;
each target group takes its hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``)
and extra keys from the document, which must agree for every parameter of the group. The
rebuilt native state dict is then validated and staged by :func:`stage_adamw_state`, exactly
like a native load: math flags must match, execution flags stay this process's, nothing
aliases the document.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.state_layout import match_variants
from gefen_contracts.torch_support import BoundParameter, SealedLayout, build_bound_state, parse_bound_state
from gefen_contracts.torch_support.option_records import recorded_options

from .adamw_contract import ADAMW_IMPLEMENTATION, ADAMW_STATE_LAYOUT
from .adamw_records import NO_STATE_VARIANT, NOT_OPTIONS, AdamWRecord, native_state_dict, step_count

__all__ = [
    "ADAMW_POLICY",
    "NO_STATE_VARIANT",
    "export_adamw_document",
    "native_state_from_document",
]

#: ContractedAdamW's policy record: empty (see the module docstring).
ADAMW_POLICY: dict[str, Any] = {}


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"ContractedAdamW canonical state: {message}")


def _variant_of(keys: Sequence[str], layout: Any, rank: int, where: str) -> str:
    if not keys:
        return NO_STATE_VARIANT
    matches = match_variants(ADAMW_STATE_LAYOUT, keys, parameter_layout=layout, parameter_rank=rank)
    if len(matches) != 1:
        raise _fail(f"{where}: state keys {sorted(keys)} match {len(matches)} declared variants (one required)")
    return matches[0].name


def _exported_state(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in entry.items():
        if key == "step":
            try:
                values[key] = step_count(value, where)
            except StateValidationError as exc:
                raise _fail(str(exc)) from None
        else:
            values[key] = value
    return values


def export_adamw_document(
    param_groups: Sequence[Mapping[str, Any]], state: Mapping[Any, Any], sealed: SealedLayout
) -> dict[str, Any]:
    """The ``gefen.bound_state`` document of a finalized ContractedAdamW (owned CPU copies)."""
    parameters: dict[str, BoundParameter] = {}
    for index, group in enumerate(param_groups):
        options = recorded_options(group, NOT_OPTIONS)
        names = sealed.compatibility_names(index)
        for slot, tensor in enumerate(group["params"]):
            shard = sealed.shard_identity(tensor)
            where = f"parameter {shard.fqn!r}"
            entry = state.get(tensor) or {}
            variant = _variant_of(list(entry), shard.layout, len(shard.parameter.global_shape), where)
            parameters[shard.fqn] = BoundParameter(names[slot], shard, options, variant, _exported_state(entry, where))
    return build_bound_state(
        implementation=ADAMW_IMPLEMENTATION,
        policy=ADAMW_POLICY,
        common={},
        manifest=sealed.manifest,
        parameters=parameters,
    )


def _native_entry(entry: BoundParameter, where: str) -> dict[str, Any]:
    native: dict[str, Any] = {}
    for key, value in entry.state.items():
        if key == "step":
            if type(value) is not int or value < 1:
                raise _fail(f"{where} state 'step' must be an int >= 1, got {value!r}")
            native[key] = torch.tensor(float(value), dtype=torch.float64)
        else:
            native[key] = value
    return native


def native_state_from_document(
    param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout, document: Mapping[str, Any]
) -> dict[str, Any]:
    """Validate ``document`` for this optimizer and rebuild it as a torch-style state dict keyed
    by the target's own positional ids (to be staged by ``stage_adamw_state``).

    Raises ``StateValidationError`` naming the problem; reads ``document`` only.
    """
    local = {shard.fqn: shard for tensor, shard in sealed.bindings if tensor is not None}
    parsed = parse_bound_state(
        document,
        implementation=ADAMW_IMPLEMENTATION,
        policy=ADAMW_POLICY,
        manifest=sealed.manifest,
        local_shards=local.values(),
    )
    if parsed.common:
        raise _fail(f"'common' must be empty, got keys {sorted(parsed.common)}")
    records: list[list[AdamWRecord]] = []
    for group in param_groups:
        slots = []
        for tensor in group["params"]:
            shard = sealed.shard_identity(tensor)
            entry = parsed.parameters[shard.fqn]
            where = f"parameter {shard.fqn!r}"
            variant = _variant_of(list(entry.state), shard.layout, len(shard.parameter.global_shape), where)
            if entry.variant != variant:
                raise _fail(f"{where} declares variant {entry.variant!r} but its state keys make it {variant!r}")
            native = _native_entry(entry, where) if entry.state else None
            slots.append(AdamWRecord(shard.fqn, dict(entry.group_options), native))
        records.append(slots)
    try:
        return native_state_dict(param_groups, records)
    except StateValidationError as exc:
        raise _fail(str(exc)) from None

"""Native ``state_dict()`` export and fully validated staged loading (format in :mod:`.native_format`).

:func:`export_state_dict` writes the format; :func:`stage_state_dict` validates a state dict
completely against the live optimizer and builds the new groups and state on the side
(copies, never views of the caller's tensors, except a tensor that *is* the live one:
:func:`~gefen_core.native_records.kept_live`), raising
:class:`~gefen_contracts.StateValidationError` naming the problem. Nothing of the optimizer
or of the caller's dict is touched; the optimizer publishes the result by swaps.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateGeometry
from gefen_contracts.torch_support import block_count, share_options, shared_tensor_options, with_rejoined_state

from . import native_format as F
from .distributed import local_tensor
from .native_records import (
    check_common_record,
    check_state_digest,
    check_top_level,
    exact_int,
    fail,
    kept_live,
    native_state_dict,
    parameter_slots,
    reconcile_record,
    stage_group,
)
from .param_groups import GROUP_OPTIONS, normalize_group_options, place
from .param_state import (
    AGE_KEYS,
    COUNTER_KEYS,
    FACTORED,
    INDICES,
    MAGNITUDE,
    PARAMETER_FIELDS,
    STEP,
    VARIANT_KEYS,
    blocked_codes,
    counter_value,
    make_counter,
    state_variant,
)
from .state_placement import expected_shapes, export_tensors, import_tensor, period_from_scales, state_dtype
from .step_plan import check_state

__all__ = ["StagedNativeState", "export_state_dict", "stage_native_group", "stage_state_dict"]

_DECLARED_PARAM_KEYS = frozenset().union(*VARIANT_KEYS.values())


@dataclass(frozen=True, slots=True)
class StagedNativeState:
    """A validated load: new group dicts (aligned with the live groups), new state, common values."""

    groups: tuple[dict[str, Any], ...]
    state: dict[torch.Tensor, dict[str, Any]]
    codebook: torch.Tensor | None
    global_step: int


def export_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
    *,
    codebook: torch.Tensor | None,
    global_step: int,
    deterministic: bool,
) -> dict[str, Any]:
    """The native state dict. Tensors are views of the live ones shaped like their parameter
    (DTensors for DTensor parameters, :mod:`.state_placement`); counters become ints."""
    entries: dict[int, dict[str, Any]] = {}
    pid = 0
    for group_index, group in enumerate(param_groups):
        names = group.get("param_names")
        for position, param in enumerate(group["params"]):
            live = state.get(param)
            if live:
                live = dict(live)
                # a parameter resized after its first step: the step's own refusal, naming it
                where = functools.partial(place, group_index, position, names[position] if names else None)
                check_state(live, local_tensor(param), where)  # (the place is formatted only for an error)
                entries[pid] = {key: counter_value(live[key]) for key in COUNTER_KEYS if key in live}
                entries[pid].update(export_tensors(param, live, str(state_variant(live))))
            pid += 1
    record = {"global_step": global_step, "codebook": codebook, "deterministic": deterministic}
    return native_state_dict(F.FORMAT, param_groups, entries, record)


def _stage_entry(
    entry: object,
    param: torch.Tensor,
    live_entry: Mapping[str, Any],
    where: str,
    global_step: int,
    capturable: bool,
) -> dict[str, Any] | None:
    if not isinstance(entry, Mapping):
        raise fail(f"{where} must be a dict, got {type(entry).__name__}")
    if not entry:
        return None
    for key in entry:
        if key not in _DECLARED_PARAM_KEYS:
            raise fail(f"{where} has undeclared key {key!r}")
    keys = frozenset(entry)
    variant = next((name for name, wanted in VARIANT_KEYS.items() if keys == wanted), None)
    if variant is None:
        closest = min(VARIANT_KEYS, key=lambda name: len(VARIANT_KEYS[name] ^ keys))
        missing = sorted(VARIANT_KEYS[closest] - keys)
        extra = sorted(keys - VARIANT_KEYS[closest])
        raise fail(
            f"{where} matches no state variant (closest {closest!r}): missing authoritative fields {missing}, "
            f"unexpected fields {extra}"
        )
    local = local_tensor(param)
    scales = entry[MAGNITUDE]
    if not isinstance(scales, torch.Tensor):
        raise fail(f"{where}[{MAGNITUDE!r}] must be a tensor, got {type(scales).__name__}")
    period = period_from_scales(param.shape, scales.shape)
    if period is None:
        raise fail(
            f"{where}[{MAGNITUDE!r}] has shape {tuple(scales.shape)}: no block period of a parameter of shape "
            f"{tuple(param.shape)} gives that many scales (saved for a parameter of another shape: groups or "
            "parameters in another order?)"
        )
    if local is not param and local.numel() % period:  # a whole tensor may end in a ragged block, a shard not
        hint = ""
        if param.dim() == 1 and local is not param:
            hint = (
                " (a sharded 1-D parameter keeps one block per element; a single-process state loads onto FSDP2 "
                "shards when it was trained with force_1d_period_one=True, FSDP2's rule, or through portable state)"
            )
        raise fail(f"{where}: blocks of {period} do not divide the parameter's {local.numel()} local elements{hint}")
    if variant == FACTORED and param.dim() != 2:
        raise fail(f"{where} holds a factored second moment but the parameter is {param.dim()}-D")
    step = exact_int(entry[STEP], f"{where}[{STEP!r}]", 1)
    if step > global_step:
        raise fail(f"{where}[{STEP!r}] {step} exceeds the global step {global_step}")
    age_key = AGE_KEYS[variant]
    age = exact_int(entry[age_key], f"{where}[{age_key!r}]", 1)
    if age > step:
        raise fail(f"{where}[{age_key!r}] {age} exceeds step {step}")
    device = local.device
    staged: dict[str, Any] = {STEP: make_counter(step, device, capturable)}
    global_shapes = expected_shapes(param.shape, period, variant)
    local_shapes = expected_shapes(local.shape, period, variant)
    per_block = (block_count(local.numel(), period), 1)  # the live shape of every per-block field
    for key, shape in local_shapes.items():
        dtype = state_dtype(key)
        tensor = import_tensor(
            entry[key],
            param,
            key,
            f"{where}[{key!r}]",
            dtype,
            global_shapes[key],
            shape,
            finite_nonnegative=dtype.is_floating_point,
        )
        live_shape: tuple[int, ...]
        if key == INDICES:
            live_shape = (block_count(local.numel(), period), period)
        else:
            live_shape = per_block if PARAMETER_FIELDS[key].geometry is StateGeometry.BLOCK else shape
        kept = kept_live(tensor, live_entry.get(key), live_shape, device)
        if kept is not None:
            staged[key] = kept
            continue
        # contiguous whatever the saved strides: the kernels take dense row-major state only
        copied = tensor.detach().to(device=device, copy=True, memory_format=torch.contiguous_format)
        staged[key] = blocked_codes(copied, period) if key == INDICES else copied.reshape(live_shape)
    staged[age_key] = make_counter(age, device, capturable)
    return staged


def stage_native_group(saved: object, live: Mapping[str, Any], index: int) -> tuple[dict[str, Any], list[object]]:
    """A new group dict for live group ``index`` from its saved copy, and its saved parameter ids
    (every option Gefen requires, validated; ``gefen inspect`` applies the same rule)."""
    new, ids = stage_group(saved, live, index, required=GROUP_OPTIONS, normalize=normalize_group_options)
    if new["period_one_substrings"] and "param_names" not in new:
        raise fail(f"param_groups[{index}] period_one_substrings needs named parameters")
    return new, ids


def stage_state_dict(
    state_dict: object,
    *,
    param_groups: Sequence[Mapping[str, Any]],
    live_state: Mapping[torch.Tensor, Mapping[str, Any]],
    deterministic: bool,
    capturable: bool,
) -> StagedNativeState:
    """Validate ``state_dict`` against the live optimizer and stage the new groups and state."""
    state_dict = with_rejoined_state(state_dict)  # a plain dcp.load split each entry's counters off
    groups = check_top_level(state_dict, F.FORMAT, len(param_groups))
    assert isinstance(state_dict, Mapping)
    common = reconcile_record(state_dict, F.FORMAT)
    global_step, codebook = check_common_record(common, deterministic=deterministic, optimizer="Gefen")
    new_groups: list[dict[str, Any]] = []
    saved_ids: list[list[object]] = []
    for index, (saved, live) in enumerate(zip(groups, param_groups)):
        new, ids = stage_native_group(saved, live, index)
        new_groups.append(new)
        saved_ids.append(ids)
    share_options(new_groups, shared_tensor_options(groups))
    by_id = parameter_slots(saved_ids, param_groups)
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        raise fail(f"'state' must be a mapping, got {type(saved_state).__name__}")
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    moving = False
    for pid, entry in saved_state.items():
        found = by_id.get(pid) if type(pid) in (int, str) else None
        if found is None:
            raise fail(f"state entry {pid!r} names no parameter of this optimizer")
        _, param, where = found
        staged = _stage_entry(entry, param, live_state.get(param, {}), where, global_step, capturable)
        if staged is not None:
            new_state[param] = staged
            moving = moving or bool(staged[MAGNITUDE].ne(0).any())
    if moving and codebook is None:
        raise fail("the checkpoint holds non-zero quantized momentum but no codebook")
    # last: a structurally wrong state dict gets the specific error above, not "digest mismatch"
    check_state_digest(F.FORMAT, saved_ids, saved_state, common, groups=groups)
    return StagedNativeState(tuple(new_groups), new_state, codebook, global_step)

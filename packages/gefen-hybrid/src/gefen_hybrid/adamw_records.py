"""``ContractedAdamW``'s state as transport records, shared by every state transport.

Canonical local documents and portable state both describe one
parameter's AdamW state the same way: the group options it was trained with, a variant
(``"adamw"``, ``"adamw_amsgrad"``, or ``"uninitialized"`` before its first step), the
``step`` counter as an exact int and the moments (``exp_avg``, ``exp_avg_sq``, plus
``max_exp_avg_sq`` with amsgrad). This module holds those rules and the one way back: a
torch-style native state dict, keyed by the target's own positional ids, that
:func:`~gefen_hybrid.adamw_state.stage_adamw_state` validates and stages exactly like a
native load.

Options are every group key except ``params``, ``param_names`` and the execution flags
(``foreach``, ``fused``, ``capturable``, ``differentiable``), which are this process's
choice; tuples such as ``betas`` become lists. On the way back each target group takes its
hyperparameters and extra keys from its parameters' records, which must agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.torch_support import dtensor_from_local
from gefen_contracts.torch_support.option_records import options_equal

from .adamw_state import EXECUTION_FLAGS
from .tensor_checks import is_dtensor, local_tensor

__all__ = [
    "AMSGRAD_VARIANT",
    "NOT_OPTIONS",
    "NO_STATE_VARIANT",
    "PLAIN_VARIANT",
    "TRANSPORTABLE_DTYPES",
    "AdamWRecord",
    "LiveRecord",
    "dtype_blockers",
    "incoming_entry",
    "live_record",
    "moment_names",
    "native_state_dict",
    "step_count",
    "to_dense_fp32",
    "variant_for",
]

#: The variant of a parameter without state (it has not stepped yet).
NO_STATE_VARIANT = "uninitialized"
#: The variant of a stepped parameter of a group with ``amsgrad=False``.
PLAIN_VARIANT = "adamw"
#: The variant of a stepped parameter of a group with ``amsgrad=True``.
AMSGRAD_VARIANT = "adamw_amsgrad"
#: Group keys that are not recorded options (the execution flags are the target's own choice).
NOT_OPTIONS = frozenset({"params", "param_names", *EXECUTION_FLAGS})


def moment_names(amsgrad: bool) -> tuple[str, ...]:
    """The moment keys of a stepped parameter, sorted."""
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")


def variant_for(amsgrad: bool) -> str:
    """The variant of a stepped parameter of a group with this ``amsgrad`` flag."""
    return AMSGRAD_VARIANT if amsgrad else PLAIN_VARIANT


def step_count(value: object, where: str) -> int:
    """A live ``step`` (tensor or number) as an exact int ``>= 1``."""
    number = float(value.item()) if isinstance(value, torch.Tensor) else float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or number < 1 or number != math.floor(number):
        raise StateValidationError(f"{where}: 'step' must be a whole number >= 1, got {number!r}")
    return int(number)


@dataclass(frozen=True, slots=True, eq=False)
class AdamWRecord:
    """One target slot's incoming state: where it comes from, its options and its native entry.

    ``entry`` is ``None`` for a parameter without state, else the per-parameter state dict
    (``step`` as a 0-dim float64 tensor, moments as tensors shaped and placed like the
    parameter) that :func:`~gefen_hybrid.adamw_state.stage_adamw_state` validates.
    """

    fqn: str
    options: dict[str, Any]
    entry: dict[str, Any] | None


def native_state_dict(
    param_groups: Sequence[Mapping[str, Any]], records: Sequence[Sequence[AdamWRecord]]
) -> dict[str, Any]:
    """A torch-style state dict for the live groups from one record per live slot.

    ``records[g][k]`` describes slot ``k`` of group ``g``. Each group takes its options from
    its records (they must agree: ``StateValidationError`` names the two parameters
    otherwise) and keeps this process's execution flags and parameter names; an empty group
    keeps its own options.
    """
    if len(records) != len(param_groups):
        raise StateValidationError(f"expected records for {len(param_groups)} param groups, got {len(records)}")
    groups: list[dict[str, Any]] = []
    state: dict[int, dict[str, Any]] = {}
    pid = 0
    for index, (group, slots) in enumerate(zip(param_groups, records)):
        if len(slots) != len(group["params"]):
            raise StateValidationError(
                f"param group {index} has {len(group['params'])} parameters but {len(slots)} records"
            )
        ids: list[int] = []
        first: AdamWRecord | None = None
        for record in slots:
            if first is None:
                first = record
            elif not options_equal(first.options, record.options):
                raise StateValidationError(
                    f"param group {index} holds {first.fqn!r} and {record.fqn!r}, whose recorded group options "
                    "differ; regroup the target so that each group's parameters share their options"
                )
            if record.entry is not None:
                state[pid] = record.entry
            ids.append(pid)
            pid += 1
        saved: dict[str, Any] = {key: group[key] for key in EXECUTION_FLAGS if key in group}
        if first is None:
            saved.update({k: v for k, v in group.items() if k not in ("params", "param_names")})
        else:
            saved.update(first.options)
        saved["params"] = ids
        if "param_names" in group:
            saved["param_names"] = list(group["param_names"])
        groups.append(saved)
    return {"state": state, "param_groups": groups}


# -- dense fp32 fields ------------------------------------------------------------------------------

#: Parameter dtypes whose AdamW state converts to fp32 fields and back without changing a bit.
TRANSPORTABLE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def dtype_blockers(param_groups: Sequence[Mapping[str, Any]], transport: str) -> tuple[str, ...]:
    """Why some parameter's state cannot travel as fp32 fields without rounding (float64, complex)."""
    odd = sorted(
        {
            str(p.dtype).removeprefix("torch.")
            for g in param_groups
            for p in g["params"]
            if p.dtype not in TRANSPORTABLE_DTYPES
        }
    )
    if not odd:
        return ()
    return (
        f"parameters of dtype {', '.join(odd)}: {transport} fields are float32, which would round or drop their "
        "AdamW state (float32, bfloat16 and float16 parameters travel exactly)",
    )


def to_dense_fp32(value: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous fp32 CPU copy of a (DTensor's local) state tensor."""
    local = local_tensor(value).detach()
    out = torch.empty(tuple(local.shape), dtype=torch.float32)
    out.copy_(local)
    return out


@dataclass(frozen=True, slots=True, eq=False)
class LiveRecord:
    """One live parameter's state as a transport describes it (moments are live tensors)."""

    variant: str
    counters: dict[str, int]
    moments: dict[str, torch.Tensor]


def live_record(group: Mapping[str, Any], entry: Mapping[str, Any] | None, where: str) -> LiveRecord:
    """The variant, ``step`` counter and moments of one live per-parameter state entry.

    ``StateValidationError`` when the keys are not exactly those of the group's variant.
    """
    if not entry:
        return LiveRecord(NO_STATE_VARIANT, {}, {})
    amsgrad = bool(group["amsgrad"])
    expected = {"step", *moment_names(amsgrad)}
    if set(entry) != expected:
        raise StateValidationError(
            f"{where}: state keys {sorted(map(str, entry))} are not those of AdamW with amsgrad={amsgrad} "
            f"({sorted(expected)})"
        )
    moments = {name: entry[name] for name in moment_names(amsgrad)}
    return LiveRecord(variant_for(amsgrad), {"step": step_count(entry["step"], where)}, moments)


def _as_parameter_state(field: object, parameter: torch.Tensor, where: str) -> torch.Tensor:
    """An incoming fp32 field as state of ``parameter``: its dtype, device and (DTensor) placement.

    The field must be a finite fp32 tensor shaped like the parameter's local piece, and
    exactly representable in the parameter's dtype (nothing is rounded silently).
    """
    local = local_tensor(parameter)
    if type(field) is not torch.Tensor or field.dtype is not torch.float32 or field.layout is not torch.strided:
        kind = field.dtype if isinstance(field, torch.Tensor) else type(field).__name__
        raise StateValidationError(f"{where} must be a strided float32 tensor, got {kind}")
    if tuple(field.shape) != tuple(local.shape):
        raise StateValidationError(f"{where} has shape {tuple(field.shape)}, the local piece is {tuple(local.shape)}")
    if not bool(torch.isfinite(field).all()):
        raise StateValidationError(f"{where} holds non-finite values")
    if local.dtype not in TRANSPORTABLE_DTYPES:
        raise StateValidationError(f"{where}: a {local.dtype} parameter cannot take float32 state exactly")
    value = field.to(device=local.device, dtype=local.dtype)
    if local.dtype is not torch.float32 and not torch.equal(value.to(torch.float32), field.to(local.device)):
        raise StateValidationError(
            f"{where} holds values that {local.dtype} cannot represent exactly (the state would be rounded)"
        )
    if is_dtensor(parameter):
        dtensor: Any = parameter
        value = dtensor_from_local(value, dtensor.device_mesh, dtensor.placements, dtensor.shape)
    return value


def incoming_entry(
    parameter: torch.Tensor,
    variant: str,
    counters: Mapping[str, int],
    fields: Mapping[str, object],
    where: str,
) -> dict[str, Any] | None:
    """The native state entry an incoming record describes (``None`` for no state).

    Checks the variant, the counters (exactly ``step``, an int ``>= 1``) and the fields
    (exactly the variant's moments, see :func:`_as_parameter_state`); whether the variant
    fits the target group's ``amsgrad`` flag is checked when the result is staged.
    """
    if variant == NO_STATE_VARIANT:
        if counters or fields:
            raise StateValidationError(f"{where}: an {NO_STATE_VARIANT!r} parameter has no counters or fields")
        return None
    if variant not in (PLAIN_VARIANT, AMSGRAD_VARIANT):
        known = [NO_STATE_VARIANT, PLAIN_VARIANT, AMSGRAD_VARIANT]
        raise StateValidationError(f"{where}: unknown variant {variant!r} (ContractedAdamW knows {known})")
    step = counters.get("step")
    if set(counters) != {"step"} or type(step) is not int or step < 1:
        raise StateValidationError(f"{where}: counters must be exactly {{'step': int >= 1}}, got {dict(counters)}")
    names = moment_names(variant == AMSGRAD_VARIANT)
    if sorted(fields) != list(names):
        raise StateValidationError(f"{where}: variant {variant!r} needs the fields {list(names)}, got {sorted(fields)}")
    entry: dict[str, Any] = {"step": torch.tensor(float(step), dtype=torch.float64)}
    for name in names:
        entry[name] = _as_parameter_state(fields[name], parameter, f"{where} field {name!r}")
    return entry

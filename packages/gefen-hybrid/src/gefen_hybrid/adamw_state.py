"""Complete validation of a torch-style AdamW state dict, staged on fresh containers.

``torch.optim.AdamW.load_state_dict`` is not fail-before-mutation (a missing ``step``
raises after groups were replaced) and silently casts state to the parameter's dtype and
device. Here every key, type, dtype, shape, placement, value range and option is checked
first; only then is new state built, on fresh tensors that alias neither the caller's dict
nor the live optimizer.

Options are split three ways:

* hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``) come from the checkpoint,
  as in torch, so a resumed run continues bit-exactly;
* math flags (``amsgrad``, ``maximize``, ``decoupled_weight_decay``) must equal the live
  ones: a checkpoint of a different algorithm is refused instead of silently adopted;
* execution flags (``foreach``, ``fused``, ``capturable``, ``differentiable``) are this
  process's choice and keep their live values (torch would switch to the saved ones).

Other group keys (for example an LR scheduler's ``initial_lr``) are taken from the
checkpoint, as torch does.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.torch_support import names_mismatch, share_options, shared_tensor_options

from .tensor_checks import is_dtensor, local_tensor, same_placement, tensor_kind

__all__ = [
    "EXECUTION_FLAGS",
    "HYPERPARAMETERS",
    "MATH_FLAGS",
    "StagedAdamWState",
    "runs_foreach",
    "stage_adamw_state",
    "tensor_rate_refusal",
]

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
MATH_FLAGS = ("amsgrad", "maximize", "decoupled_weight_decay")
EXECUTION_FLAGS = ("foreach", "fused", "capturable", "differentiable")
_REQUIRED_GROUP_KEYS = frozenset((*HYPERPARAMETERS, *MATH_FLAGS, *EXECUTION_FLAGS, "params"))
#: What torch's ``AdamW.__setstate__`` fills in for a group saved by an older torch (before 2.7
#: no ``decoupled_weight_decay``, before 1.13 no ``differentiable``/``fused``, earlier still no
#: ``capturable``, ``foreach`` or ``maximize``), so such a checkpoint loads as torch loads it.
_LEGACY_GROUP_DEFAULTS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
_MOMENTS = ("exp_avg", "exp_avg_sq")
_FLOAT_STEP_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True, slots=True, eq=False)
class StagedAdamWState:
    """New group dicts (one per live group, same order) and new per-parameter state."""

    groups: tuple[dict[str, Any], ...]
    state: dict[torch.Tensor, dict[str, torch.Tensor]]


def _fail(message: str) -> NoReturn:
    raise StateValidationError(f"ContractedAdamW state dict: {message}")


def stage_adamw_state(live_groups: Sequence[Mapping[str, Any]], state_dict: object) -> StagedAdamWState:
    """Validate ``state_dict`` against ``live_groups`` and build the state to publish.

    Raises :class:`~gefen_contracts.StateValidationError` naming the first problem; reads
    ``state_dict`` only and changes nothing.
    """
    if not isinstance(state_dict, Mapping):
        raise StateValidationError(f"ContractedAdamW state dict must be a mapping, got {type(state_dict).__name__}")
    keys = set(state_dict)
    if keys != {"state", "param_groups"}:
        _fail(f"top-level keys must be exactly 'state' and 'param_groups', got {sorted(map(str, keys))}")
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, (list, tuple)):
        _fail(f"'param_groups' must be a list, got {type(saved_groups).__name__}")
    if len(saved_groups) != len(live_groups):
        _fail(f"the checkpoint has {len(saved_groups)} param groups, this optimizer has {len(live_groups)}")
    by_id: dict[int | str, tuple[torch.Tensor, Mapping[str, Any], str]] = {}
    groups = []
    for index, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        groups.append(_stage_group(index, saved, live, by_id))
    share_options(groups, shared_tensor_options(saved_groups))
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        _fail(f"'state' must be a mapping, got {type(saved_state).__name__}")
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for pid, entry in saved_state.items():
        if type(pid) not in (int, str) or pid not in by_id:
            _fail(f"state entry {pid!r} names no parameter of the param groups")
        parameter, group, label = by_id[pid]
        staged = _stage_entry(entry, parameter, group, label)
        if staged is not None:
            state[parameter] = staged
    return StagedAdamWState(tuple(groups), state)


def _holds_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)
    )


def runs_foreach(group: Mapping[str, Any], lr: object) -> bool:
    """Whether torch's AdamW runs this group's multi-tensor path with ``lr``: ``foreach=True``,
    or neither flag set where torch defaults to it (CUDA parameters), unless ``lr`` is a tensor
    and ``capturable=False`` (then torch falls back to the single-tensor loop)."""
    if group["foreach"] is not None or group["fused"] is not None:
        return bool(group["foreach"])
    from torch.optim import optimizer as torch_optimizer  # looked up per call: its device rule

    _, foreach = torch_optimizer._default_to_fused_or_foreach(list(group["params"]), False, use_fused=False)
    return bool(foreach) and not (isinstance(lr, torch.Tensor) and not group["capturable"])


def tensor_rate_refusal(group: Mapping[str, Any], lr: object, betas: object) -> str | None:
    """Why torch's multi-tensor AdamW would refuse these rates for ``group`` (``None``: it takes them)."""
    if group["capturable"] or not runs_foreach(group, lr):
        return None
    tensors = [key for key, value in (("lr", lr), ("betas", betas)) if _holds_tensor(value)]
    if not tensors:
        return None
    return (
        f"{' and '.join(tensors)} as tensors, which torch's multi-tensor (foreach) AdamW takes only with "
        "capturable=True"
    )


def _stage_group(
    index: int,
    saved: object,
    live: Mapping[str, Any],
    by_id: dict[int | str, tuple[torch.Tensor, Mapping[str, Any], str]],
) -> dict[str, Any]:
    where = f"param group {index}"
    if not isinstance(saved, Mapping):
        _fail(f"{where} must be a mapping, got {type(saved).__name__}")
    saved = {**_LEGACY_GROUP_DEFAULTS, **saved}
    missing = sorted(_REQUIRED_GROUP_KEYS - set(saved))
    if missing:
        _fail(f"{where} lacks the keys {missing}")
    params = live["params"]
    ids = saved["params"]
    if not isinstance(ids, (list, tuple)) or any(type(i) not in (int, str) for i in ids):
        # ints from state_dict(); FQN strings from torch.distributed.checkpoint.state_dict's helpers
        _fail(f"{where} 'params' must be a list of int or str parameter ids (bool rejected)")
    if len(ids) != len(params):
        _fail(f"{where} has {len(ids)} parameters in the checkpoint and {len(params)} here")
    names = _check_names(where, saved, live, len(params))
    for position, (pid, parameter) in enumerate(zip(ids, params)):
        if pid in by_id:
            _fail(f"parameter id {pid} appears twice in 'param_groups'")
        label = repr(names[position]) if names is not None else f"id {pid}"
        by_id[pid] = (parameter, live, label)
    staged = {
        "lr": _number_or_tensor(saved["lr"], live["lr"], f"{where} option 'lr'", upper=None),
        "betas": _betas(saved["betas"], live["betas"], where),
        "eps": _number_or_tensor(saved["eps"], live["eps"], f"{where} option 'eps'", upper=None),
        "weight_decay": _number_or_tensor(
            saved["weight_decay"], live["weight_decay"], f"{where} option 'weight_decay'", upper=None
        ),
    }
    for flag in MATH_FLAGS:
        value = saved[flag]
        if type(value) is not bool:
            _fail(f"{where} option {flag!r} must be a bool, got {type(value).__name__}")
        if value != live[flag]:
            _fail(
                f"{where} option {flag!r} is {value} in the checkpoint but {live[flag]} here; "
                "a checkpoint of a different algorithm is refused"
            )
    for flag in EXECUTION_FLAGS:
        value = saved[flag]
        allowed = (bool, type(None)) if flag in ("foreach", "fused") else (bool,)
        if type(value) not in allowed:
            _fail(f"{where} option {flag!r} must be {' or '.join(t.__name__ for t in allowed)}, got {value!r}")
    # the execution flags stay this process's: a tensor rate from the checkpoint would load into
    # a group that preflight_step (and torch's foreach step) then refuses
    refusal = tensor_rate_refusal(live, staged["lr"], staged["betas"])
    if refusal is not None:
        _fail(
            f"{where}: the checkpoint holds {refusal}; build this ContractedAdamW with foreach=False or "
            "capturable=True to load it"
        )
    extras = {
        key: _copy_extra(value, f"{where} key {key!r}")
        for key, value in saved.items()
        if key not in _REQUIRED_GROUP_KEYS and key != "param_names"
    }
    if any(type(key) is not str for key in extras):
        _fail(f"{where} keys must be str")
    group: dict[str, Any] = {}
    for key in live:
        if key == "params":
            group[key] = params
        elif key == "param_names":
            group[key] = list(live[key])
        elif key in staged:
            group[key] = staged[key]
        elif key in MATH_FLAGS or key in EXECUTION_FLAGS:
            group[key] = live[key]
        elif key in extras:
            group[key] = extras[key]
    for key, value in extras.items():
        group.setdefault(key, value)
    if "param_names" not in group and names is not None:
        group["param_names"] = names  # as torch does, a named checkpoint names an unnamed optimizer
    return group


def _check_names(where: str, saved: Mapping[str, Any], live: Mapping[str, Any], count: int) -> list[str] | None:
    live_names = live.get("param_names")
    saved_names = saved.get("param_names")
    if saved_names is None:
        return list(live_names) if live_names is not None else None
    if not isinstance(saved_names, (list, tuple)) or any(type(n) is not str for n in saved_names):
        _fail(f"{where} 'param_names' must be a list of str")
    if len(saved_names) != count:
        _fail(f"{where} has {len(saved_names)} parameter names for {count} parameters")
    mismatch = names_mismatch(saved_names, live_names, saved.get("params")) if live_names is not None else None
    if mismatch is not None:
        _fail(f"{where} parameter names differ: {mismatch}")
    return list(saved_names)


def _number_or_tensor(value: object, live: object, where: str, *, upper: float | None) -> object:
    """The checkpoint's finite number ``>= 0`` (and ``< upper``), a real number or a 1-element
    floating tensor: in the live option's form where that is a tensor (its dtype and device, so
    a capturable or compiled step keeps its tensor rate), else as saved (a tensor copied), as
    torch's load adopts it. (A rate set mid-run as a tensor or a numpy scalar, as a trainer
    may, so resumes bit for bit with torch.)"""
    if not is_rate(value):
        shown = repr(value) if isinstance(value, torch.Tensor) else type(value).__name__
        _fail(f"{where} must be a number (bool rejected) or a 1-element floating tensor, got {shown}")
    number = float(value.detach().reshape(-1)[0].item()) if isinstance(value, torch.Tensor) else float(value)  # type: ignore[arg-type]
    _check_range(number, where, upper)
    if isinstance(live, torch.Tensor):
        if isinstance(value, torch.Tensor):
            return value.detach().to(device=live.device, dtype=live.dtype, copy=True).reshape(live.shape)
        return torch.full_like(live, number)
    # torch adopts the saved value as it is: a tensor or numpy rate computes in its own
    # precision, so converting it to a float changed the resumed run's last bits
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def is_rate(value: object) -> bool:
    """A real number (bool rejected) or a 1-element floating tensor: what a rate, beta, eps or
    weight decay may be, in a checkpoint (checked here) and in a live group (the preflight)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_range(number: float, where: str, upper: float | None) -> None:
    if not math.isfinite(number) or number < 0 or (upper is not None and number >= upper):
        bound = f"in [0, {upper})" if upper is not None else ">= 0"
        _fail(f"{where} must be a finite number {bound}, got {number!r}")


def _betas(value: object, live: Sequence[object], where: str) -> tuple[object, object]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        _fail(f"{where} option 'betas' must be a pair, got {value!r}")
    return (
        _number_or_tensor(value[0], live[0], f"{where} option 'betas'[0]", upper=1.0),
        _number_or_tensor(value[1], live[1], f"{where} option 'betas'[1]", upper=1.0),
    )


def _copy_extra(value: object, where: str, depth: int = 0) -> object:
    """Copy a group's extra value (primitives, containers, tensors) so nothing aliases the caller."""
    if depth > 32:
        _fail(f"{where} is nested too deeply")
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, numbers.Number):
        return value  # numbers are immutable (a numpy scalar a scheduler wrote included)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        items = [_copy_extra(v, where, depth + 1) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _copy_extra(v, where, depth + 1) for k, v in value.items()}
    _fail(f"{where} holds a {type(value).__name__}; only primitives, containers and tensors are allowed")


def _stage_entry(
    entry: object, parameter: torch.Tensor, group: Mapping[str, Any], label: str
) -> dict[str, torch.Tensor] | None:
    where = f"state of parameter {label}"
    if not isinstance(entry, Mapping):
        _fail(f"{where} must be a mapping, got {type(entry).__name__}")
    if not entry:
        return None  # torch writes an empty entry for a parameter that was only looked up
    expected = {"step", *_MOMENTS} | ({"max_exp_avg_sq"} if group["amsgrad"] else set())
    present = set(entry)
    if present != expected:
        missing = sorted(expected - present)
        extra = sorted(map(str, present - expected))
        _fail(f"{where} must hold exactly {sorted(expected)} (missing {missing}, unexpected {extra})")
    staged = {"step": _stage_step(entry["step"], parameter, group, f"{where} 'step'")}
    for key in sorted(expected - {"step"}):
        staged[key] = _stage_moment(entry[key], parameter, key, f"{where} {key!r}")
    return staged


def _scalar_dtype(group: Mapping[str, Any]) -> torch.dtype:
    # The dtype torch.optim.Adam gives a fresh ``step`` (see its _init_group).
    if group["fused"]:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _stage_step(value: object, parameter: torch.Tensor, group: Mapping[str, Any], where: str) -> torch.Tensor:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)  # an older torch saved a number, which its __setstate__ converts
    else:
        if not isinstance(value, torch.Tensor) or is_dtensor(value):
            _fail(f"{where} must be a 0-dim tensor or a number, got {type(value).__name__}")
        if value.dim() != 0 or value.dtype not in _FLOAT_STEP_DTYPES:
            _fail(f"{where} must be a 0-dim float32/float64 tensor, got {value.dtype}{tuple(value.shape)}")
        if value.is_meta:
            _fail(f"{where} is on the meta device: it holds no value to load")
        number = float(value.item())
    if not math.isfinite(number) or number < 1 or number != math.floor(number):
        _fail(f"{where} must be a whole number >= 1, got {number!r}")
    if group["fused"] or group["capturable"]:
        return torch.tensor(number, dtype=torch.float32, device=local_tensor(parameter).device)
    return torch.tensor(number, dtype=_scalar_dtype(group))


def _stage_moment(value: object, parameter: torch.Tensor, key: str, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        _fail(f"{where} must be a tensor, got {type(value).__name__}")
    if not same_placement(value, parameter):
        _fail(
            f"{where} is a {tensor_kind(value)} but the parameter is a {tensor_kind(parameter)}"
            " (DTensor state must use the parameter's mesh and placements)"
        )
    if value.dtype != parameter.dtype:
        _fail(f"{where} has dtype {value.dtype}, the parameter has {parameter.dtype} (no silent casts)")
    if tuple(value.shape) != tuple(parameter.shape):
        _fail(f"{where} has shape {tuple(value.shape)}, the parameter has {tuple(parameter.shape)}")
    local = local_tensor(value)
    live_local = local_tensor(parameter)
    if local.layout is not torch.strided or tuple(local.shape) != tuple(live_local.shape):
        _fail(f"{where} must be a dense tensor of local shape {tuple(live_local.shape)}")
    if local.is_meta:
        _fail(f"{where} is on the meta device: it holds no values to load")
    if not bool(torch.isfinite(local).all()):
        _fail(f"{where} holds non-finite values")
    if key != "exp_avg" and not local.is_complex() and bool((local < 0).any()):
        _fail(f"{where} holds negative values (a second moment is never negative)")
    with torch.no_grad():
        fresh = torch.empty_like(parameter, memory_format=torch.preserve_format)
        local_tensor(fresh).copy_(local)
    return fresh

"""Native ``state_dict()`` export and fully validated staged loading (format in :mod:`.native_format`).

:func:`export_state_dict` writes the format; :func:`stage_state_dict` validates a state dict
completely against the live optimizer and builds the new groups and state on the side
(copies, never views of the caller's tensors), raising
:class:`~gefen_contracts.StateValidationError` naming the problem. Nothing of the optimizer
or of the caller's dict is touched; the optimizer publishes the result by swaps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateValidationError

from . import native_format as F
from .codebook import validate_codebook
from .distributed import local_tensor
from .errors import GefenOptionError, GefenOptionTypeError
from .param_groups import GROUP_OPTIONS, normalize_group_options
from .param_state import (
    AGE_KEYS,
    COUNTER_KEYS,
    FACTORED,
    INDICES,
    MAGNITUDE,
    PERIOD,
    STEP,
    V_COL,
    V_ROW,
    VARIANT_KEYS,
    VMEAN,
    counter_value,
    make_counter,
)

__all__ = ["StagedNativeState", "export_state_dict", "stage_state_dict"]

_DECLARED_PARAM_KEYS = frozenset().union(*VARIANT_KEYS.values())


@dataclass(frozen=True, slots=True)
class StagedNativeState:
    """A validated load: new group dicts (aligned with the live groups), new state, common values."""

    groups: tuple[dict[str, Any], ...]
    state: dict[torch.Tensor, dict[str, Any]]
    codebook: torch.Tensor | None
    global_step: int


def _mirror(global_step: int, codebook: torch.Tensor | None, deterministic: bool, topology: object) -> dict[str, Any]:
    return {
        "format": F.FORMAT_NAME,
        "format_version": F.VERSION,
        "global_step": global_step,
        "codebook": codebook,
        "deterministic": deterministic,
        "topology": topology,
    }


def export_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
    *,
    codebook: torch.Tensor | None,
    global_step: int,
    deterministic: bool,
    topology: list[dict[str, object] | None] | None,
) -> dict[str, Any]:
    """The native state dict. Tensors are the live ones (as in torch); counters become ints."""
    saved_codebook = None if codebook is None else codebook.detach().clone()
    mirror = _mirror(global_step, saved_codebook, deterministic, topology)
    groups: list[dict[str, Any]] = []
    entries: dict[int, dict[str, Any]] = {}
    pid = 0
    for group in param_groups:
        ids = []
        for param in group["params"]:
            live = state.get(param)
            if live:
                entries[pid] = {
                    key: counter_value(value) if key in COUNTER_KEYS else value for key, value in live.items()
                }
            ids.append(pid)
            pid += 1
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = ids
        saved[F.GROUP_MIRROR] = dict(mirror)
        groups.append(saved)
    return {
        "state": entries,
        "param_groups": groups,
        F.FORMAT_VERSION: F.VERSION,
        F.GLOBAL_STEP: global_step,
        F.CODEBOOK: saved_codebook,
        F.DETERMINISTIC: deterministic,
        F.TOPOLOGY: topology,
    }


def _fail(message: str) -> StateValidationError:
    return StateValidationError(message)


def _exact_int(value: object, where: str, minimum: int) -> int:
    if type(value) is not int:
        raise _fail(f"{where} must be an int (bool rejected), got {type(value).__name__}")
    if value < minimum:
        raise _fail(f"{where} must be >= {minimum}, got {value}")
    return value


def _common_record(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Reconcile the top-level record and the per-group mirrors (both, either, never neither)."""
    present = [key for key in F.TOP_LEVEL_KEYS if key in sd]
    top: dict[str, Any] | None = None
    if present:
        if len(present) != len(F.TOP_LEVEL_KEYS):
            missing = sorted(set(F.TOP_LEVEL_KEYS) - set(present))
            raise _fail(f"state_dict has some Gefen top-level keys but lacks {missing}")
        if sd[F.FORMAT_VERSION] != F.VERSION or type(sd[F.FORMAT_VERSION]) is not int:
            raise _fail(f"state_dict {F.FORMAT_VERSION} must be {F.VERSION}, got {sd[F.FORMAT_VERSION]!r}")
        top = {
            "global_step": sd[F.GLOBAL_STEP],
            "codebook": sd[F.CODEBOOK],
            "deterministic": sd[F.DETERMINISTIC],
            "topology": sd[F.TOPOLOGY],
        }
    groups = sd["param_groups"]
    mirrors = [g.get(F.GROUP_MIRROR) if isinstance(g, Mapping) else None for g in groups]
    with_mirror = [m for m in mirrors if m is not None]
    if with_mirror and len(with_mirror) != len(mirrors):
        raise _fail(f"{F.GROUP_MIRROR} is present on only some parameter groups")
    records = [] if top is None else [("top level", top)]
    for index, mirror in enumerate(with_mirror):
        if not isinstance(mirror, Mapping) or set(mirror) != {
            "format",
            "format_version",
            "global_step",
            "codebook",
            "deterministic",
            "topology",
        }:
            raise _fail(f"param_groups[{index}][{F.GROUP_MIRROR!r}] has unexpected keys")
        if mirror["format"] != F.FORMAT_NAME or mirror["format_version"] != F.VERSION:
            raise _fail(
                f"param_groups[{index}] holds format {mirror['format']!r} version {mirror['format_version']!r}; "
                f"this library reads {F.FORMAT_NAME!r} version {F.VERSION}"
            )
        records.append((f"param_groups[{index}] mirror", dict(mirror)))
    if not records:
        raise _fail(
            "state_dict carries no Gefen metadata (neither top-level gefen_* keys nor group mirrors); "
            "it was not produced by Gefen.state_dict()"
        )
    first_where, first = records[0]
    for where, other in records[1:]:
        for key in ("global_step", "deterministic", "topology"):
            if other[key] != first[key] or type(other[key]) is not type(first[key]):
                raise _fail(f"{where} and {first_where} disagree on {key}")
        a, b = first["codebook"], other["codebook"]
        if (a is None) != (b is None) or (a is not None and not (isinstance(b, torch.Tensor) and _same_tensor(a, b))):
            raise _fail(f"{where} and {first_where} disagree on the codebook")
    return first


def _same_tensor(a: object, b: torch.Tensor) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.detach().cpu(), b.detach().cpu())
    )


def _check_tensor(
    value: object, where: str, dtype: torch.dtype, shape: tuple[int, ...], *, finite_nonnegative: bool
) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
        raise _fail(f"{where} must be a plain tensor, got {type(value).__name__}")
    if value.layout is not torch.strided:
        raise _fail(f"{where} must be a dense tensor")
    if value.dtype != dtype:
        raise _fail(f"{where} must be {dtype}, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise _fail(f"{where} must have shape {shape}, got {tuple(value.shape)}")
    if finite_nonnegative and value.numel():
        if not bool(torch.isfinite(value).all()):
            raise _fail(f"{where} must be finite")
        if bool((value < 0).any()):
            raise _fail(f"{where} must be >= 0")
    return value


def _stage_entry(
    entry: object, param: torch.Tensor, where: str, global_step: int, capturable: bool
) -> dict[str, Any] | None:
    if not isinstance(entry, Mapping):
        raise _fail(f"{where} must be a dict, got {type(entry).__name__}")
    if not entry:
        return None
    for key in entry:
        if key not in _DECLARED_PARAM_KEYS:
            raise _fail(f"{where} has undeclared key {key!r}")
    keys = frozenset(entry)
    variant = next((name for name, wanted in VARIANT_KEYS.items() if keys == wanted), None)
    if variant is None:
        closest = min(VARIANT_KEYS, key=lambda name: len(VARIANT_KEYS[name] ^ keys))
        missing = sorted(VARIANT_KEYS[closest] - keys)
        extra = sorted(keys - VARIANT_KEYS[closest])
        raise _fail(
            f"{where} matches no state variant (closest {closest!r}): missing authoritative fields {missing}, "
            f"unexpected fields {extra}"
        )
    local = local_tensor(param)
    numel = local.numel()
    period = _exact_int(entry[PERIOD], f"{where}[{PERIOD!r}]", 1)
    if numel % period:
        raise _fail(f"{where}[{PERIOD!r}] {period} does not divide the parameter's {numel} local elements")
    blocks = numel // period
    step = _exact_int(entry[STEP], f"{where}[{STEP!r}]", 1)
    if step > global_step:
        raise _fail(f"{where}[{STEP!r}] {step} exceeds the global step {global_step}")
    age_key = AGE_KEYS[variant]
    age = _exact_int(entry[age_key], f"{where}[{age_key!r}]", 1)
    if age > step:
        raise _fail(f"{where}[{age_key!r}] {age} exceeds step {step}")
    device = local.device
    staged: dict[str, Any] = {PERIOD: period, STEP: make_counter(step, device, capturable)}
    tensors = {
        INDICES: _check_tensor(
            entry[INDICES], f"{where}[{INDICES!r}]", torch.uint8, (blocks, period), finite_nonnegative=False
        ),
        MAGNITUDE: _check_tensor(
            entry[MAGNITUDE], f"{where}[{MAGNITUDE!r}]", torch.float32, (blocks, 1), finite_nonnegative=True
        ),
    }
    if variant == FACTORED:
        if param.dim() != 2:
            raise _fail(f"{where} holds a factored second moment but the parameter is {param.dim()}-D")
        rows, cols = local.shape
        tensors[V_ROW] = _check_tensor(
            entry[V_ROW], f"{where}[{V_ROW!r}]", torch.float32, (rows,), finite_nonnegative=True
        )
        tensors[V_COL] = _check_tensor(
            entry[V_COL], f"{where}[{V_COL!r}]", torch.float32, (cols,), finite_nonnegative=True
        )
    else:
        tensors[VMEAN] = _check_tensor(
            entry[VMEAN], f"{where}[{VMEAN!r}]", torch.float32, (blocks, 1), finite_nonnegative=True
        )
    for key, tensor in tensors.items():
        staged[key] = tensor.detach().to(device=device, copy=True)
    staged[age_key] = make_counter(age, device, capturable)
    return staged


def _stage_group(saved: object, live: Mapping[str, Any], index: int) -> tuple[dict[str, Any], list[object]]:
    if not isinstance(saved, Mapping):
        raise _fail(f"param_groups[{index}] must be a dict, got {type(saved).__name__}")
    ids = saved.get("params")
    count = len(live["params"])
    if not isinstance(ids, list) or len(ids) != count:
        raise _fail(f"param_groups[{index}] must list exactly {count} parameter ids (a parameter group changed)")
    for pid in ids:
        if type(pid) not in (int, str):
            raise _fail(f"param_groups[{index}] parameter ids must be ints or strings, got {type(pid).__name__}")
    missing = [name for name in GROUP_OPTIONS if name not in saved]
    if missing:
        raise _fail(f"param_groups[{index}] lacks options {missing}")
    try:
        options = normalize_group_options(saved, index)
    except (GefenOptionError, GefenOptionTypeError) as exc:
        raise _fail(f"invalid hyperparameter in the checkpoint: {exc}") from None
    new = {key: value for key, value in saved.items() if key not in ("params", F.GROUP_MIRROR)}
    new.update(options)
    if isinstance(new.get("lr"), torch.Tensor):
        new["lr"] = new["lr"].detach().clone()
    live_names = live.get("param_names")
    if live_names is not None:
        if "param_names" in saved and list(saved["param_names"]) != list(live_names):
            raise _fail(f"param_groups[{index}] param_names differ from the live parameter names")
        new["param_names"] = live_names
    elif "param_names" in saved:
        raise _fail(f"param_groups[{index}] names its parameters but the live group is unnamed")
    if new["period_one_substrings"] and "param_names" not in new:
        raise _fail(f"param_groups[{index}] period_one_substrings needs named parameters")
    new["params"] = live["params"]
    return new, ids


def stage_state_dict(
    state_dict: object,
    *,
    param_groups: Sequence[Mapping[str, Any]],
    deterministic: bool,
    capturable: bool,
    topology: list[dict[str, object] | None] | None,
) -> StagedNativeState:
    """Validate ``state_dict`` against the live optimizer and stage the new groups and state."""
    if not isinstance(state_dict, Mapping):
        raise _fail(f"a state dict must be a mapping, got {type(state_dict).__name__}")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise _fail(f"state_dict lacks {key!r}")
    unknown = set(state_dict) - {"state", "param_groups", *F.TOP_LEVEL_KEYS}
    if unknown:
        raise _fail(f"state_dict has unknown top-level keys {sorted(map(str, unknown))}")
    groups = state_dict["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(param_groups):
        count = len(groups) if isinstance(groups, list) else "no"
        raise _fail(f"state_dict has {count} parameter groups, the optimizer has {len(param_groups)}")
    common = _common_record(state_dict)
    global_step = _exact_int(common["global_step"], "global_step", 0)
    if type(common["deterministic"]) is not bool:
        raise _fail("the checkpoint's deterministic policy must be a bool")
    if common["deterministic"] != deterministic:
        raise _fail(
            f"the checkpoint was produced with deterministic={common['deterministic']} but this optimizer has "
            f"deterministic={deterministic}; construct the optimizer with the checkpoint's policy"
        )
    if common["topology"] != topology:
        raise _fail(
            "the checkpoint's DTensor topology (mesh size, coordinate, placements, shapes) differs from the live one; "
            "rank-local Gefen state loads only into the same topology"
        )
    codebook = common["codebook"]
    if codebook is not None:
        codebook = validate_codebook(codebook, "codebook").clone()
    new_groups: list[dict[str, Any]] = []
    by_id: dict[object, tuple[torch.Tensor, str]] = {}
    for index, (saved, live) in enumerate(zip(groups, param_groups)):
        new, ids = _stage_group(saved, live, index)
        new_groups.append(new)
        for position, (pid, param) in enumerate(zip(ids, live["params"])):
            if pid in by_id:
                raise _fail(f"parameter id {pid!r} appears twice")
            by_id[pid] = (param, f"state[{pid!r}] (param_groups[{index}] position {position})")
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        raise _fail(f"'state' must be a mapping, got {type(saved_state).__name__}")
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    moving = False
    for pid, entry in saved_state.items():
        found = by_id.get(pid) if type(pid) in (int, str) else None
        if found is None:
            raise _fail(f"state entry {pid!r} names no parameter of this optimizer")
        param, where = found
        staged = _stage_entry(entry, param, where, global_step, capturable)
        if staged is not None:
            new_state[param] = staged
            moving = moving or bool(staged[MAGNITUDE].ne(0).any())
    if moving and codebook is None:
        raise _fail("the checkpoint holds non-zero quantized momentum but no codebook")
    return StagedNativeState(tuple(new_groups), new_state, codebook, global_step)

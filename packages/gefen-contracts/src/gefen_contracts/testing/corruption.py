"""Corruption classes applied to native optimizer state dicts (for atomic-load checks).

A corruption takes a deep copy of a state dict and returns a corrupted copy, or ``None``
when the class does not apply to that state dict. Torch-style state dicts (``{"state",
"param_groups"}``) are found anywhere in the tree, so a composite's nested halves are
corrupted one at a time (the result names the half, e.g. ``wrong_shape@backup``).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CORRUPTIONS", "Corruption", "corrupted_variants", "hostile_object"]

StateDict = dict[str, Any]


@dataclass(frozen=True)
class Corruption:
    name: str
    apply: Callable[[StateDict], bool]
    """Mutates a torch-style state dict in place; returns False when not applicable."""


def _param_states(sd: StateDict) -> list[tuple[Any, dict[str, Any]]]:
    state = sd.get("state")
    if not isinstance(state, dict):
        return []
    return [(k, v) for k, v in state.items() if isinstance(v, dict) and v]


def _tensor_entries(sd: StateDict, predicate: Callable[[torch.Tensor], bool]) -> Iterator[tuple[dict[str, Any], str]]:
    for _, entry in _param_states(sd):
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.numel() > 0 and predicate(value):
                yield entry, key


def _prefer_large(sd: StateDict, predicate: Callable[[torch.Tensor], bool]) -> tuple[dict[str, Any], str] | None:
    candidates = list(_tensor_entries(sd, predicate))
    if not candidates:
        return None
    return max(candidates, key=lambda pair: pair[0][pair[1]].numel())


def _entry(sd: StateDict, last: bool) -> dict[str, Any] | None:
    """The first parameter's state entry, or (``last``) the last one when there are several."""
    states = _param_states(sd)
    if last:
        return states[-1][1] if len(states) > 1 else None
    return states[0][1] if states else None


def _missing_key(sd: StateDict, last: bool = False) -> bool:
    entry = _entry(sd, last)
    if entry is None:
        return False
    tensor_keys = [k for k, v in entry.items() if isinstance(v, torch.Tensor)]
    key = tensor_keys[0] if tensor_keys else next(iter(entry))
    del entry[key]
    return True


def _extra_key(sd: StateDict, last: bool = False) -> bool:
    entry = _entry(sd, last)
    if entry is None:
        return False
    entry["gefen_kit_undeclared_key"] = torch.zeros(3)
    return True


def _wrong_shape(sd: StateDict) -> bool:
    found = _prefer_large(sd, lambda t: t.dim() >= 1)
    if found is None:
        return False
    entry, key = found
    value = entry[key]
    entry[key] = torch.cat([value.reshape(-1), value.reshape(-1)[:1]]).reshape(-1, 1)
    return True


def _other_shape(value: torch.Tensor) -> tuple[int, ...]:
    """A shape of ``value``'s element count other than its own (its dimensions reversed, or
    all of them in one column or one row)."""
    shape = tuple(value.shape)
    for other in (shape[::-1], (value.numel(), 1), (1, value.numel())):
        if other != shape:
            return other
    raise AssertionError("unreachable: (n, 1) and (1, n) cannot both be the shape")


def _transposed(sd: StateDict) -> bool:
    # the same elements in another shape: a loader that checks only the count (and reshapes) accepts it
    found = _prefer_large(sd, lambda t: t.dim() >= 1)
    if found is None:
        return False
    entry, key = found
    entry[key] = entry[key].reshape(_other_shape(entry[key])).clone()
    return True


def _wrong_dtype(sd: StateDict, last: bool = False) -> bool:
    if last:
        entry = _entry(sd, last)
        sizes = {k: v.numel() for k, v in (entry or {}).items() if isinstance(v, torch.Tensor) and v.numel()}
        if entry is None or not sizes:
            return False
        found: tuple[dict[str, Any], str] | None = (entry, max(sizes, key=sizes.__getitem__))
    else:
        found = _prefer_large(sd, lambda t: True)
    if found is None:
        return False
    entry, key = found
    value = entry[key]
    entry[key] = value.to(torch.int32) if value.is_floating_point() else value.to(torch.float32)
    return True


def _non_finite(sd: StateDict) -> bool:
    # an infinity here, a NaN in last_entry_non_finite: a loader that tests only one of them is seen
    found = _prefer_large(sd, lambda t: t.is_floating_point())
    if found is None:
        return False
    entry, key = found
    value = entry[key].clone()
    value.reshape(-1)[0] = math.inf
    entry[key] = value
    return True


def _wrong_parameter_count(sd: StateDict) -> bool:
    groups = sd.get("param_groups")
    if not isinstance(groups, list):
        return False
    for group in reversed(groups):
        params = group.get("params") if isinstance(group, dict) else None
        if isinstance(params, list) and params:
            dropped = params.pop()
            names = group.get("param_names")
            if isinstance(names, list) and names:
                names.pop()
            state = sd.get("state")
            if isinstance(state, dict):
                state.pop(dropped, None)
            return True
    return False


def _extra_param_group(sd: StateDict) -> bool:
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or not groups or not isinstance(groups[-1], dict):
        return False
    ids = [i for g in groups if isinstance(g, dict) for i in g.get("params", []) if type(i) is int]
    start = (max(ids) + 1) if ids else 1000
    clone = copy.deepcopy(groups[-1])
    count = len(clone.get("params", [])) or 1
    clone["params"] = list(range(start, start + count))
    if isinstance(clone.get("param_names"), list):
        clone["param_names"] = [f"gefen_kit_extra_{i}" for i in range(count)]
    groups.append(clone)
    return True


def _missing_param_group(sd: StateDict) -> bool:
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or not groups:
        return False
    removed = groups.pop()
    state = sd.get("state")
    if isinstance(state, dict) and isinstance(removed, dict):
        for pid in removed.get("params", []):
            state.pop(pid, None)
    return True


def _bool_for_int(sd: StateDict) -> bool:
    for _, entry in _param_states(sd):
        for key, value in entry.items():
            if type(value) is int:
                entry[key] = True
                return True
    for group in sd.get("param_groups", []):
        if isinstance(group, dict):
            params = group.get("params")
            if isinstance(params, list) and params and type(params[0]) is int:
                params[0] = True
                return True
    return False


def _last_entry_non_finite(sd: StateDict) -> bool:
    # the classes without last_ land on the first or the largest entry, before a loader that
    # validates and writes one entry at a time has written anything: these are seen only after
    entry = _entry(sd, last=True)
    floats = [
        k for k, v in (entry or {}).items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()
    ]
    if entry is None or not floats:
        return False
    key = max(floats, key=lambda k: entry[k].numel())
    value = entry[key].clone()
    value.reshape(-1)[-1] = math.nan
    entry[key] = value
    return True


def _last_entry_wrong_shape(sd: StateDict) -> bool:
    # like last_entry_non_finite: a loader that checks shapes entry by entry as it writes
    entry = _entry(sd, last=True)
    shaped = [k for k, v in (entry or {}).items() if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.numel()]
    if entry is None or not shaped:
        return False
    key = max(shaped, key=lambda k: entry[k].numel())
    entry[key] = torch.cat([entry[key].reshape(-1), entry[key].reshape(-1)[:1]])
    return True


def _group_float_option(sd: StateDict, *, last: bool = False) -> tuple[dict[str, Any], str] | None:
    groups = sd.get("param_groups", [])
    for group in reversed(groups) if last and isinstance(groups, list) else groups:
        if isinstance(group, dict):
            for key, value in group.items():
                if type(value) is float and math.isfinite(value):
                    return group, key
    return None


def _non_finite_option(sd: StateDict) -> bool:
    found = _group_float_option(sd)
    if found is None:
        return False
    found[0][found[1]] = math.nan
    return True


def _non_finite_other_option(sd: StateDict) -> bool:
    # a NaN in the first group's second float option (torch's eps or momentum), not its first
    # (lr, which non_finite_option corrupts): a loader that checks lr alone is seen (a NaN, as
    # an option may take an infinity to mean "no limit"; not the last one, which may be a
    # scheduler's initial_lr, not the optimizer's)
    groups = sd.get("param_groups")
    group = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    floats = [key for key, value in (group or {}).items() if type(value) is float and math.isfinite(value)]
    if group is None or len(floats) < 2:
        return False
    group[floats[1]] = math.nan
    return True


def _str_in_tuple_option(sd: StateDict) -> bool:
    # a float tuple option (torch's betas) with its first element as text
    for group in sd.get("param_groups", []):
        for key, value in group.items() if isinstance(group, dict) else ():
            if type(value) is tuple and value and all(type(item) is float for item in value):
                group[key] = (repr(value[0]), *value[1:])
                return True
    return False


def _last_group_non_finite_option(sd: StateDict) -> bool:
    # a loader that checks and writes the groups one at a time has written the others by then
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or len(groups) < 2:
        return False
    found = _group_float_option(sd, last=True)
    if found is None or found[0] is groups[0]:
        return False
    found[0][found[1]] = math.nan
    return True


def _str_for_float_option(sd: StateDict) -> bool:
    found = _group_float_option(sd)
    if found is None:
        return False
    found[0][found[1]] = repr(found[0][found[1]])
    return True


def _truncated_tensor(sd: StateDict) -> bool:
    found = _prefer_large(sd, lambda t: t.numel() >= 2)
    if found is None:
        return False
    entry, key = found
    entry[key] = entry[key].reshape(-1)[:-1].clone()
    return True


CORRUPTIONS: tuple[Corruption, ...] = (
    Corruption("missing_key", _missing_key),
    Corruption("last_entry_missing_key", lambda sd: _missing_key(sd, last=True)),
    Corruption("extra_key", _extra_key),
    Corruption("last_entry_extra_key", lambda sd: _extra_key(sd, last=True)),
    Corruption("wrong_shape", _wrong_shape),
    Corruption("transposed", _transposed),
    Corruption("wrong_dtype", _wrong_dtype),
    Corruption("last_entry_wrong_dtype", lambda sd: _wrong_dtype(sd, last=True)),
    Corruption("non_finite", _non_finite),
    Corruption("wrong_parameter_count", _wrong_parameter_count),
    Corruption("extra_param_group", _extra_param_group),
    Corruption("missing_param_group", _missing_param_group),
    Corruption("bool_for_int", _bool_for_int),
    Corruption("truncated_tensor", _truncated_tensor),
    Corruption("last_entry_non_finite", _last_entry_non_finite),
    Corruption("last_entry_wrong_shape", _last_entry_wrong_shape),
    Corruption("non_finite_option", _non_finite_option),
    Corruption("non_finite_other_option", _non_finite_other_option),
    Corruption("last_group_non_finite_option", _last_group_non_finite_option),
    Corruption("str_for_float_option", _str_for_float_option),
    Corruption("str_in_tuple_option", _str_in_tuple_option),
)


def _torch_style_paths(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(tree, dict):
        if "state" in tree and "param_groups" in tree:
            return [path]
        found: list[tuple[str, ...]] = []
        for key, value in tree.items():
            if isinstance(key, str):
                found.extend(_torch_style_paths(value, (*path, key)))
        return found
    return []


def _deep_copy(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _deep_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_deep_copy(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_deep_copy(v) for v in tree)
    return copy.deepcopy(tree)


def corrupted_variants(state_dict: StateDict) -> Iterator[tuple[str, StateDict]]:
    """Yield ``(name, corrupted copy)`` for every applicable corruption and nested half."""
    paths = _torch_style_paths(state_dict)
    for corruption in CORRUPTIONS:
        for path in paths:
            copy_ = _deep_copy(state_dict)
            target = copy_
            for key in path:
                target = target[key]
            if corruption.apply(target):
                suffix = "@" + ".".join(path) if path else ""
                yield corruption.name + suffix, copy_


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def hostile_object(marker: str | os.PathLike[str]) -> object:
    """An object whose pickle creates the file ``marker`` when unpickled unrestricted: pickle
    it (or save it) where a loader reads a checkpoint and check that ``marker`` never appears."""
    return _Planted(os.fspath(marker))

"""Validation of GefenMuon's per-group options.

Every option below may differ per parameter group; the constructor's arguments are the
defaults. :func:`normalize_muon_options` checks and normalises the options present in a
mapping without touching anything, so the constructor and ``add_param_group`` validate a
whole group before registering it, and the step re-checks groups that schedulers or users
edited. Errors are :class:`~gefen_core.errors.GefenOptionError` (``ValueError``) or
:class:`~gefen_core.errors.GefenOptionTypeError` (``TypeError``) naming the group and option.

Newton-Schulz options are normalised as the reference does: a named schedule other than
``"standard"``, an explicit ``ns_schedule`` or an explicit list of ``ns_coefficients`` sets
``ns_coefficients`` to the tuple of triples and ``ns_steps`` to its length (so a
``"tuned3"`` group reads ``ns_steps == 3``). Normalising a normalised group changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from .batched_newton_schulz import DEFAULT_WORKSPACE_BYTES
from .errors import GefenOptionError, GefenOptionTypeError
from .newton_schulz import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    Schedule,
    ScheduleError,
    normalize_coefficients,
    resolve_schedule,
)
from .param_groups import check_names, flag_option, lr_option, real_option, where_prefix

__all__ = [
    "ADJUST_LR_FNS",
    "MUON_DEFAULTS",
    "MUON_GROUP_OPTIONS",
    "SHARDED_MODES",
    "check_muon_group",
    "group_schedule",
    "lr_ratio",
    "normalize_muon_options",
]

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
SHARDED_MODES = ("exact", "approx", "distributed")

#: Every per-group option and its default.
MUON_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": DEFAULT_COEFFICIENTS,
    "eps": 1e-7,
    "ns_steps": DEFAULT_NS_STEPS,
    "ns_schedule": None,
    "adjust_lr_fn": None,
    "sharded_mode": "exact",
    "fp8_ns": False,
    "fp8_ns_compile": True,
    "batched_ns": False,
    "batched_ns_workspace_bytes": DEFAULT_WORKSPACE_BYTES,
    "normuon": False,
    "normuon_beta2": 0.95,
    "normuon_eps": 1e-8,
    "cautious": False,
}
MUON_GROUP_OPTIONS = tuple(MUON_DEFAULTS)

_FLAGS = ("nesterov", "fp8_ns", "fp8_ns_compile", "batched_ns", "normuon", "cautious")


def _unit_interval(value: object, name: str, group: int | None) -> float:
    number = real_option(value, name, group)
    if not 0.0 <= number < 1.0:
        raise GefenOptionError(f"{where_prefix(group)}{name} must be in [0, 1), got {number}")
    return number


def _positive(value: object, name: str, group: int | None) -> float:
    number = real_option(value, name, group)
    if number <= 0:
        raise GefenOptionError(f"{where_prefix(group)}{name} must be finite and > 0, got {number}")
    return number


def _choice(value: object, name: str, choices: tuple[Any, ...], group: int | None) -> Any:
    if value is not None and type(value) is not str:
        raise GefenOptionTypeError(
            f"{where_prefix(group)}{name} must be one of {list(choices)}, got {type(value).__name__}"
        )
    if value not in choices:
        raise GefenOptionError(f"{where_prefix(group)}{name} must be one of {list(choices)}, got {value!r}")
    return value


def _schedule_options(options: Mapping[str, Any], group: int | None) -> dict[str, Any]:
    coefficients = options.get("ns_coefficients", DEFAULT_COEFFICIENTS)
    steps = options.get("ns_steps", DEFAULT_NS_STEPS)
    schedule = options.get("ns_schedule")
    try:
        resolved = resolve_schedule(coefficients, steps, schedule)
        out: dict[str, Any] = {}
        if "ns_schedule" in options:
            out["ns_schedule"] = schedule if schedule is None or isinstance(schedule, str) else resolved
        explicit = schedule is not None and schedule != "standard"
        normalized = normalize_coefficients(coefficients)
        if explicit or isinstance(normalized[0], tuple):
            out["ns_coefficients"] = resolved
            out["ns_steps"] = len(resolved)
        else:
            if "ns_coefficients" in options:
                out["ns_coefficients"] = normalized
            if "ns_steps" in options:
                out["ns_steps"] = steps
    except ScheduleError as exc:
        raise ScheduleError(f"{where_prefix(group)}{exc}") from None
    return out


def normalize_muon_options(
    options: Mapping[str, Any], group: int | None = None, *, read_tensor_lr: bool = True
) -> dict[str, Any]:
    """Validate the GefenMuon options present in ``options``; return them normalised.

    Only keys of :data:`MUON_GROUP_OPTIONS` are examined. A tensor ``lr``'s value is read
    (a device synchronisation) only with ``read_tensor_lr``.
    """
    out: dict[str, Any] = {}
    if "lr" in options:
        out["lr"] = lr_option(options["lr"], group, read_tensor_lr)
    if "weight_decay" in options:
        decay = real_option(options["weight_decay"], "weight_decay", group)
        if decay < 0:
            raise GefenOptionError(f"{where_prefix(group)}weight_decay must be >= 0, got {decay}")
        out["weight_decay"] = decay
    if "momentum" in options:
        out["momentum"] = _unit_interval(options["momentum"], "momentum", group)
    if "eps" in options:
        out["eps"] = _positive(options["eps"], "eps", group)
    for flag in _FLAGS:
        if flag in options:
            out[flag] = flag_option(options[flag], flag, group)
    if {"ns_coefficients", "ns_steps", "ns_schedule"} & set(options):
        out.update(_schedule_options(options, group))
    if "adjust_lr_fn" in options:
        out["adjust_lr_fn"] = _choice(options["adjust_lr_fn"], "adjust_lr_fn", ADJUST_LR_FNS, group)
    if "sharded_mode" in options:
        out["sharded_mode"] = _choice(options["sharded_mode"], "sharded_mode", SHARDED_MODES, group)
    if "batched_ns_workspace_bytes" in options:
        workspace = options["batched_ns_workspace_bytes"]
        if type(workspace) is not int:
            raise GefenOptionTypeError(
                f"{where_prefix(group)}batched_ns_workspace_bytes must be an int, got {type(workspace).__name__}"
            )
        if workspace <= 0:
            raise GefenOptionError(f"{where_prefix(group)}batched_ns_workspace_bytes must be > 0, got {workspace}")
        out["batched_ns_workspace_bytes"] = workspace
    if "normuon_beta2" in options:
        out["normuon_beta2"] = _unit_interval(options["normuon_beta2"], "normuon_beta2", group)
    if "normuon_eps" in options:
        out["normuon_eps"] = _positive(options["normuon_eps"], "normuon_eps", group)
    return out


def check_muon_group(group: Mapping[str, Any], index: int) -> None:
    """Re-validate a live group (for example after a scheduler or a user edited it). An
    ``ns_steps`` that the group's schedule does not run (edited on a group whose named or
    explicit schedule fixes the count) is refused rather than silently ignored."""
    missing = [name for name in MUON_GROUP_OPTIONS if name not in group]
    if missing:
        raise GefenOptionError(f"param_groups[{index}] is missing options {missing}")
    check_names(group, index)
    normalized = normalize_muon_options(group, index, read_tensor_lr=False)
    steps = normalized.get("ns_steps", group["ns_steps"])
    if steps != group["ns_steps"]:
        raise GefenOptionError(
            f"param_groups[{index}]: ns_steps is {group['ns_steps']!r} but the group's schedule "
            f"(ns_schedule={group['ns_schedule']!r}, {steps} coefficient triples in ns_coefficients) runs {steps}; "
            "ns_steps counts repeats of one triple only: change a schedule by setting its fields together "
            "(ns_schedule='tuned3' with ns_steps=3; back to standard: ns_schedule='standard', "
            "ns_coefficients=gefen_core.newton_schulz.DEFAULT_COEFFICIENTS, ns_steps=5)"
        )


@lru_cache(maxsize=256)
def _cached_schedule(coefficients: Any, steps: Any, schedule: Any) -> Schedule:
    return resolve_schedule(coefficients, steps, schedule)


def group_schedule(group: Mapping[str, Any]) -> Schedule:
    """The Newton-Schulz triples a (validated) group runs."""
    schedule = group["ns_schedule"]
    try:
        return _cached_schedule(group["ns_coefficients"], group["ns_steps"], schedule)
    except TypeError:  # unhashable (a list edited in by hand): resolve without the cache
        return resolve_schedule(group["ns_coefficients"], group["ns_steps"], schedule)


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The update's learning-rate multiplier for a ``rows x cols`` (global) matrix.

    ``None`` / ``"original"``: ``sqrt(max(1, rows / cols))`` (Muon's own scaling);
    ``"match_rms_adamw"``: ``0.2 * sqrt(max(rows, cols))`` (the update RMS of AdamW, so an
    AdamW learning rate transfers); ``"spectral_unclamped"``: ``sqrt(rows / cols)`` (Bernstein's
    scaling, as ``torch.optim.Muon`` computes it).
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        # a matrix without columns has no elements to update: any finite ratio will do
        return float(max(1.0, rows / cols) ** 0.5) if cols else 1.0
    if adjust_lr_fn == "match_rms_adamw":
        return float(0.2 * max(rows, cols) ** 0.5)
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(rows / cols) if cols else 1.0
    raise GefenOptionError(f"adjust_lr_fn must be one of {list(ADJUST_LR_FNS)}, got {adjust_lr_fn!r}")

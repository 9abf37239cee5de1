"""The composite's native state-dict format, ``gefen.composite_native_state`` version 1.

Tensors and primitives only (``torch.load(weights_only=True)`` reads it)::

    {
        "format": "gefen.composite_native_state",
        "format_version": 1,
        "child_implementations": {"muon": "<implementation>", "backup": "<implementation>"},
        "routing": [["<fqn>", "<role>"], ...],        # sorted, every routed parameter
        "muon": <the muon child's own state dict> or None,
        "backup": <the backup child's own state dict> or None,
    }

``child_implementations`` lists the present roles only; an absent role holds ``None``.
Each child's state dict is its own native format, with its own parameter ids. The
reference's single ``backup_optimizer`` tag is generalised to every child's
implementation name, checked before any child is touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from gefen_contracts import StateValidationError

from .roles import ROLES

__all__ = ["FORMAT", "FORMAT_VERSION", "TOP_LEVEL_KEYS", "build_composite_state_dict", "children_of_state_dict"]

FORMAT = "gefen.composite_native_state"
FORMAT_VERSION = 1
#: The composite's own top-level keys (besides one key per role).
TOP_LEVEL_KEYS = ("format", "format_version", "child_implementations", "routing")


def build_composite_state_dict(
    child_state_dicts: Mapping[str, Any],
    implementations: Mapping[str, str],
    routing: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """Assemble the composite state dict from the present children's state dicts."""
    state: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "child_implementations": {role: implementations[role] for role in ROLES if role in implementations},
        "routing": [[fqn, role] for fqn, role in routing],
    }
    for role in ROLES:
        state[role] = child_state_dicts.get(role)
    return state


def _fail(message: str) -> NoReturn:
    raise StateValidationError(f"composite state dict: {message}")


def children_of_state_dict(
    state_dict: object,
    *,
    implementations: Mapping[str, str],
    routing: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """Validate the composite envelope against the live composite; return role -> child state dict.

    ``implementations`` maps each present role to its child's implementation name and
    ``routing`` is the live sorted routing. Raises
    :class:`~gefen_contracts.StateValidationError` naming the problem (a flat torch state
    dict, a missing or extra key, a wrong format or version, a half present on one side
    only, another child implementation, a different routing). Reads only.
    """
    if not isinstance(state_dict, Mapping):
        _fail(f"must be a mapping, got {type(state_dict).__name__}")
    keys = set(state_dict)
    if {"state", "param_groups"} <= keys and not keys & set(ROLES):
        _fail(
            "this is a flat torch optimizer state dict ({'state', 'param_groups'}); a composite nests each child's "
            f"state dict under its role {ROLES} (the flat layout is not supported)"
        )
    expected = {*TOP_LEVEL_KEYS, *ROLES}
    if keys != expected:
        _fail(
            f"keys must be exactly {sorted(expected)}: missing {sorted(expected - keys)}, extra {sorted(map(str, keys - expected))}"
        )
    if state_dict["format"] != FORMAT or type(state_dict["format"]) is not str:
        _fail(f"'format' must be {FORMAT!r}, got {state_dict['format']!r}")
    version = state_dict["format_version"]
    if type(version) is not int or version != FORMAT_VERSION:
        _fail(f"'format_version' {version!r} is not supported (this library reads {FORMAT_VERSION})")
    for role in ROLES:
        live, saved = role in implementations, state_dict[role] is not None
        if live and not saved:
            _fail(f"the {role!r} half is missing from the checkpoint, but this composite has a {role!r} child")
        if saved and not live:
            _fail(f"the checkpoint carries a {role!r} half, but this composite has no {role!r} child")
    saved_impl = state_dict["child_implementations"]
    if not isinstance(saved_impl, Mapping) or any(
        type(k) is not str or type(v) is not str for k, v in saved_impl.items()
    ):
        _fail("'child_implementations' must map role names to implementation names")
    if dict(saved_impl) != dict(implementations):
        _fail(
            f"the checkpoint's children are {dict(saved_impl)} but this composite's are {dict(implementations)}; "
            "a child's state is only loaded into the same implementation"
        )
    _check_routing(state_dict["routing"], routing)
    return {role: state_dict[role] for role in ROLES if role in implementations}


def _check_routing(saved: object, live: Sequence[tuple[str, str]]) -> None:
    if not isinstance(saved, (list, tuple)):
        _fail(f"'routing' must be a list of [fqn, role] pairs, got {type(saved).__name__}")
    pairs = []
    for index, item in enumerate(saved):
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or type(item[0]) is not str
            or type(item[1]) is not str
        ):
            _fail(f"'routing'[{index}] must be a [fqn, role] pair of str, got {item!r}")
        pairs.append((item[0], item[1]))
    if pairs == list(live):
        return
    saved_map, live_map = dict(pairs), dict(live)
    if len(saved_map) != len(pairs):
        _fail("'routing' lists a parameter twice")
    for fqn in sorted(set(saved_map) | set(live_map)):
        if fqn not in live_map:
            _fail(f"the checkpoint routes {fqn!r} to {saved_map[fqn]!r}, but this composite has no such parameter")
        if fqn not in saved_map:
            _fail(f"parameter {fqn!r} (role {live_map[fqn]!r}) is missing from the checkpoint's routing")
        if saved_map[fqn] != live_map[fqn]:
            _fail(f"parameter {fqn!r} is routed to {saved_map[fqn]!r} in the checkpoint but to {live_map[fqn]!r} here")
    _fail("'routing' must be sorted by fqn")

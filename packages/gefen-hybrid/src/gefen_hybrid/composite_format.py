"""The composite's native state-dict format, ``gefen.composite_native_state`` version 2.

One flat torch optimizer state dict, so torch's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` (and DCP through them) handle a composite like any optimizer.
Tensors and primitives only (``torch.load(weights_only=True)`` reads it)::

    {
        "state": {pid: <the child's entry>, ...},
        "param_groups": [<muon child's groups>..., <backup child's groups>...],
        "format": "gefen.composite_native_state",
        "format_version": 2,
        "child_implementations": {"muon": "<implementation>", "backup": "<implementation>"},
        "routing": [["<fqn>", "<role>"], ...],        # sorted, every routed parameter
        "<role>.<key>": <each child's own top-level record, its key prefixed by the role>,
    }

Parameter ids are positions in the composite's ``param_groups`` order (muon groups first),
which is what torch's helpers expect; each group is the child's own group dict. A load splits
the groups by the live children's group counts (muon first) and hands each child its groups,
their state entries (ids kept: the children match ids by position) and its un-prefixed
records. The composite's record keys (``format`` .. ``routing``) are checked when present;
torch's helpers keep only ``state`` and ``param_groups``, and then the children's own checks
(parameter names, group mirrors) stand in for them.

Version 1 nested each child's state dict under its role; torch's helpers could not read it.
It is refused with an error naming both versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from gefen_contracts import StateValidationError
from gefen_contracts.torch_support import routing_mismatch, with_rejoined_state

from .roles import ROLES

__all__ = ["FORMAT", "FORMAT_VERSION", "TOP_LEVEL_KEYS", "build_composite_state_dict", "children_of_state_dict"]

FORMAT = "gefen.composite_native_state"
FORMAT_VERSION = 2
#: The composite's own top-level record keys (besides ``state``, ``param_groups`` and the
#: role-prefixed child records).
TOP_LEVEL_KEYS = ("format", "format_version", "child_implementations", "routing")
_TORCH_KEYS = ("state", "param_groups")


def build_composite_state_dict(
    child_state_dicts: Mapping[str, Any],
    implementations: Mapping[str, str],
    routing: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """Assemble the flat composite state dict from the present children's state dicts (in
    :data:`ROLES` order, each child's ids renumbered to positions in the composite)."""
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    records: dict[str, Any] = {}
    next_id = 0
    for role in ROLES:
        child = child_state_dicts.get(role)
        if child is None:
            continue
        position: dict[object, int] = {}
        for group in child["param_groups"]:
            ids = []
            for pid in group["params"]:
                position[pid] = next_id
                ids.append(next_id)
                next_id += 1
            groups.append({**group, "params": ids})
        for pid, entry in child["state"].items():
            state[position[pid]] = entry
        records.update({f"{role}.{key}": value for key, value in child.items() if key not in _TORCH_KEYS})
    return {
        "state": state,
        "param_groups": groups,
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "child_implementations": {role: implementations[role] for role in ROLES if role in implementations},
        "routing": [[fqn, role] for fqn, role in routing],
        **records,
    }


def _fail(message: str) -> NoReturn:
    raise StateValidationError(f"composite state dict: {message}")


def children_of_state_dict(
    state_dict: object,
    *,
    implementations: Mapping[str, str],
    routing: Sequence[tuple[str, str]],
    group_counts: Mapping[str, int],
) -> dict[str, Any]:
    """Validate the flat composite state dict against the live composite; return role -> child state dict.

    ``implementations`` maps each present role to its child's implementation name, ``routing``
    is the live sorted routing and ``group_counts`` each present child's number of param
    groups. Raises :class:`~gefen_contracts.StateValidationError` naming the problem (a
    version-1 nested dict, a missing or unknown key, a wrong format or version, a record of a
    role this composite lacks, another child implementation, a different routing, a group
    count or a state entry that fits no group). Reads only.
    """
    if not isinstance(state_dict, Mapping):
        _fail(f"must be a mapping, got {type(state_dict).__name__}")
    state_dict = with_rejoined_state(state_dict)  # a plain dcp.load split each entry's counters off
    keys = set(state_dict)
    if keys & set(ROLES):
        _fail(
            f"this is {FORMAT} version 1 (each child's state dict nested under its role); this library reads "
            f"version {FORMAT_VERSION} only (formats are 0.x: re-save it with the version that wrote it)"
        )
    missing = [key for key in _TORCH_KEYS if key not in keys]
    if missing:
        _fail(f"lacks {missing} (a composite state dict is a torch optimizer state dict)")
    present = [key for key in TOP_LEVEL_KEYS if key in keys]
    if present:
        _check_record(state_dict, present, implementations, routing)
    for key in sorted(map(str, keys - {*_TORCH_KEYS, *TOP_LEVEL_KEYS})):
        role = key.split(".", 1)[0]
        if "." not in key or role not in ROLES:
            # (a single optimizer's state dict, say Gefen's with its 'gefen_codebook', has no record)
            hint = "" if present else "; with no composite record, this is not a composite's state_dict()"
            _fail(f"unknown top-level key {key!r}{hint}")
        if role not in implementations:
            _fail(f"the checkpoint carries a {role!r} record ({key!r}), but this composite has no {role!r} child")
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)):
        _fail(f"'param_groups' must be a list, got {type(groups).__name__}")
    expected = sum(group_counts[role] for role in ROLES if role in implementations)
    if len(groups) != expected:
        counts = ", ".join(f"{role} {group_counts[role]}" for role in ROLES if role in implementations)
        _fail(f"the checkpoint has {len(groups)} param groups, this composite has {expected} ({counts})")
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        _fail(f"'state' must be a mapping, got {type(saved_state).__name__}")
    children: dict[str, Any] = {}
    owner: dict[object, str] = {}
    first = 0
    for role in ROLES:
        if role not in implementations:
            continue
        own = list(groups[first : first + group_counts[role]])
        first += group_counts[role]
        for index, group in enumerate(own):
            if not isinstance(group, Mapping) or not isinstance(group.get("params"), (list, tuple)):
                _fail(f"param group {index} of the {role!r} child must be a mapping with a 'params' list")
            for pid in group["params"]:
                # ids are ints (state_dict) or FQN strings (torch's DCP helpers); nothing else
                if type(pid) not in (int, str) or pid in owner:
                    _fail(f"parameter id {pid!r} is not an int or str, or appears twice in 'param_groups'")
                owner[pid] = role
        prefix = f"{role}."
        children[role] = {
            "state": {},
            "param_groups": own,
            **{key[len(prefix) :]: value for key, value in state_dict.items() if str(key).startswith(prefix)},
        }
    for pid, entry in saved_state.items():
        if pid not in owner:
            _fail(f"state entry {pid!r} names no parameter of the param groups")
        children[owner[pid]]["state"][pid] = entry
    return children


def _check_record(
    state_dict: Mapping[str, Any],
    present: Sequence[str],
    implementations: Mapping[str, str],
    routing: Sequence[tuple[str, str]],
) -> None:
    if len(present) != len(TOP_LEVEL_KEYS):
        _fail(f"has some of the composite's record keys {list(TOP_LEVEL_KEYS)} but lacks the others")
    if state_dict["format"] != FORMAT or type(state_dict["format"]) is not str:
        _fail(f"'format' must be {FORMAT!r}, got {state_dict['format']!r}")
    version = state_dict["format_version"]
    if type(version) is not int or version != FORMAT_VERSION:
        _fail(f"'format_version' {version!r} is not supported (this library reads {FORMAT_VERSION})")
    saved_impl = state_dict["child_implementations"]
    if not isinstance(saved_impl, Mapping) or any(
        type(k) is not str or type(v) is not str for k, v in saved_impl.items()
    ):
        _fail("'child_implementations' must map role names to implementation names")
    for role in ROLES:
        if role in implementations and role not in saved_impl:
            _fail(f"the {role!r} half is missing from the checkpoint, but this composite has a {role!r} child")
        if role in saved_impl and role not in implementations:
            _fail(f"the checkpoint carries a {role!r} half, but this composite has no {role!r} child")
    if dict(saved_impl) != dict(implementations):
        _fail(
            f"the checkpoint's children are {dict(saved_impl)} but this composite's are {dict(implementations)}; "
            "a child's state is only loaded into the same implementation"
        )
    _check_routing(state_dict["routing"], routing)


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
    saved_map = dict(pairs)
    if len(saved_map) != len(pairs):
        _fail("'routing' lists a parameter twice")
    mismatch = routing_mismatch(saved_map, dict(live))
    _fail(mismatch if mismatch is not None else "'routing' must be sorted by fqn")

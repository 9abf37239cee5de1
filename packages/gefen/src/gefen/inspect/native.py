"""Native optimizer state dicts: Gefen's, GefenMuon's, the composite's and torch's.

"Verifying" a native state dict means checking everything the format promises that can be
checked without the model, then (Gefen's and GefenMuon's formats) its ``gefen_state_digest``: exact key sets and types, the shapes that
tie a parameter's entries together (Gefen's tensors shaped like the parameter that
``m_codes`` has, :mod:`gefen_core.state_placement`; GefenMuon's ``m_codes [B, P]``
whose width is the block period ``P`` and ``m_magnitude [B, 1]``; Gefen's period is the one its
scales' shape gives, :func:`gefen_core.state_placement.period_from_scales`, ...), dtypes,
finite and non-negative statistics, whole-number counters, a valid codebook whenever
momentum indices exist, the per-group mirror of the optimizer-wide record agreeing with
the top-level keys, and every state entry belonging to a parameter of the groups. Each
problem names the parameter (by name when the groups record names) and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_core.muon_native_state import FORMAT as MUON_FORMAT
from gefen_core.muon_native_state import stage_muon_group
from gefen_core.native_format import FORMAT as GEFEN_FORMAT
from gefen_core.native_state import stage_native_group
from gefen_core.param_state import AGE_KEYS
from gefen_core.state_placement import expected_shapes, period_from_scales, state_dtype
from gefen_hybrid import FORMAT_VERSION as COMPOSITE_VERSION
from gefen_hybrid import ROLES, children_of_state_dict

from .report import CheckpointDescription, ParameterSummary, Problem

__all__ = ["describe_native", "is_native_state_dict"]

_GEFEN = GEFEN_FORMAT.name
_MUON = MUON_FORMAT.name
_COMPOSITE = "gefen.composite_native_state"
_MIRROR = "_gefen_checkpoint_metadata"
_FORMATS = {fmt.name: fmt for fmt in (GEFEN_FORMAT, MUON_FORMAT)}
_RECORD_KEYS = {fmt.name: tuple(key for _, key in fmt.records) for fmt in _FORMATS.values()}
#: How the load stages each format's saved groups (the options it requires and validates).
_GROUP_RULES = {_GEFEN: stage_native_group, _MUON: stage_muon_group}
_IMPLEMENTATIONS = {_GEFEN: "gefen.Gefen", _MUON: "gefen.GefenMuon"}


def is_native_state_dict(value: object) -> bool:
    """A torch-style ``{"state", "param_groups", ...}`` dict or the composite's envelope."""
    return isinstance(value, Mapping) and (
        value.get("format") == _COMPOSITE or ("state" in value and "param_groups" in value)
    )


def _tensor_bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _is_count(value: object, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum


class _Checker:
    """Collects problems while walking one state dict."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def fail(self, where: str, message: str) -> None:
        self.problems.append(Problem(where, message))

    def tensor(
        self,
        entry: Mapping[str, Any],
        key: str,
        where: str,
        dtype: torch.dtype,
        rank: int | None,
        *,
        non_negative: bool = True,
    ) -> torch.Tensor | None:
        value = entry.get(key)
        if not isinstance(value, torch.Tensor):
            self.fail(f"{where}.{key}", f"must be a tensor, got {type(value).__name__}")
            return None
        if value.dtype is not dtype or (rank is not None and value.dim() != rank):
            wanted = f"a {rank}-D {dtype}" if rank is not None else f"a {dtype}"
            self.fail(f"{where}.{key}", f"must be {wanted} tensor, got {value.dim()}-D {value.dtype}")
            return None
        if value.is_floating_point():
            data = value.detach().cpu()
            bad = int((~torch.isfinite(data)).sum())
            if bad:
                self.fail(f"{where}.{key}", f"{bad} non-finite value(s)")
            elif non_negative and bool((data < 0).any()):
                self.fail(f"{where}.{key}", "has negative values (a second moment or scale must be >= 0)")
        return value


def _names(check: _Checker, groups: list[Any]) -> dict[object, str]:
    """Each parameter id's label (its name where the groups name it); names that contradict
    the groups (not a list of str, another length than ``params``, repeated) are problems,
    as the load refuses them."""
    names: dict[object, str] = {}
    seen: set[str] = set()
    for index, group in enumerate(groups):
        params = group.get("params", []) if isinstance(group, Mapping) else []
        labels = group.get("param_names") if isinstance(group, Mapping) else None
        if labels is not None:
            where = f"param_groups[{index}].param_names"
            if not isinstance(labels, list) or any(type(label) is not str for label in labels):
                check.fail(where, f"must be a list of str, got {type(labels).__name__}")
            elif len(labels) != len(params):
                check.fail(where, f"holds {len(labels)} names for {len(params)} parameters")
            else:
                repeated = set()
                for label in labels:
                    if label in seen:
                        repeated.add(label)
                    seen.add(label)
                if repeated:
                    check.fail(where, f"repeats the name(s) {sorted(repeated)[:3]}")
        for slot, pid in enumerate(params):
            if isinstance(labels, list) and slot < len(labels) and isinstance(labels[slot], str):
                names[pid] = labels[slot]
            else:
                names[pid] = f"group {index} param {slot} (id {pid!r})"
    return names


def _gefen_entry(
    check: _Checker, entry: Mapping[str, Any], where: str, muon: bool
) -> tuple[str, tuple[int, ...] | None]:
    """Check one Gefen/GefenMuon parameter entry; return its variant and shape when known."""
    if "m_codes" not in entry and "m_magnitude" not in entry:
        if entry:
            check.fail(where, f"has {sorted(entry)} but no momentum (m_codes, m_magnitude)")
        return "uninitialized", None
    if not _is_count(entry.get("step"), 1):
        check.fail(f"{where}.step", f"must be an int >= 1 once momentum exists, got {entry.get('step')!r}")
    if not muon:
        return _shaped_entry(check, entry, where)
    indices = check.tensor(entry, "m_codes", where, torch.uint8, 2)
    magnitude = check.tensor(entry, "m_magnitude", where, torch.float32, 2)
    blocks = numel = None
    if indices is not None:
        blocks, width = indices.shape
        numel = blocks * width
    if indices is not None and magnitude is not None and tuple(magnitude.shape) != (blocks, 1):
        check.fail(f"{where}.m_magnitude", f"must be [{blocks}, 1] (one scale per block), got {list(magnitude.shape)}")
    if muon:
        variant, shape = "muon", None
        if "normuon_v" in entry or "normuon_step" in entry:
            variant = "muon+normuon"
            rows = check.tensor(entry, "normuon_v", where, torch.float32, 2)
            if rows is not None and (rows.shape[1] != 1 or (numel is not None and numel % max(1, rows.shape[0]))):
                check.fail(f"{where}.normuon_v", f"must be [rows, 1] dividing the matrix, got {list(rows.shape)}")
            elif rows is not None and numel is not None:
                shape = (int(rows.shape[0]), numel // max(1, int(rows.shape[0])))
            if not _is_count(entry.get("normuon_step"), 1):
                check.fail(f"{where}.normuon_step", f"must be an int >= 1, got {entry.get('normuon_step')!r}")
        return variant, shape
    return "muon", None


def _shaped_entry(check: _Checker, entry: Mapping[str, Any], where: str) -> tuple[str, tuple[int, ...] | None]:
    """A Gefen entry (``gefen.native_state`` v10): tensors shaped like the parameter, whose
    shape the codes give and whose period the scales' shape gives
    (:func:`gefen_core.state_placement.expected_shapes`, :func:`~gefen_core.state_placement.period_from_scales`)."""
    indices = entry.get("m_codes")
    if not isinstance(indices, torch.Tensor) or indices.dtype is not torch.uint8:
        check.fail(f"{where}.m_codes", f"must be a torch.uint8 tensor shaped like the parameter, got {indices!r:.60}")
        return "broken", None
    shape = tuple(int(d) for d in indices.shape)
    scales = check.tensor(entry, "m_magnitude", where, torch.float32, None)
    if scales is None:
        return "broken", shape
    period = period_from_scales(shape, scales.shape)
    if period is None:
        check.fail(
            f"{where}.m_magnitude",
            f"has shape {list(scales.shape)}: no block period of a {list(shape)} parameter gives that many scales",
        )
        return "broken", shape
    variant = "factored" if "v_row" in entry or "v_col" in entry else "element" if "v" in entry else "block"
    if variant != "block" and len(shape) != 2:
        check.fail(where, f"holds a {variant} second moment but its parameter is {len(shape)}-D")
        return "broken", shape
    if variant == "block" and "vmean" not in entry:
        check.fail(where, "has momentum but no second moment (vmean, v, or v_row and v_col)")
        return "broken", shape
    for key, want in expected_shapes(shape, period, variant).items():
        if key in ("m_codes", "m_magnitude"):  # the codes set the shape, the scales the period
            continue
        value = check.tensor(entry, key, where, state_dtype(key), len(want))
        if value is not None and tuple(value.shape) != want:
            check.fail(
                f"{where}.{key}",
                f"must be {list(want)} for a {list(shape)} parameter at period {period}, got {list(value.shape)}",
            )
    age = AGE_KEYS[variant]
    if not _is_count(entry.get(age), 1):
        check.fail(f"{where}.{age}", f"must be an int >= 1, got {entry.get(age)!r}")
    return variant, shape


def _parsed_mirror(raw: object, where: str) -> Mapping[str, Any]:
    """A group mirror as a mapping, its codebook a tensor: the JSON string of current formats, or
    the dict of older ones (whose version the caller then reports). Raises
    ``StateValidationError`` naming what is wrong."""
    from gefen_core.native_records import decode_mirror, mirror_codebook

    if isinstance(raw, Mapping):
        return raw
    mirror = decode_mirror(raw, where)
    if "codebook" in mirror:
        mirror["codebook"] = mirror_codebook(mirror["codebook"], where)
    return mirror


def _mirror_format(raw: object) -> object:
    """The format a group mirror names (``None`` when it cannot be read: the record check says why)."""
    try:
        return _parsed_mirror(raw, "mirror").get("format")
    except StateValidationError:
        return None


def _record(check: _Checker, state_dict: Mapping[str, Any], fmt: str) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Check the optimizer-wide record by the load's own rule (the top-level ``gefen_*`` keys,
    every group's mirror, or both, agreeing: torch's DCP helpers keep only the mirrors) and
    each saved group's options as the load stages them; return facts and the record (empty
    when it cannot be read)."""
    from gefen_core.codebook import validate_codebook
    from gefen_core.native_records import reconcile_record

    try:
        record = reconcile_record(state_dict, _FORMATS[fmt])
    except StateValidationError as exc:
        check.fail("gefen record", str(exc))
        return [], {}
    groups = state_dict.get("param_groups")
    for index, group in enumerate(groups if isinstance(groups, list) else []):
        ids = group.get("params") if isinstance(group, Mapping) else None
        # a stand-in live group that matches the saved one: only the options are checked here
        live: dict[str, Any] = {"params": list(ids) if isinstance(ids, list) else []}
        if isinstance(group, Mapping) and "param_names" in group:
            live["param_names"] = group["param_names"]
        try:
            _GROUP_RULES[fmt](group, live, index)
        except StateValidationError as exc:
            check.fail(f"param_groups[{index}]", str(exc).removeprefix(f"param_groups[{index}] "))
    step = record["global_step"]
    if not _is_count(step):
        check.fail("gefen_global_step", f"must be a non-negative int, got {step!r}")
    codebook = record["codebook"] if record["codebook_learned"] is True else None
    if codebook is not None:
        try:
            validate_codebook(codebook, "gefen_codebook")
        except StateValidationError as exc:
            check.fail("gefen_codebook", str(exc).removeprefix("gefen_codebook "))
    if type(record["deterministic"]) is not bool:
        check.fail("gefen_deterministic", f"must be a bool, got {record['deterministic']!r}")
    facts = [("global step", str(step))]
    facts.append(("codebook", "none (not learned yet)" if codebook is None else "256 entries"))
    facts.append(("deterministic", str(record["deterministic"])))
    topology = record.get("topology")
    if isinstance(topology, list):
        meshes = {str(entry.get("mesh_size")) for entry in topology if isinstance(entry, Mapping)}
        facts.append(("topology", f"rank-local DTensor state, mesh size {sorted(meshes)}"))
    raw_owners = record.get("owners")
    if raw_owners is not None:
        try:
            owners = _parsed_mirror(raw_owners, "gefen_muon_owners")
        except StateValidationError as exc:
            check.fail("gefen_muon_owners", str(exc).removeprefix("gefen_muon_owners").lstrip(": "))
            return facts, record
        facts.append(("owners", f"{owners.get('ownership')}, saved on {owners.get('world_size')} rank(s)"))
    return facts, record


def _check_digest(
    check: _Checker, state_dict: Mapping[str, Any], fmt: Any, ids: list[list[Any]], record: Mapping[str, Any]
) -> None:
    """Last, once the structure is sound: the record's state digest against the content."""
    from gefen_core.native_records import check_state_digest

    try:
        check_state_digest(fmt, ids, state_dict["state"], record)
    except StateValidationError as exc:
        check.fail("gefen_state_digest", str(exc))


def _moving(entry: object) -> bool:
    """Whether a state entry holds non-zero quantized momentum."""
    magnitude = entry.get("m_magnitude") if isinstance(entry, Mapping) else None
    return isinstance(magnitude, torch.Tensor) and bool(magnitude.ne(0).any())


def _torch_entry(check: _Checker, entry: Mapping[str, Any], where: str) -> tuple[str, tuple[int, ...] | None]:
    shape = None
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = int((~torch.isfinite(value.detach().cpu())).sum())
            if bad:
                check.fail(f"{where}.{key}", f"{bad} non-finite value(s)")
            if value.dim() > 0:
                here = tuple(int(d) for d in value.shape)
                if shape is not None and here != shape:  # every moment is shaped like the parameter
                    check.fail(f"{where}.{key}", f"has shape {list(here)}, another entry {list(shape)}")
                shape = shape or here
    step = entry.get("step")
    count = float(step.detach().cpu().reshape(-1)[0]) if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if step is not None and (isinstance(count, bool) or not isinstance(count, (int, float)) or not count >= 0):
        check.fail(f"{where}.step", f"must be a count >= 0, got {count!r}")
    second = entry.get("exp_avg_sq")
    if isinstance(second, torch.Tensor) and bool((second.detach().cpu() < 0).any()):
        check.fail(f"{where}.exp_avg_sq", "has negative values (a second moment must be >= 0)")
    return "+".join(sorted(entry)) or "empty", shape


def _describe_torch_shaped(state_dict: Mapping[str, Any], path: str, file_bytes: int | None) -> CheckpointDescription:
    check = _Checker()
    groups = state_dict.get("param_groups")
    state = state_dict.get("state")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        check.fail("param_groups", "must be a list of dicts")
        groups = []
    elif not groups:  # torch.optim refuses to build an optimizer without parameters
        check.fail("param_groups", "is empty: no optimizer saves a state dict without parameter groups")
    if not isinstance(state, Mapping):
        check.fail("state", "must be a dict keyed by parameter id")
        state = {}
    fmt = next((_mirror_format(g.get(_MIRROR)) for g in groups if g.get(_MIRROR) is not None), None)
    if fmt is None and "gefen_format_version" in state_dict:
        fmt = _GEFEN if "gefen_muon_owners" not in state_dict else _MUON
    names = _names(check, groups)
    listed = [pid for g in groups for pid in g.get("params", [])]
    if len(set(map(repr, listed))) != len(listed):
        check.fail("param_groups", "list a parameter id more than once")
    for pid in state:
        if pid not in names:
            check.fail(f"state[{pid!r}]", "belongs to no parameter of param_groups")
    facts: list[tuple[str, str]] = []
    record: dict[str, Any] = {}
    if fmt in _RECORD_KEYS:
        facts, record = _record(check, state_dict, fmt)
        learned = record.get("codebook_learned") is True
        # an unreadable record is already a problem: it says nothing about the codebook
        if record and state and not learned and any(_moving(e) for e in state.values()):
            check.fail(
                "gefen_codebook", "is not learned but non-zero momentum exists (its indices would be meaningless)"
            )
    parameters = []
    for pid in listed:
        entry = state.get(pid, {})
        where = f"state[{names[pid]}]"
        if not isinstance(entry, Mapping):
            check.fail(where, f"must be a dict, got {type(entry).__name__}")
            continue
        if fmt in _RECORD_KEYS:
            variant, shape = _gefen_entry(check, entry, where, fmt == _MUON)
            indices, scales = entry.get("m_codes"), entry.get("m_magnitude")
            period = None
            if isinstance(indices, torch.Tensor) and isinstance(scales, torch.Tensor):
                period = indices.shape[-1] if fmt == _MUON else period_from_scales(indices.shape, scales.shape)
            detail = f"period {period}" if period else ""
            if shape is None and isinstance(indices, torch.Tensor):
                detail += f", {indices.numel():,} elements"
        else:
            variant, shape = _torch_entry(check, entry, where) if entry else ("no state", None)
            detail = f"step {entry.get('step')}" if "step" in entry else ""
        parameters.append(ParameterSummary(names[pid], shape, variant, _tensor_bytes(entry), detail))
    if fmt in _RECORD_KEYS and not check.problems:
        _check_digest(check, state_dict, _FORMATS[fmt], [list(g.get("params", [])) for g in groups], record)
    if fmt in _RECORD_KEYS:
        kind, implementation, version = "native optimizer state dict", _IMPLEMENTATIONS[fmt], _FORMATS[fmt].version
    else:
        kind, implementation, version = "torch optimizer state dict", None, None
        fmt = "torch.optim state_dict"
        facts.append(("note", "torch's format (AdamW, ContractedAdamW, ...): no optimizer name is recorded"))
    facts.append(("param groups", str(len(groups))))
    return CheckpointDescription(
        path=path,
        kind=kind,
        format=fmt,
        format_version=version,
        implementation=implementation,
        parameters=tuple(parameters),
        facts=tuple(facts),
        verified=(
            "structure, shapes, dtypes, finiteness, counters and the state digest"
            if fmt in _RECORD_KEYS
            else "structure, shapes, dtypes, finiteness and counters (torch's format carries no digest)",
        ),
        problems=tuple(check.problems),
        file_bytes=file_bytes,
        tensor_bytes=_tensor_bytes(state_dict),
    )


def _describe_composite(state_dict: Mapping[str, Any], path: str, file_bytes: int | None) -> CheckpointDescription:
    check = _Checker()
    version = state_dict.get("format_version")
    if version != COMPOSITE_VERSION or type(version) is not int:
        check.fail("format_version", f"must be the int {COMPOSITE_VERSION}, got {version!r}")
    implementations = state_dict.get("child_implementations")
    if not isinstance(implementations, Mapping) or not implementations:
        check.fail("child_implementations", "must map each present role to its implementation")
        implementations = {}
    routing = state_dict.get("routing")
    routed: dict[str, int] = {}
    if not isinstance(routing, list) or any(not isinstance(r, list) or len(r) != 2 for r in routing):
        check.fail("routing", "must be a sorted list of [fqn, role] pairs")
    else:
        if routing != sorted(routing):
            check.fail("routing", "must be sorted by FQN")
        for fqn, role in routing:
            if role not in implementations:
                check.fail("routing", f"routes {fqn!r} to {role!r}, which has no child")
            routed[role] = routed.get(role, 0) + 1
    children = []
    halves: dict[str, Any] = {}
    if not check.problems and isinstance(routing, list):
        try:
            halves = children_of_state_dict(
                state_dict,
                implementations=dict(implementations),
                routing=[(fqn, role) for fqn, role in routing],
                group_counts=_group_counts(state_dict.get("param_groups"), implementations, routed),
            )
        except StateValidationError as exc:
            check.fail("top level", str(exc))
    for role, implementation in implementations.items():
        if role not in halves:
            continue
        described = describe_native(halves[role], f"{role} ({implementation})", None)
        children.append(described)
        if routed.get(role, 0) != len(described.parameters):
            check.fail(
                role, f"routing lists {routed.get(role, 0)} parameter(s), the child holds {len(described.parameters)}"
            )
    return CheckpointDescription(
        path=path,
        kind="composite native state dict",
        format=_COMPOSITE,
        format_version=version if type(version) is int else None,
        implementation="composite of " + ", ".join(f"{r}={i}" for r, i in implementations.items()),
        facts=(("roles", ", ".join(implementations)), ("routed parameters", str(sum(routed.values())))),
        verified=("envelope, routing and each child's structure",),
        problems=tuple(check.problems),
        children=tuple(children),
        file_bytes=file_bytes,
        tensor_bytes=_tensor_bytes(state_dict),
    )


def _group_counts(groups: object, implementations: Mapping[str, str], routed: Mapping[str, int]) -> dict[str, int]:
    """How many of the flat ``param_groups`` (muon first) each role holds, from how many
    parameters the routing gives it (the composite itself knows its children's group counts)."""
    counts = {role: 0 for role in implementations}
    if not isinstance(groups, list):
        return counts
    index = 0
    for role in ROLES:
        if role not in implementations:
            continue
        held = 0
        while index < len(groups) and held < routed.get(role, 0):
            params = groups[index].get("params") if isinstance(groups[index], Mapping) else None
            held += len(params) if isinstance(params, list) else 0
            counts[role] += 1
            index += 1
    return counts


def describe_native(state_dict: Mapping[str, Any], path: str, file_bytes: int | None) -> CheckpointDescription:
    """Describe and check a native state dict (module docstring)."""
    if state_dict.get("format") == _COMPOSITE:
        return _describe_composite(state_dict, path, file_bytes)
    return _describe_torch_shaped(state_dict, path, file_bytes)

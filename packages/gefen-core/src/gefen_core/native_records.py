"""The parts of a native state dict that Gefen's and GefenMuon's formats share, and their checks.

Both formats are torch-shaped (``{"state": {pid: {...}}, "param_groups": [...]}``) plus an
optimizer-common *record* (global step, codebook, deterministic policy, topology, ...) stored
twice: as top-level ``gefen_*`` keys and as a mirror in every group (torch's DCP helpers keep
only ``state`` and ``param_groups``). A :class:`NativeFormat` names one format's record;
:func:`native_state_dict` writes it and the functions below validate a loaded one, raising
:class:`~gefen_contracts.StateValidationError` that names what is wrong. Nothing here mutates
its inputs.

The mirror is one JSON string (:meth:`NativeFormat.mirror`, the codebook as its 256 floats), not
a dict: DCP writes every leaf of a state dict as an item of its own (about 1.5 KB of framing and
one ``torch.load`` each), and ``flatten_optimizer_state_dict=True`` (torchtitan's and
OLMo-core's recipe) repeats every group value under each parameter's FQN, so a dict mirror of
eight leaves cost eight items per parameter where the string costs one.

The record's ``state_digest`` (:func:`state_digest`) holds two SHA-256 over the format, the
rest of the record and every parameter's state entry in ``param_groups`` order (so it survives
torch's re-keying by FQN): one flipped bit in a saved tensor or counter is refused by
:func:`check_state_digest`. Tensor values are covered when both the saving and the loading
state hold plain tensors; a DTensor (FSDP2) state is covered by dtype and global shape only,
since DCP reshards its local pieces (``gefen_dcp.GefenDCPState`` digests every chunk of
those). Group hyperparameters (``lr``, ``betas``, ...) are not covered: users edit them in
checkpoints, and the load validates them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.torch_support import dtype_name, finite_bounds, names_mismatch, tensor_digest

from .codebook import validate_codebook
from .distributed import is_dtensor
from .errors import GefenOptionError, GefenOptionTypeError
from .momentum_codec import CODEBOOK_SIZE

__all__ = [
    "DIGEST_FIELD",
    "GROUP_MIRROR",
    "codebook_record",
    "NativeFormat",
    "check_common_record",
    "check_state_digest",
    "check_state_tensor",
    "check_top_level",
    "decode_mirror",
    "exact_int",
    "kept_live",
    "mirror_codebook",
    "fail",
    "native_state_dict",
    "parameter_slots",
    "reconcile_record",
    "stage_group",
    "state_digest",
    "with_state_digest",
]

#: The per-group copy of the optimizer-wide record. Live groups hold the key too (value ``None``;
#: ``state_dict()`` writes the record there): ``set_optimizer_state_dict`` with
#: ``flatten_optimizer_state_dict=True`` rebuilds a group from the live group's keys only.
GROUP_MIRROR = "_gefen_checkpoint_metadata"
_VERSION_KEY = "gefen_format_version"
#: The record field (and its top-level key) holding :func:`state_digest`; every format has it.
DIGEST_FIELD = ("state_digest", "gefen_state_digest")


@dataclass(frozen=True, slots=True)
class NativeFormat:
    """One native format: its name and version, and its record's ``(field, top-level key)`` pairs."""

    name: str
    version: int
    records: tuple[tuple[str, str], ...]
    optimizer: str

    @property
    def top_level_keys(self) -> tuple[str, ...]:
        return (_VERSION_KEY, *(key for _, key in self.records))

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.records)

    @property
    def covered_fields(self) -> tuple[str, ...]:
        """The record fields :func:`state_digest` covers (all but the digest itself)."""
        return tuple(name for name, _ in self.records if name != DIGEST_FIELD[0])

    def mirror(self, record: Mapping[str, Any]) -> str:
        """The per-group copy of ``record``, tagged with the format's name and version: canonical
        JSON (sorted keys, no whitespace), the codebook as its 256 floats (exact: a float32 is a
        float64, which JSON writes shortest-round-trip)."""
        fields = {f: record[f].tolist() if f == "codebook" else record[f] for f in self.fields}
        value = {"format": self.name, "format_version": self.version, **fields}
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def fail(message: str) -> StateValidationError:
    return StateValidationError(message)


def codebook_record(codebook: torch.Tensor | None) -> dict[str, Any]:
    """The record's codebook fields: always an fp32[256] tensor (zeros before one is learned) and
    a ``codebook_learned`` flag, so a fresh optimizer's state dict (the template torch's DCP
    helpers load into) has a tensor where the checkpoint has one."""
    if codebook is None:
        return {"codebook": torch.zeros(CODEBOOK_SIZE, dtype=torch.float32), "codebook_learned": False}
    return {"codebook": codebook.detach().clone(), "codebook_learned": True}


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a finite number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("a key appears twice")
    return value


def decode_mirror(mirror: object, where: str) -> dict[str, Any]:
    """A group mirror (:meth:`NativeFormat.mirror`) parsed: strict JSON (no duplicate keys, no
    ``NaN`` or ``Infinity``) holding an object. Which keys and types the record must hold is
    :func:`reconcile_record`'s to check; :func:`mirror_codebook` reads its codebook."""
    if type(mirror) is not str:
        raise fail(f"{where} must be the JSON string state_dict() writes, got {type(mirror).__name__}")
    try:
        value = json.loads(mirror, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:
        raise fail(f"{where} is not valid JSON: {exc}") from None
    if type(value) is not dict:
        raise fail(f"{where} must hold a JSON object, got {type(value).__name__}")
    return value


def mirror_codebook(codebook: object, where: str) -> torch.Tensor:
    """A mirror's codebook: a list of :data:`~gefen_core.momentum_codec.CODEBOOK_SIZE` floats,
    each a float32 value (one encoding per codebook), as a float32 tensor."""
    if type(codebook) is not list or len(codebook) != CODEBOOK_SIZE or any(type(c) is not float for c in codebook):
        raise fail(f"{where}: the codebook must be a list of {CODEBOOK_SIZE} floats")
    tensor = torch.tensor(codebook, dtype=torch.float32)
    if tensor.tolist() != codebook:
        raise fail(f"{where}: the codebook's entries must be float32 values")
    return tensor


def _tree(value: object, *, contents: bool) -> object:
    """``value`` as a digestable tree: tensors as their content (``contents``) or as dtype and
    (global) shape only."""
    if isinstance(value, torch.Tensor):
        if contents:
            return value
        return {"tensor": dtype_name(value.dtype), "shape": list(value.shape)}
    if isinstance(value, Mapping):
        return {str(key): _tree(item, contents=contents) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tree(item, contents=contents) for item in value]
    return value


def _holds_dtensor(value: object) -> bool:
    if isinstance(value, Mapping):
        return any(_holds_dtensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtensor(item) for item in value)
    return is_dtensor(value)


def state_digest(
    fmt: NativeFormat, ids: Sequence[Sequence[object]], state: Mapping[Any, Any], record: Mapping[str, Any]
) -> dict[str, str | None]:
    """``{"layout", "content"}``: two SHA-256 over the state entries in the order of ``ids``
    (one list per group; ``None`` for an id without state). ``layout`` covers ``fmt``, the
    record fields (the codebook's values included) and every entry with tensors as dtype and
    global shape; ``content`` covers every entry's tensor values and is ``None`` when an entry
    holds a DTensor (DCP reshards those, so their local values differ between layouts)."""
    entries = [state.get(pid) for group_ids in ids for pid in group_ids]
    covered = {name: record[name] for name in fmt.covered_fields}
    layout = tensor_digest(
        {"format": fmt.name, "version": fmt.version, "record": covered, "entries": _tree(entries, contents=False)}
    )
    content = None if _holds_dtensor(entries) else tensor_digest(_tree(entries, contents=True))
    return {"layout": layout, "content": content}


def _saving_order(groups: Sequence[object], ids: Sequence[Sequence[object]]) -> list[list[object]]:
    """The ids in the order the state was saved in: torch's ``set_optimizer_state_dict`` keys
    the state by name and lists a group's ``params`` as those names in the *live* order (a
    model or optimizer that lists them in another order), but passes the saved group's
    ``param_names`` through in the saved order, which the digest was computed in."""
    order: list[list[object]] = []
    for group, group_ids in zip(groups, ids, strict=True):
        names = group.get("param_names") if isinstance(group, Mapping) else None
        keys = [pid for pid in group_ids if type(pid) is str]
        if isinstance(names, list) and len(keys) == len(group_ids) and sorted(map(str, names)) == sorted(keys):
            order.append(list(names))
        else:
            order.append(list(group_ids))
    return order


def check_state_digest(
    fmt: NativeFormat,
    ids: Sequence[Sequence[object]],
    state: Mapping[Any, Any],
    record: Mapping[str, Any],
    *,
    cause: str | None = None,
    groups: Sequence[object] = (),
) -> None:
    """Refuse a state dict whose record, layout or (where both sides hold plain tensors)
    tensor values differ from what its ``state_digest`` was computed over. ``cause``: what
    the optimizer knows makes its entries differ (an option, a sharded mode), named by a
    refusal for differing entries instead of corruption. ``groups``: the saved groups, whose
    ``param_names`` give the saving order of name-keyed ids (:func:`_saving_order`)."""
    if groups:
        ids = _saving_order(groups, ids)
    saved = record[DIGEST_FIELD[0]]
    if not isinstance(saved, Mapping) or set(saved) != {"layout", "content"}:
        raise fail(f"state_digest must be a dict with 'layout' and 'content', got {type(saved).__name__}")
    try:
        digest = state_digest(fmt, ids, state, record)
    except Exception as exc:  # a value the digest grammar cannot encode (a non-finite float, ...)
        raise fail(f"the state dict cannot be digested ({exc}); it was not written by {fmt.optimizer}") from None
    both_plain = None not in (digest["content"], saved["content"])
    if digest["layout"] != saved["layout"] and not any(state.values()) and record.get("global_step"):
        # torch's _init_optim_state skips its zero-gradient step when any gradient is allocated,
        # so the template that dcp.load fills has no entries (the flattened recipe rebuilds them
        # empty from the live state) while the record says the optimizer stepped: a load that
        # would drop every state
        raise fail(
            "the state dict holds no per-parameter state, but the checkpoint it came from did: with torch's "
            "get_optimizer_state_dict as a template, torch creates the state only when no parameter has a "
            "gradient; call optimizer.zero_grad(set_to_none=True) before get_optimizer_state_dict"
        )
    if digest["layout"] != saved["layout"] and cause:
        raise fail(f"the state dict's entries do not match its state_digest: {cause}")
    if digest["layout"] != saved["layout"] or (both_plain and digest["content"] != saved["content"]):
        raise fail(
            f"the state dict's content does not match its state_digest (a flipped bit, a truncated or edited "
            f"tensor or counter, entries from another save, or a state_dict() kept in memory while the optimizer "
            f"stepped on: like torch's, its tensors are views of the live state, so copy.deepcopy it to keep a "
            f"snapshot); {fmt.optimizer} refuses it"
        )


def with_state_digest(fmt: NativeFormat, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` (top-level record, ``state`` and ``param_groups`` with their ids) with its
    :func:`state_digest` added at the top level (a native state dict built without
    :func:`native_state_dict`, such as a canonical import's)."""
    record = {name: state_dict[key] for name, key in fmt.records if name != DIGEST_FIELD[0]}
    ids = [list(group["params"]) for group in state_dict["param_groups"]]
    return {**state_dict, DIGEST_FIELD[1]: state_digest(fmt, ids, state_dict["state"], record)}


def native_state_dict(
    fmt: NativeFormat,
    param_groups: Sequence[Mapping[str, Any]],
    entries: dict[int, dict[str, Any]],
    record: Mapping[str, Any],
) -> dict[str, Any]:
    """``{"state": entries, "param_groups": [...], <top-level record>}``; ids are slot positions.

    ``record["codebook"]`` is the live codebook or ``None``; it is written as
    :func:`codebook_record`'s two fields. ``record``'s ``state_digest`` is computed here."""
    record = {**record, **codebook_record(record["codebook"])}
    ids: list[list[object]] = []
    pid = 0
    for group in param_groups:
        ids.append(list(range(pid, pid + len(group["params"]))))
        pid += len(group["params"])
    record[DIGEST_FIELD[0]] = state_digest(fmt, ids, entries, record)
    groups: list[dict[str, Any]] = []
    for group, group_ids in zip(param_groups, ids):
        saved = {key: value for key, value in group.items() if key != "params"}
        saved["params"] = group_ids
        saved[GROUP_MIRROR] = fmt.mirror(record)
        groups.append(saved)
    out: dict[str, Any] = {"state": entries, "param_groups": groups, _VERSION_KEY: fmt.version}
    for name, key in fmt.records:
        out[key] = record[name]
    return out


def exact_int(value: object, where: str, minimum: int) -> int:
    """An ``int`` (``bool`` refused) of at least ``minimum``."""
    if type(value) is not int:
        raise fail(f"{where} must be an int (bool rejected), got {type(value).__name__}")
    if value < minimum:
        raise fail(f"{where} must be >= {minimum}, got {value}")
    return value


def _same_tensor(a: object, b: object) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.detach().cpu(), b.detach().cpu())
    )


def kept_live(
    incoming: torch.Tensor, live: object, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor | None:
    """The live state tensor ``live`` when the validated local piece ``incoming`` is a view of
    its whole storage from the start (what this optimizer's own ``state_dict()`` hands out,
    and what torch's recipe passes back after ``dcp.load`` wrote into its template), so the
    load keeps it instead of copying the state it already holds; else ``None``.

    Keeping it changes nothing a load promises: the caller's tensor is the optimizer's own, so
    their values are one; a write into it between stage and commit bumps the live tensor's
    version and the commit is refused as stale. It saves a transient copy of the whole state
    (1 B/param for Gefen) on every recipe load."""
    if not isinstance(live, torch.Tensor) or tuple(live.shape) != shape or live.dtype != incoming.dtype:
        return None
    if live.device != device or not (live.is_contiguous() and incoming.is_contiguous()):
        return None
    if incoming.data_ptr() != live.data_ptr() or incoming.numel() > live.numel():
        return None
    return live


def check_top_level(state_dict: object, fmt: NativeFormat, live_groups: int) -> list[Any]:
    """The dict's shape: a mapping with ``state`` and ``param_groups`` (one per live group), no unknown keys."""
    if not isinstance(state_dict, Mapping):
        raise fail(f"a state dict must be a mapping, got {type(state_dict).__name__}")
    for key in ("state", "param_groups"):
        if key not in state_dict:
            raise fail(f"state_dict lacks {key!r}")
    _refuse_other_format(state_dict, fmt)
    unknown = set(state_dict) - {"state", "param_groups", *fmt.top_level_keys}
    if unknown:
        raise fail(f"state_dict has unknown top-level keys {sorted(map(str, unknown))}")
    groups = state_dict["param_groups"]
    if not isinstance(groups, list) or len(groups) != live_groups:
        count = len(groups) if isinstance(groups, list) else "no"
        raise fail(f"state_dict has {count} parameter groups, the optimizer has {live_groups}")
    return groups


def _refuse_other_format(state_dict: Mapping[str, Any], fmt: NativeFormat) -> None:
    """Name a checkpoint of another native format (Gefen's into GefenMuon, or back) by what its
    first group mirror says it is, before any check that would blame its version or its keys.
    An envelope that names its format (the composite's) is named by that: its first group is
    one child's."""
    envelope = state_dict.get("format")
    if isinstance(envelope, str) and envelope != fmt.name:
        raise fail(
            f"the checkpoint is a {envelope!r} checkpoint; {fmt.optimizer} reads {fmt.name!r} (another optimizer wrote it)"
        )
    groups = state_dict["param_groups"]
    first = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], Mapping) else {}
    raw = first.get(GROUP_MIRROR)
    if type(raw) is not str:
        return
    try:
        saved = json.loads(raw).get("format")
    except (ValueError, AttributeError, RecursionError):
        return  # malformed: reconcile_record says how
    if isinstance(saved, str) and saved != fmt.name:
        raise fail(
            f"the checkpoint is a {saved!r} checkpoint; {fmt.optimizer} reads {fmt.name!r} (another optimizer wrote it)"
        )


def reconcile_record(sd: Mapping[str, Any], fmt: NativeFormat) -> dict[str, Any]:
    """Reconcile the top-level record and the per-group mirrors (both, either, never neither)."""
    present = [key for key in fmt.top_level_keys if key in sd]
    top: dict[str, Any] | None = None
    if present:
        if _VERSION_KEY in sd and (sd[_VERSION_KEY] != fmt.version or type(sd[_VERSION_KEY]) is not int):
            raise fail(
                f"the checkpoint is {fmt.name} version {sd[_VERSION_KEY]!r}; {fmt.optimizer} reads version "
                f"{fmt.version} only (formats are 0.x: re-save it with the version that wrote it)"
            )
        if len(present) != len(fmt.top_level_keys):
            missing = sorted(set(fmt.top_level_keys) - set(present))
            raise fail(f"state_dict has some Gefen top-level keys but lacks {missing}")
        top = {name: sd[key] for name, key in fmt.records}
    mirrors = [g.get(GROUP_MIRROR) if isinstance(g, Mapping) else None for g in sd["param_groups"]]
    with_mirror = [m for m in mirrors if m is not None]
    if with_mirror and len(with_mirror) != len(mirrors):
        raise fail(f"{GROUP_MIRROR} is present on only some parameter groups")
    records = [] if top is None else [("top level", top)]
    if top is not None:
        _check_codebook_fields(top, "top level")
    expected_keys = {"format", "format_version", *fmt.fields}
    for index, raw in enumerate(with_mirror):
        where = f"param_groups[{index}][{GROUP_MIRROR!r}]"
        # a dict: a format before the JSON mirror, refused below naming its version
        mirror = raw if isinstance(raw, Mapping) else decode_mirror(raw, where)
        if mirror.get("format") != fmt.name or mirror.get("format_version") != fmt.version:
            raise fail(
                f"param_groups[{index}] holds format {mirror.get('format')!r} version "
                f"{mirror.get('format_version')!r}; {fmt.optimizer} reads {fmt.name!r} version {fmt.version}"
            )
        if type(raw) is not str:
            raise fail(f"{where} must be the JSON string state_dict() writes, got {type(raw).__name__}")
        if set(mirror) != expected_keys:
            raise fail(f"{where} has unexpected keys")
        record = {f: mirror[f] for f in fmt.fields}
        record["codebook"] = mirror_codebook(record["codebook"], where)
        _check_codebook_fields(record, f"param_groups[{index}] mirror")
        records.append((f"param_groups[{index}] mirror", record))
    if not records:
        raise fail(
            "state_dict carries no Gefen metadata (neither top-level gefen_* keys nor group mirrors); "
            f"it was not produced by {fmt.optimizer}.state_dict()"
        )
    first_where, first = records[0]
    for where, other in records[1:]:
        for key in fmt.fields:
            if key == "codebook":
                if not _same_tensor(first[key], other[key]):
                    raise fail(f"{where} and {first_where} disagree on the codebook")
            elif other[key] != first[key] or type(other[key]) is not type(first[key]):
                raise fail(f"{where} and {first_where} disagree on {key}")
    return first


def _check_codebook_fields(record: Mapping[str, Any], where: str) -> None:
    """The codebook is an fp32[256] tensor and ``codebook_learned`` a bool; an unlearned
    codebook is all zeros (a learned one is checked by :func:`validate_codebook`)."""
    learned, codebook = record["codebook_learned"], record["codebook"]
    if type(learned) is not bool:
        raise fail(f"{where}: codebook_learned must be a bool, got {type(learned).__name__}")
    if not isinstance(codebook, torch.Tensor) or codebook.dtype != torch.float32 or codebook.shape != (CODEBOOK_SIZE,):
        found = (
            type(codebook).__name__
            if not isinstance(codebook, torch.Tensor)
            else f"{codebook.dtype} {tuple(codebook.shape)}"
        )
        raise fail(
            f"{where}: the codebook must be a float32 tensor of {CODEBOOK_SIZE} entries "
            f"(zeros before one is learned), got {found}"
        )
    if not learned and bool(codebook.detach().ne(0).any()):
        raise fail(f"{where}: codebook_learned is False but the codebook is not all zeros")


def _first_difference(saved: object, live: object, where: str = "") -> tuple[str, object, object]:
    """The path of the first place two records differ, and the two values there."""
    if isinstance(saved, Mapping) and isinstance(live, Mapping) and saved.keys() == live.keys():
        for key in saved:
            if saved[key] != live[key]:
                return _first_difference(saved[key], live[key], f"{where}[{key!r}]")
    if isinstance(saved, list) and isinstance(live, list) and len(saved) == len(live):
        for index, (a, b) in enumerate(zip(saved, live)):
            if a != b:
                return _first_difference(a, b, f"{where}[{index}]")
    return where, saved, live


def check_common_record(
    record: Mapping[str, Any], *, deterministic: bool, topology: object = None, optimizer: str
) -> tuple[int, torch.Tensor | None]:
    """Global step, deterministic policy, topology (formats that record one) and codebook of a
    reconciled record."""
    global_step = exact_int(record["global_step"], "global_step", 0)
    if type(record["deterministic"]) is not bool:
        raise fail("the checkpoint's deterministic policy must be a bool")
    if record["deterministic"] != deterministic:
        raise fail(
            f"the checkpoint was produced with deterministic={record['deterministic']} but this optimizer has "
            f"deterministic={deterministic}; construct the optimizer with the checkpoint's policy"
        )
    if "topology" in record and record["topology"] != topology:
        where, saved, live = _first_difference(record["topology"], topology)
        raise fail(
            "the checkpoint's DTensor topology (mesh size, coordinate, placements, shapes) differs from the live one "
            f"at {where or 'the top'} (saved {saved!r}, live {live!r}); rank-local {optimizer} state loads only into the "
            "same topology, each rank its own torch.save (torch's DCP recipe keeps one rank's copy of this record)"
        )
    if not record["codebook_learned"]:
        return global_step, None
    return global_step, validate_codebook(record["codebook"], "codebook").clone()


def check_state_tensor(
    value: object, where: str, dtype: torch.dtype, shape: tuple[int, ...], *, finite_nonnegative: bool
) -> torch.Tensor:
    """A plain dense tensor of exactly ``dtype`` and ``shape`` (finite and >= 0 when asked)."""
    if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor:
        raise fail(f"{where} must be a plain tensor, got {type(value).__name__}")
    if value.layout is not torch.strided:
        raise fail(f"{where} must be a dense tensor")
    if value.dtype != dtype:
        raise fail(f"{where} must be {dtype}, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise fail(f"{where} must have shape {shape}, got {tuple(value.shape)}")
    if finite_nonnegative and value.numel():
        bounds = finite_bounds(value)
        if bounds is None:
            raise fail(f"{where} must be finite")
        if bounds[0] < 0:
            raise fail(f"{where} must be >= 0")
    return value


def stage_group(
    saved: object,
    live: Mapping[str, Any],
    index: int,
    *,
    required: Sequence[str],
    normalize: Callable[[Mapping[str, Any], int], dict[str, Any]],
) -> tuple[dict[str, Any], list[object]]:
    """A new group dict for live group ``index`` from its saved copy, and the saved parameter ids.

    ``required`` options must all be present; ``normalize(saved, index)`` validates them (its
    option errors become :class:`StateValidationError`). Names must match the live ones.
    """
    if not isinstance(saved, Mapping):
        raise fail(f"param_groups[{index}] must be a dict, got {type(saved).__name__}")
    ids = saved.get("params")
    count = len(live["params"])
    if not isinstance(ids, list) or len(ids) != count:
        raise fail(f"param_groups[{index}] must list exactly {count} parameter ids (a parameter group changed)")
    for pid in ids:
        if type(pid) not in (int, str):
            raise fail(f"param_groups[{index}] parameter ids must be ints or strings, got {type(pid).__name__}")
    missing = [name for name in required if name not in saved]
    if missing:
        raise fail(f"param_groups[{index}] lacks options {missing}")
    try:
        options = normalize(saved, index)
    except (GefenOptionError, GefenOptionTypeError) as exc:
        raise fail(f"invalid hyperparameter in the checkpoint: {exc}") from None
    new = {key: value for key, value in saved.items() if key not in ("params", "param_names", GROUP_MIRROR)}
    new.update(options)
    # copies, as torch's load deep-copies the saved groups: a mutable option (a dict, a list,
    # a tensor lr) must not stay shared with the caller's state dict or the optimizer it came from
    new = {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for key, value in new.items()
    }
    new[GROUP_MIRROR] = None
    live_names = live.get("param_names")
    if live_names is not None:
        mismatch = names_mismatch(saved["param_names"], live_names, ids) if "param_names" in saved else None
        if mismatch is not None:
            raise fail(f"param_groups[{index}] param_names differ from the live parameter names: {mismatch}")
        new["param_names"] = live_names
    elif "param_names" in saved:
        raise fail(f"param_groups[{index}] names its parameters but the live group is unnamed")
    new["params"] = live["params"]
    return new, ids


def parameter_slots(
    saved_ids: Sequence[list[object]], live_groups: Sequence[Mapping[str, Any]]
) -> dict[object, tuple[int, torch.Tensor, str]]:
    """Saved parameter id -> ``(slot, live parameter, where)``; ids must be unique."""
    by_id: dict[object, tuple[int, torch.Tensor, str]] = {}
    slot = 0
    for index, (ids, live) in enumerate(zip(saved_ids, live_groups)):
        names = live.get("param_names")
        for position, (pid, param) in enumerate(zip(ids, live["params"])):
            if pid in by_id:
                raise fail(f"parameter id {pid!r} appears twice")
            name = f"{names[position]!r}, " if names is not None and position < len(names) else ""
            by_id[pid] = (slot, param, f"state[{pid!r}] ({name}param_groups[{index}] position {position})")
            slot += 1
    return by_id

"""GefenMuon's native state dict (``gefen.muon_native_state`` v7): export and staged loading.

::

    {
      "state": {pid: {"step": int,
                      "m_codes": uint8[B, P], "m_magnitude": fp32[B, 1],
                      ["normuon_v": fp32[R, 1], "normuon_step": int]}},
      "param_groups": [{"params": [pid, ...], <the GefenMuon options>, ["param_names"],
                        "_gefen_checkpoint_metadata": <mirror of the record: one JSON string>}],
      "gefen_format_version": 7,
      "gefen_global_step": int,
      "gefen_codebook": fp32[256],                 # zeros until one is learned
      "gefen_codebook_learned": bool,
      "gefen_deterministic": bool,
      "gefen_topology": None | [None | {"mesh_size", "coordinate", "placement", "global_shape",
                                        "local_shape"} per slot],          # "approx" DTensors only
      "gefen_muon_owners": None | <owner manifest: one JSON string>,
      "gefen_state_digest": {"layout": str, "content": str | None},  # v2 had none
    }

Only tensors and primitives appear (``torch.load(weights_only=True)`` reads it). The block
period ``P`` is the codes' width (version 6 held the owner manifest as a dict at the top
level, whose leaves DCP keys by the number of distributed matrices, so a checkpoint saved on
several ranks found no such keys in a one-process template; version 5 held the mirror as a
dict, whose every leaf DCP writes as an item of its own; version 4 named the codes ``m_codebook``, version 3 also stored the
period as ``automatic_period``; each is refused naming both versions). Which state a
slot holds, and what it depends on:

* local and ``"exact"`` slots hold whole-matrix state, identical on every rank, so their
  checkpoints do not depend on the topology (no topology record);
* ``"approx"`` slots hold local rows: their topology record must match the live one;
* ``"distributed"`` slots hold state on their owner only, so ``state_dict()`` is **collective**
  (every rank must call it): it first gives every rank every owner's state
  (:func:`gefen_core.muon_owners.consolidate_states`) and records the *owner manifest*, the
  canonical JSON (sorted keys, no whitespace) of::

      {"ownership": "stable_index_mod_world", "consolidated": True, "world_size": W,
       "entries": [{"slot": int, "name": str, "shape": [R, C], "owner": int, "initialized": bool}]}

  Loading checks the manifest (owners follow the rule, names and shapes match the live
  parameters, a slot has state exactly when it was initialized) and keeps on each rank only
  the state of the matrices it owns under the **live** world size, which may differ from
  ``W`` (one process included). Being one string, the manifest is one DCP item whatever the
  world size, so torchtitan's FQN-keyed ``dcp.save(optimizer.state_dict())`` of a
  multi-rank run loads into a one-process template, whose manifest is ``None``.

Group options come from the checkpoint, as in torch; the live parameters' names must match.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import FeatureStatus
from gefen_contracts.torch_support import share_options, shared_tensor_options, with_rejoined_state

from .distributed import local_tensor, topology_record
from .muon_distributed import APPROX, DISTRIBUTED, MuonScope, build_scope, execution_mode
from .muon_options import MUON_GROUP_OPTIONS, normalize_muon_options
from .muon_state import MUON_KEYS, NORMUON_KEYS, NORMUON_STEP, NORMUON_V
from .native_records import (
    DIGEST_FIELD,
    NativeFormat,
    check_common_record,
    check_state_digest,
    check_state_tensor,
    check_top_level,
    decode_mirror,
    exact_int,
    fail,
    kept_live,
    native_state_dict,
    parameter_slots,
    reconcile_record,
    stage_group,
)
from .param_groups import check_names
from .param_state import INDICES, MAGNITUDE, STEP
from .periods import shape_period

__all__ = [
    "FORMAT",
    "OWNERSHIP",
    "SlotLayout",
    "StagedMuonState",
    "export_muon_state_dict",
    "muon_state_dict",
    "parameter_shaped_status",
    "slot_layouts",
    "stage_muon_group",
    "stage_muon_state_dict",
]

FORMAT = NativeFormat(
    "gefen.muon_native_state",
    7,
    (
        ("global_step", "gefen_global_step"),
        ("codebook", "gefen_codebook"),
        ("codebook_learned", "gefen_codebook_learned"),
        ("deterministic", "gefen_deterministic"),
        ("topology", "gefen_topology"),
        ("owners", "gefen_muon_owners"),
        DIGEST_FIELD,
    ),
    "GefenMuon",
)
OWNERSHIP = "stable_index_mod_world"
_ALL_KEYS = frozenset(MUON_KEYS) | frozenset(NORMUON_KEYS)
_VARIANTS = (frozenset(MUON_KEYS), _ALL_KEYS)


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """How one slot executes under given groups: its mode, owner (distributed) and state extent."""

    slot: int
    param: torch.Tensor
    name: str
    mode: str
    owner: int | None

    @property
    def rows(self) -> int:
        return int(local_tensor(self.param).shape[0]) if self.mode == APPROX else int(self.param.shape[0])

    @property
    def numel(self) -> int:
        return local_tensor(self.param).numel() if self.mode == APPROX else self.param.numel()


_FLATTENED = (
    "sharded_mode='distributed' state cannot go through torch's flattened recipe "
    "(flatten_optimizer_state_dict=True), which rebuilds entries from this rank's own state, and a rank holds "
    "only the matrices it owns; use the nested recipe or the native state_dict() (GefenDCPState refuses "
    "distributed mode too)"
)


def slot_layouts(param_groups: Sequence[Mapping[str, Any]]) -> tuple[list[SlotLayout], MuonScope | None]:
    """Every slot's layout under ``param_groups`` (their ``sharded_mode``), and the scope."""
    raw: list[tuple[torch.Tensor, str, str]] = []
    for index, group in enumerate(param_groups):
        check_names(group, index)
        names = group.get("param_names")
        for position, param in enumerate(group["params"]):
            name = str(names[position]) if names is not None else f"param_{len(raw)}"
            raw.append((param, name, execution_mode(param, group["sharded_mode"])))
    scope = build_scope([(p, m) for p, _, m in raw], [n for _, n, _ in raw])
    layouts, distributed = [], 0
    for slot, (param, name, mode) in enumerate(raw):
        owner = None
        if mode == DISTRIBUTED:
            assert scope is not None
            owner = distributed % scope.world
            distributed += 1
        layouts.append(SlotLayout(slot, param, name, mode, owner))
    return layouts, scope


def _topology(layouts: Sequence[SlotLayout]) -> list[dict[str, object] | None] | None:
    records = [topology_record(layout.param) if layout.mode == APPROX else None for layout in layouts]
    return records if any(r is not None for r in records) else None


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _entry(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: int(value) if key in (STEP, NORMUON_STEP) else value for key, value in state.items()}


def export_muon_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    states: Sequence[Mapping[str, Any] | None],
    layouts: Sequence[SlotLayout],
    scope: MuonScope | None,
    *,
    codebook: torch.Tensor | None,
    global_step: int,
    deterministic: bool,
) -> dict[str, Any]:
    """The native state dict; ``states`` are per slot, already consolidated for distributed slots."""
    entries = {layout.slot: _entry(state) for layout, state in zip(layouts, states) if state}
    owned = [layout for layout in layouts if layout.mode == DISTRIBUTED]
    owners: str | None = None
    if owned:
        assert scope is not None
        manifest = {
            "ownership": OWNERSHIP,
            "consolidated": True,
            "world_size": scope.world,
            "entries": [
                {
                    "slot": layout.slot,
                    "name": layout.name,
                    "shape": [int(d) for d in layout.param.shape],
                    "owner": layout.owner,
                    "initialized": layout.slot in entries,
                }
                for layout in owned
            ],
        }
        owners = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    record = {
        "global_step": global_step,
        "codebook": codebook,
        "deterministic": deterministic,
        "topology": _topology(layouts),
        "owners": owners,
    }
    return native_state_dict(FORMAT, param_groups, entries, record)


def muon_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    state: Mapping[torch.Tensor, Mapping[str, Any]],
    *,
    codebook: torch.Tensor | None,
    global_step: int,
    deterministic: bool,
) -> dict[str, Any]:
    """A live optimizer's native state dict; collective (consolidation) with distributed slots."""
    from .muon_owners import consolidate_states

    layouts, scope = slot_layouts(param_groups)
    states: list[Mapping[str, Any] | None] = [state.get(layout.param) or None for layout in layouts]
    owned = [layout for layout in layouts if layout.mode == DISTRIBUTED]
    if owned:
        assert scope is not None
        complete = consolidate_states(
            scope,
            [layout.owner or 0 for layout in owned],
            [(int(layout.param.shape[0]), int(layout.param.shape[1])) for layout in owned],
            [dict(states[layout.slot] or {}) or None for layout in owned],
        )
        for layout, consolidated in zip(owned, complete):
            states[layout.slot] = consolidated
    return export_muon_state_dict(
        param_groups, states, layouts, scope, codebook=codebook, global_step=global_step, deterministic=deterministic
    )


@dataclass(frozen=True, slots=True)
class StagedMuonState:
    """A validated load: new group dicts, new state (this rank's share), common values."""

    groups: tuple[dict[str, Any], ...]
    state: dict[torch.Tensor, dict[str, Any]]
    codebook: torch.Tensor | None
    global_step: int


def _check_owners(
    owners: object, layouts: Sequence[SlotLayout], initialized: set[int], scope: MuonScope | None
) -> None:
    if owners is None:
        return
    where = "the owner manifest (gefen_muon_owners)"
    manifest = decode_mirror(owners, where)
    if set(manifest) != {"ownership", "consolidated", "world_size", "entries"}:
        raise fail(f"{where} must hold exactly ownership, consolidated, world_size and entries")
    if manifest["ownership"] != OWNERSHIP:
        raise fail(f"{where} uses ownership {manifest['ownership']!r}; GefenMuon reads {OWNERSHIP!r}")
    if manifest["consolidated"] is not True:
        raise fail(f"{where} is not consolidated: it holds one rank's share, not every owner's state")
    world = exact_int(manifest["world_size"], f"{where} world_size", 1)
    entries = manifest["entries"]
    if not isinstance(entries, list):
        raise fail(f"{where} entries must be a list")
    by_slot = {layout.slot: layout for layout in layouts}
    seen: set[int] = set()
    for index, entry in enumerate(entries):
        label = f"{where} entry {index}"
        if not isinstance(entry, Mapping) or set(entry) != {"slot", "name", "shape", "owner", "initialized"}:
            raise fail(f"{label} must hold exactly slot, name, shape, owner and initialized")
        slot = exact_int(entry["slot"], f"{label} slot", 0)
        if slot in seen or slot not in by_slot:
            raise fail(f"{label} names slot {slot}, which is repeated or not a parameter of this optimizer")
        seen.add(slot)
        layout = by_slot[slot]
        if entry["name"] != layout.name:
            raise fail(f"{label} is named {entry['name']!r}, the live parameter {layout.name!r}")
        if entry["shape"] != [int(d) for d in layout.param.shape]:
            raise fail(f"{label} has shape {entry['shape']!r}, the live parameter {list(layout.param.shape)}")
        if exact_int(entry["owner"], f"{label} owner", 0) != index % world:
            raise fail(f"{label} owner {entry['owner']} breaks the rule owner = index mod world_size ({index % world})")
        if type(entry["initialized"]) is not bool or entry["initialized"] != (slot in initialized):
            if entry["initialized"] is True and scope is not None and layout.owner != scope.rank:
                # torch's flattened recipe rebuilds each entry from this rank's live state keys,
                # and a rank holds no state for a matrix it does not own
                raise fail(
                    f"{label} says initialized=True but the checkpoint holds no state for {layout.name!r}, "
                    f"which another rank owns: {_FLATTENED}"
                )
            raise fail(f"{label} says initialized={entry['initialized']!r} but the checkpoint disagrees")


def _entries_cause(
    new_groups: Sequence[Mapping[str, Any]],
    param_groups: Sequence[Mapping[str, Any]],
    layouts: Sequence[SlotLayout],
    scope: MuonScope | None,
) -> str | None:
    """Why a state dict's entries may differ from those its digest covers, as this optimizer
    knows it: torch's recipe builds its load template from this optimizer, and ``dcp.load`` fills
    only the entries the template has, without an error."""
    # normuon=True adds entries to normuon=False's (a change of Gefen's second moment swaps keys,
    # which DCP refuses itself)
    for new, live in zip(new_groups, param_groups):
        if new["normuon"] == live["normuon"]:
            continue
        return (
            f"the checkpoint was saved with normuon={new['normuon']!r} (here {live['normuon']!r}): torch's "
            "get_optimizer_state_dict builds a load template from this optimizer, and dcp.load fills only the entries "
            "the template has; build GefenMuon with the checkpoint's options to load it"
        )
    if scope is not None and scope.world > 1 and any(layout.mode == DISTRIBUTED for layout in layouts):
        return f"if it came through torch's flattened recipe: {_FLATTENED}"
    return None


def _stage_entry(
    entry: object, layout: SlotLayout, live_entry: Mapping[str, Any], where: str, global_step: int
) -> dict[str, Any] | None:
    if not isinstance(entry, Mapping):
        raise fail(f"{where} must be a dict, got {type(entry).__name__}")
    if not entry:
        return None
    keys = frozenset(entry)
    undeclared = sorted(map(str, keys - _ALL_KEYS))
    if undeclared:
        raise fail(f"{where} has undeclared keys {undeclared}")
    if keys not in _VARIANTS:
        missing = sorted((_ALL_KEYS if keys & frozenset(NORMUON_KEYS) else frozenset(MUON_KEYS)) - keys)
        raise fail(f"{where} matches no state variant: missing authoritative fields {missing}")
    numel = layout.numel
    codes = entry[INDICES]
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2 or codes.shape[1] < 1:
        raise fail(f"{where}[{INDICES!r}] must be a uint8 [blocks, period] tensor, got {_described(codes)}")
    period = int(codes.shape[1])
    # the period follows from the matrix's shape (a step makes state no other way), so a state of
    # a matrix of another shape with as many elements, (16, 32) into (32, 16), is refused here
    expected = shape_period(tuple(layout.param.shape), numel)
    if period != expected:
        raise fail(
            f"{where}[{INDICES!r}] holds blocks of {period}, but a {list(layout.param.shape)} matrix's state of "
            f"{numel} elements has blocks of {expected}: it was saved for a matrix of another shape"
        )
    step = exact_int(entry[STEP], f"{where}[{STEP!r}]", 1)
    if step > global_step:
        raise fail(f"{where}[{STEP!r}] {step} exceeds the global step {global_step}")
    device = local_tensor(layout.param).device
    blocks = numel // period
    tensors = {
        INDICES: check_state_tensor(
            entry[INDICES], f"{where}[{INDICES!r}]", torch.uint8, (blocks, period), finite_nonnegative=False
        ),
        MAGNITUDE: check_state_tensor(
            entry[MAGNITUDE], f"{where}[{MAGNITUDE!r}]", torch.float32, (blocks, 1), finite_nonnegative=True
        ),
    }
    staged: dict[str, Any] = {STEP: step}
    if NORMUON_V in keys:
        tensors[NORMUON_V] = check_state_tensor(
            entry[NORMUON_V], f"{where}[{NORMUON_V!r}]", torch.float32, (layout.rows, 1), finite_nonnegative=True
        )
        normuon_step = exact_int(entry[NORMUON_STEP], f"{where}[{NORMUON_STEP!r}]", 1)
        if normuon_step > step:
            raise fail(f"{where}[{NORMUON_STEP!r}] {normuon_step} exceeds step {step}")
        staged[NORMUON_STEP] = normuon_step
    for key, tensor in tensors.items():
        kept = kept_live(tensor, live_entry.get(key), tuple(tensor.shape), device)
        # contiguous whatever the saved strides: the kernels take dense row-major state only
        staged[key] = (
            kept
            if kept is not None
            else tensor.detach().to(device=device, copy=True, memory_format=torch.contiguous_format)
        )
    return staged


def stage_muon_group(saved: object, live: Mapping[str, Any], index: int) -> tuple[dict[str, Any], list[object]]:
    """A new group dict for live group ``index`` from its saved copy, and its saved parameter ids
    (every option GefenMuon requires, validated; ``gefen inspect`` applies the same rule)."""
    return stage_group(saved, live, index, required=MUON_GROUP_OPTIONS, normalize=normalize_muon_options)


def stage_muon_state_dict(
    state_dict: object,
    *,
    param_groups: Sequence[Mapping[str, Any]],
    live_state: Mapping[torch.Tensor, Mapping[str, Any]],
    deterministic: bool,
) -> StagedMuonState:
    """Validate ``state_dict`` against the live optimizer and stage this rank's share (no collective)."""
    state_dict = with_rejoined_state(state_dict)  # a plain dcp.load split each entry's counters off
    groups = check_top_level(state_dict, FORMAT, len(param_groups))
    assert isinstance(state_dict, Mapping)
    record = reconcile_record(state_dict, FORMAT)
    new_groups: list[dict[str, Any]] = []
    saved_ids: list[list[object]] = []
    for index, (saved, live) in enumerate(zip(groups, param_groups)):
        new, ids = stage_muon_group(saved, live, index)
        new_groups.append(new)
        saved_ids.append(ids)
    share_options(new_groups, shared_tensor_options(groups))
    layouts, scope = slot_layouts(new_groups)
    global_step, codebook = check_common_record(
        record, deterministic=deterministic, topology=_topology(layouts), optimizer="GefenMuon"
    )
    by_id = parameter_slots(saved_ids, param_groups)
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        raise fail(f"'state' must be a mapping, got {type(saved_state).__name__}")
    staged_slots: dict[int, dict[str, Any]] = {}
    for pid, entry in saved_state.items():
        found = by_id.get(pid) if type(pid) in (int, str) else None
        if found is None:
            raise fail(f"state entry {pid!r} names no parameter of this optimizer")
        slot, _, where = found
        staged = _stage_entry(entry, layouts[slot], live_state.get(layouts[slot].param, {}), where, global_step)
        if staged is not None:
            staged_slots[slot] = staged
    _check_owners(record["owners"], layouts, set(staged_slots), scope)
    if any(bool(s[MAGNITUDE].ne(0).any()) for s in staged_slots.values()) and codebook is None:
        raise fail("the checkpoint holds non-zero quantized momentum but no codebook")
    # last: a structurally wrong state dict gets the specific error above, not "digest mismatch"
    check_state_digest(
        FORMAT,
        saved_ids,
        saved_state,
        record,
        cause=_entries_cause(new_groups, param_groups, layouts, scope),
        groups=groups,
    )
    new_state = {
        layouts[slot].param: staged
        for slot, staged in staged_slots.items()
        if layouts[slot].mode != DISTRIBUTED or (scope is not None and layouts[slot].owner == scope.rank)
    }
    return StagedMuonState(tuple(new_groups), new_state, codebook, global_step)


def parameter_shaped_status(param_groups: Sequence[Mapping[str, Any]], bound: bool) -> FeatureStatus:
    """Whether the native state dict serves as parameter-shaped state (``parameter_shaped_state``):
    for plain matrices and ``"exact"`` DTensors, not under a ``post_sharding`` layout (cheap)."""
    if bound:
        return FeatureStatus.no(
            "a post_sharding layout (replicated copies or whole-parameter owners) is checkpointed as portable "
            "state (gefen_dcp.save_portable_dcp)"
        )
    try:
        modes = {layout.mode for layout in slot_layouts(param_groups)[0]}
    except Exception as exc:  # an invalid layout is reported by step(); here it only blocks the claim
        return FeatureStatus.no(f"the matrices' layout is invalid: {exc}")
    reasons = []
    if APPROX in modes:
        reasons.append(
            "sharded_mode='approx' keeps state for the local rows as plain tensors; checkpoint it with the native "
            "state_dict on the same layout or as portable state"
        )
    if DISTRIBUTED in modes:
        reasons.append(
            "sharded_mode='distributed' keeps each matrix's state on its owner only; checkpoint it with the "
            "native state_dict (consolidated, loads under any world size) or as portable state"
        )
    return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

"""Which name, position and shard each slot of a Gefen optimizer travels under in portable
state, and which group options travel with it.

* **Before ``post_sharding``** the layout is *implicit*: one ungrouped ``REPLICATED`` shard
  per parameter, keyed by torch's own ``param_names`` (what ``Gefen(model.named_parameters())``
  records). They must then exist for every parameter, be unique and be valid FQNs.
* **After ``post_sharding``** the optimizer's sealed layout
  (:class:`gefen_contracts.torch_support.SealedLayout`) supplies the manifest, every slot's
  original ``(group, slot)`` position and compatibility name, and the shard of each bound
  tensor; pruned non-owner slots of a whole-parameter-owner layout are listed without a
  tensor. The optimizer's ``_bound_layout()`` is the seam: ``None`` before ``post_sharding``, the sealed
  layout after it (:func:`gefen_core.identity.bound_layout`).

Options are every group key except ``params`` and ``param_names``, as primitives (tuples
become lists); a tensor ``lr`` or any other non-primitive value keeps the optimizer out of
these transports (the contract says why).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import FeatureStatus, NotSupportedError, StateValidationError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity
from gefen_contracts.naming import param_group_naming_blockers
from gefen_contracts.torch_support import SealedLayout

__all__ = [
    "NamedSlot",
    "adopted_groups",
    "find_slot",
    "implicit_shard",
    "named_slots",
    "naming_blockers",
    "option_blockers",
    "plain_options",
    "positional_state",
    "require_feature",
    "transport_options",
]

_NOT_OPTIONS = frozenset({"params", "param_names"})


@dataclass(frozen=True, slots=True, eq=False)
class NamedSlot:
    """One slot: its original position, its live tensor (``None`` when pruned), its live
    position in the group's ``params`` (``None`` when pruned), the name it travels under,
    its native (compatibility) name and its bound shard (``None`` in the implicit layout)."""

    group_index: int
    slot_index: int
    live_index: int | None
    tensor: torch.Tensor | None
    fqn: str
    compatibility_name: str
    shard: ShardIdentity | None

    @property
    def position(self) -> tuple[int, int]:
        return (self.group_index, self.slot_index)


def naming_blockers(param_groups: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Why the parameters of an optimizer without a sealed layout cannot be keyed by name."""
    return param_group_naming_blockers(param_groups, optimizer="the optimizer")


def named_slots(param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None) -> tuple[NamedSlot, ...]:
    """Every slot in original ``(group, slot)`` order (see the module docstring).

    Raises :class:`~gefen_contracts.StateValidationError` with the reasons of
    :func:`naming_blockers` when an optimizer without a sealed layout lacks usable names,
    or when the live groups no longer match the sealed layout.
    """
    if sealed is None:
        reasons = naming_blockers(param_groups)
        if reasons:
            raise StateValidationError("; ".join(reasons))
        return tuple(
            NamedSlot(g, k, k, tensor, str(group["param_names"][k]), str(group["param_names"][k]), None)
            for g, group in enumerate(param_groups)
            for k, tensor in enumerate(group["params"])
        )
    cursor = [0] * len(param_groups)
    slots = []
    for binding in sealed.slots:
        g = binding.group_index
        shard = binding.shard
        if shard.layout is ParameterLayout.WHOLE_PARAMETER_OWNER and not shard.is_owner:
            slots.append(
                NamedSlot(g, binding.original_slot_index, None, None, shard.fqn, binding.compatibility_name, shard)
            )
            continue
        params = param_groups[g]["params"] if g < len(param_groups) else []
        k = cursor[g] if g < len(cursor) else len(params)
        if k >= len(params):
            raise StateValidationError(f"the live param_groups[{g}] lost the tensor bound to {shard.fqn!r}")
        tensor = params[k]
        try:
            bound = sealed.shard_identity(tensor)
        except KeyError:
            bound = None
        if bound != shard:
            raise StateValidationError(f"param_groups[{g}]['params'][{k}] is not the tensor bound to {shard.fqn!r}")
        cursor[g] = k + 1
        slots.append(NamedSlot(g, binding.original_slot_index, k, tensor, shard.fqn, binding.compatibility_name, shard))
    return tuple(slots)


def find_slot(param_groups: Sequence[Mapping[str, Any]], sealed: SealedLayout | None, fqn: str) -> NamedSlot:
    """The slot named ``fqn`` (``KeyError`` when there is none)."""
    for slot in named_slots(param_groups, sealed):
        if slot.fqn == fqn:
            return slot
    raise KeyError(f"the optimizer has no parameter named {fqn!r}")


def implicit_shard(name: str, tensor: torch.Tensor) -> ShardIdentity:
    """The ungrouped ``REPLICATED`` shard of a parameter of the implicit layout."""
    identity = ParameterIdentity(name, tuple(int(d) for d in tensor.shape))
    return ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity))


def _listify(value: Any) -> Any:
    if type(value) in (list, tuple):
        return [_listify(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _listify(v) for k, v in value.items()}
    return value


def transport_options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's options as transport records hold them (see the module docstring)."""
    return {key: _listify(value) for key, value in group.items() if key not in _NOT_OPTIONS}


def plain_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options handed back by a transport (frozen mappings, tuples) as plain dicts and lists."""
    return {key: _listify(value) for key, value in options.items()}


def _primitive_problem(value: object, depth: int = 0) -> str | None:
    """``None`` when ``value`` is a primitive tree without tensors, else what is wrong."""
    if value is None or type(value) in (bool, int, str):
        return None
    if type(value) is float:
        return None if math.isfinite(value) else "a non-finite float"
    if depth < 8 and isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return next((p for v in value if (p := _primitive_problem(v, depth + 1)) is not None), None)
    if depth < 8 and isinstance(value, dict) and type(value) is dict:
        if any(type(key) is not str for key in value):
            return "a dict with non-str keys"
        return next((p for v in value.values() if (p := _primitive_problem(v, depth + 1)) is not None), None)
    return f"a {type(value).__name__}"


def option_blockers(param_groups: Sequence[Mapping[str, Any]], transport: str) -> tuple[str, ...]:
    """Why the group options cannot travel in a ``transport`` record (primitives only)."""
    reasons = []
    for index, group in enumerate(param_groups):
        for key, value in group.items():
            if key in _NOT_OPTIONS:
                continue
            problem = _primitive_problem(value)
            if problem is not None:
                hint = " (use a float lr, not a tensor)" if key == "lr" else ""
                reasons.append(
                    f"param_groups[{index}] option {key!r} holds {problem}; {transport} records hold primitive "
                    f"options only{hint}"
                )
    return tuple(reasons)


def require_feature(feature: str, status: FeatureStatus) -> None:
    """Raise :class:`~gefen_contracts.NotSupportedError` with the status's reasons unless supported."""
    if not status.supported:
        raise NotSupportedError(feature, status.reasons)


def adopted_groups(
    param_groups: Sequence[Mapping[str, Any]],
    records: Sequence[Sequence[tuple[str, dict[str, Any]]]],
    *,
    keep: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Each live group with the options recorded for its slots (``records[g]``: ``(fqn, options)``).

    The options of one group's slots must agree (types included); a group without records
    keeps its own. The result keeps the live ``params``, ``param_names`` and the options
    named in ``keep`` (the target's execution choices).
    """
    groups: list[dict[str, Any]] = []
    for index, (group, slots) in enumerate(zip(param_groups, records)):
        adopted = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if slots:
            first_fqn, first = slots[0]
            for fqn, options in slots[1:]:
                if not _same(first, options):
                    raise StateValidationError(
                        f"param_groups[{index}] holds {first_fqn!r} and {fqn!r}, whose recorded options differ; "
                        "regroup the target so that each group's parameters share their options"
                    )
            adopted = {**dict(first), **{key: group[key] for key in keep if key in group}}
        adopted["params"] = group["params"]
        if "param_names" in group:
            adopted["param_names"] = list(group["param_names"])
        groups.append(adopted)
    return groups


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def positional_state(groups: Sequence[Mapping[str, Any]], entries: Mapping[tuple[int, int], Any]) -> dict[int, Any]:
    """Entries keyed by ``(group, live index)`` re-keyed by native parameter id (position in
    ``groups`` order, as :func:`gefen_core.native_records.native_state_dict` numbers them)."""
    offsets, pid = [], 0
    for group in groups:
        offsets.append(pid)
        pid += len(group["params"])
    return {offsets[g] + k: entry for (g, k), entry in entries.items()}

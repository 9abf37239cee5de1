"""The composite's ``PortableAdapter`` and ``DenseShardCodec``, by delegation to its children.

:class:`CompositeExchangeMethods` is a base class of
:class:`~gefen_hybrid.composite.CompositeOptimizer`. Implementing both Protocols itself lets
the optimizer-agnostic free functions (``gefen_portable.export_portable_state`` /
``import_portable_state``, ``gefen_dcp.save_portable_dcp`` / ``load_portable_dcp``,
``gefen_dcp.GefenDCPState``) take a composite unchanged; ``gefen_portable``'s composite
wrapper (``export_portable_composite_state``) works on it too, child by child.

Portable state is one flat record of both children (no format of its own beyond these rules):

* implementation: the composite's; manifest: the union of the children's manifests (their
  FQNs are disjoint); slots: each child's slots in role order, at the position the slot has
  in the composite's ``param_groups`` (muon groups first) and under the child's native name;
* ``policy``: ``{"composite_format_version": 1, "roles": [...], "child_implementations":
  {role: name}, "child_policies": {role: the child's policy}}``; ``common``: ``{role: the
  child's common record}``;
* per slot: the child's options, counters and fields, and the variant ``"<role>.<variant>"``,
  so the record says which role trained each parameter.

Dense-shard state: ``common`` is ``{"composite_format_version": 1, "child_implementations":
{...}, "children": {role: the child's common record}}``; the slots are the union of the
children's (FQNs disjoint), each variant ``"<role>.<variant>"``.

Imports and loads are partitioned by the target's routing: a parameter saved under another
role, a foreign child implementation or policy, or a missing or extra parameter is refused.
Every child is prepared before any commits (a child that refuses leaves both untouched:
preparing mutates nothing); the commit claims the composite's transaction under its
freshness token (see :mod:`gefen_hybrid.composite_binding`) and then commits each child.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_DENSE_SHARD_CODEC,
    FEATURE_PORTABLE_STATE,
    DenseShardCodec,
    DenseShardLoad,
    DenseShardSlot,
    NotSupportedError,
    OptimizerContract,
    PortableExport,
    PortableLayout,
    PortableSlotLayout,
    PortableSlotState,
    ShardingManifest,
    StagedTransaction,
    StateValidationError,
    require_transaction,
)

from .composite_binding import ChangeCounter

__all__ = ["COMPOSITE_EXCHANGE_VERSION", "CompositeExchangeMethods"]

#: Version of the composite's portable policy and dense-shard common records.
COMPOSITE_EXCHANGE_VERSION = 1
_PORTABLE_KIND = "gefen.CompositeOptimizer.portable_import"
_DENSE_KIND = "gefen.CompositeOptimizer.dense_shard_load"
_POLICY_KEYS = {"composite_format_version", "roles", "child_implementations", "child_policies"}
_COMMON_KEYS = {"composite_format_version", "child_implementations", "children"}


def _fail(what: str, message: str) -> StateValidationError:
    return StateValidationError(f"composite {what}: {message}")


def _plain(value: Any) -> Any:
    """Mappings as ``dict`` and tuples as ``list``, recursively (tensors and primitives kept)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return [_plain(item) for item in value]
    return value


@dataclass(frozen=True, slots=True, eq=False)
class _Part:
    """One child's portable layout and where its groups start in the composite's ``param_groups``."""

    role: str
    child: Any
    layout: PortableLayout
    group_offset: int

    def composite_slot(self, slot: PortableSlotLayout) -> PortableSlotLayout:
        group, index = slot.position
        return PortableSlotLayout(slot.shard, (self.group_offset + group, index), slot.compatibility_name)


def _strip_role(role: str, variant: str, fqn: str, what: str) -> str:
    prefix = f"{role}."
    if not variant.startswith(prefix):
        source = variant.partition(".")[0] if "." in variant else "no role"
        raise _fail(
            what,
            f"parameter {fqn!r} was saved by {source!r} (variant {variant!r}) but routes to {role!r} here; "
            "the routing of the target differs from the source's",
        )
    return variant[len(prefix) :]


class CompositeExchangeMethods:
    """Portable state and dense-shard checkpoints for a composite (see the module docstring)."""

    _children: tuple[tuple[str, torch.optim.Optimizer], ...]
    _implementation: str
    _child_implementations: dict[str, str]
    _changes: ChangeCounter

    def optimizer_contract(self) -> OptimizerContract:
        raise NotImplementedError

    def _verify_identity(self, where: str) -> None:
        raise NotImplementedError

    def parameter_routing(self) -> tuple[tuple[str, str], ...]:
        raise NotImplementedError

    def _freshness(self) -> tuple[object, ...]:
        raise NotImplementedError

    def _ready(self, feature: str, where: str) -> None:
        self._verify_identity(where)
        self.optimizer_contract().require(feature)

    def _commit_children(self, kind: str, staged: StagedTransaction, method: str) -> None:
        payload = require_transaction(staged).claim(self, kind=kind, current_token=self._freshness())
        assert isinstance(payload, dict)
        for role, child in self._children:
            getattr(child, method)(payload[role])
        self._changes.bump()

    # -- PortableAdapter ------------------------------------------------------------------------

    def _portable_parts(self) -> list[_Part]:
        parts = []
        offset = 0
        for role, child in self._children:
            layout = child.portable_layout()  # type: ignore[attr-defined]
            parts.append(_Part(role, child, layout, offset))
            offset += len(child.param_groups)
        return parts

    def _composite_layout(self, parts: Sequence[_Part]) -> PortableLayout:
        shards = tuple(shard for part in parts for shard in part.layout.manifest.shards)
        slots = tuple(part.composite_slot(slot) for part in parts for slot in part.layout.slots)
        return PortableLayout(self._implementation, ShardingManifest(shards), slots)

    def portable_layout(self) -> PortableLayout:
        """Both children's layouts as one (see the module docstring); no state, no collective."""
        self._ready(FEATURE_PORTABLE_STATE, "portable_layout")
        return self._composite_layout(self._portable_parts())

    def portable_export(self) -> PortableExport:
        """Both children's exports as one record: role-tagged variants, policies and common state."""
        self._ready(FEATURE_PORTABLE_STATE, "portable_export")
        parts = self._portable_parts()
        layout = self._composite_layout(parts)
        slots: list[PortableSlotState] = []
        policies: dict[str, Any] = {}
        common: dict[str, Any] = {}
        for part in parts:
            exported = part.child.portable_export()
            if type(exported) is not PortableExport or len(exported.slots) != len(part.layout.slots):
                raise _fail("portable state", f"child {part.role!r} exported a record that does not match its layout")
            policies[part.role] = _plain(exported.policy)
            common[part.role] = _plain(exported.common)
            for state in exported.slots:
                slots.append(
                    PortableSlotState(
                        part.composite_slot(state.layout),
                        state.options,
                        f"{part.role}.{state.variant}",
                        state.counters,
                        element_fields=state.element_fields,
                        replica_fields=state.replica_fields,
                    )
                )
        policy = {
            "composite_format_version": COMPOSITE_EXCHANGE_VERSION,
            "roles": [part.role for part in parts],
            "child_implementations": {part.role: self._child_implementations[part.role] for part in parts},
            "child_policies": policies,
        }
        return PortableExport(self._implementation, policy, common, layout.manifest, tuple(slots))

    def _child_policies(self, implementation: str, policy: Mapping[str, Any], common: Mapping[str, Any]) -> Any:
        what = "portable state"
        if implementation != self._implementation:
            raise _fail(
                what, f"the state was exported by {implementation!r}, this composite is {self._implementation!r}"
            )
        roles = [role for role, _ in self._children]
        expected = {role: self._child_implementations[role] for role in roles}
        if not isinstance(policy, Mapping) or set(policy) != _POLICY_KEYS:
            keys = sorted(policy) if isinstance(policy, Mapping) else type(policy).__name__
            raise _fail(what, f"policy must have the keys {sorted(_POLICY_KEYS)}, got {keys}")
        if policy["composite_format_version"] != COMPOSITE_EXCHANGE_VERSION:
            raise _fail(what, f"policy composite_format_version must be {COMPOSITE_EXCHANGE_VERSION}")
        if _plain(policy["roles"]) != roles or _plain(policy["child_implementations"]) != expected:
            raise _fail(
                what,
                f"the source's children {_plain(policy['child_implementations'])} differ from this composite's "
                f"{expected}",
            )
        policies = policy["child_policies"]
        if not isinstance(policies, Mapping) or set(policies) != set(roles):
            raise _fail(what, f"policy child_policies must have one entry per role {roles}")
        if not isinstance(common, Mapping) or set(common) != set(roles):
            raise _fail(what, f"common must have one entry per role {roles}")
        return policies

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        """Check the composite's own records, partition the slots by role and prepare every child
        (nothing is mutated; a child's refusal propagates with both children untouched)."""
        self._ready(FEATURE_PORTABLE_STATE, "portable_prepare_import")
        policies = self._child_policies(implementation, policy, common)
        parts = self._portable_parts()
        slots = tuple(slots)
        if len(slots) != sum(len(part.layout.slots) for part in parts):
            raise _fail("portable state", f"expected one slot record per local slot, got {len(slots)}")
        cursor = iter(slots)
        staged: dict[str, StagedTransaction] = {}
        for part in parts:
            child_slots = []
            for own in part.layout.slots:
                incoming = next(cursor)
                if type(incoming) is not PortableSlotState or incoming.layout != part.composite_slot(own):
                    raise _fail(
                        "portable state", f"slot records must follow portable_layout(); {own.fqn!r} is out of place"
                    )
                variant = _strip_role(part.role, incoming.variant, own.fqn, "portable state")
                child_slots.append(
                    PortableSlotState(
                        own,
                        incoming.options,
                        variant,
                        incoming.counters,
                        element_fields=incoming.element_fields,
                        replica_fields=incoming.replica_fields,
                    )
                )
            staged[part.role] = part.child.portable_prepare_import(
                implementation=self._child_implementations[part.role],
                policy=policies[part.role],
                common=common[part.role],
                slots=child_slots,
            )
        return StagedTransaction(self, kind=_PORTABLE_KIND, token=self._freshness(), payload=staged)

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        """Publish every child's prepared import (single use; ``StaleTransactionError`` and no
        change when the composite or a child changed since preparation)."""
        self._verify_identity("portable_commit_import")
        self._commit_children(_PORTABLE_KIND, staged, "portable_commit_import")

    # -- DenseShardCodec ------------------------------------------------------------------------

    def _dense_routing(self) -> dict[str, tuple[str, Any]]:
        routing: dict[str, tuple[str, Any]] = {}
        for role, child in self._children:
            for slot in child.dense_shard_slots():  # type: ignore[attr-defined]
                if slot.fqn in routing:
                    raise _fail("dense-shard state", f"parameter {slot.fqn!r} is listed by two children")
                routing[slot.fqn] = (role, child)
        return routing

    def dense_shard_common(self) -> Mapping[str, Any]:
        """The children's common records by role, with their implementations."""
        self._ready(FEATURE_DENSE_SHARD_CODEC, "dense_shard_common")
        return {
            "composite_format_version": COMPOSITE_EXCHANGE_VERSION,
            "child_implementations": dict(self._child_implementations),
            "children": {role: _plain(child.dense_shard_common()) for role, child in self._children},  # type: ignore[attr-defined]
        }

    def dense_shard_slots(self) -> tuple[DenseShardSlot, ...]:
        """The union of the children's slots, each variant tagged ``"<role>.<variant>"``."""
        self._ready(FEATURE_DENSE_SHARD_CODEC, "dense_shard_slots")
        slots = []
        seen: set[str] = set()
        for role, child in self._children:
            for slot in child.dense_shard_slots():  # type: ignore[attr-defined]
                if slot.fqn in seen:
                    raise _fail("dense-shard state", f"parameter {slot.fqn!r} is listed by two children")
                seen.add(slot.fqn)
                slots.append(
                    DenseShardSlot(
                        slot.fqn, slot.parameter, slot.options, f"{role}.{slot.variant}", slot.counters, slot.fields
                    )
                )
        return tuple(slots)

    def materialize_dense_field(self, fqn: str, field: str) -> Any:
        """The owning child's field (``KeyError`` for an unknown parameter or field)."""
        self._verify_identity("materialize_dense_field")  # called per field: no contract derivation
        role = dict(self.parameter_routing()).get(fqn)
        if role is None:
            raise KeyError(f"the composite has no parameter named {fqn!r}")
        child = dict(self._children)[role]
        if not isinstance(child, DenseShardCodec):
            raise NotSupportedError(FEATURE_DENSE_SHARD_CODEC, (f"child {role!r} is not a DenseShardCodec",))
        return child.materialize_dense_field(fqn, field)

    def prepare_dense_shard_load(
        self, common: Mapping[str, Any], slots: Mapping[str, DenseShardLoad]
    ) -> StagedTransaction:
        """Check the common record, partition the loads by the live routing and prepare every child
        (nothing is mutated; a child's refusal propagates with both children untouched)."""
        self._ready(FEATURE_DENSE_SHARD_CODEC, "prepare_dense_shard_load")
        what = "dense-shard state"
        if not isinstance(common, Mapping) or set(common) != _COMMON_KEYS:
            keys = sorted(common) if isinstance(common, Mapping) else type(common).__name__
            raise _fail(what, f"common must have the keys {sorted(_COMMON_KEYS)}, got {keys}")
        if common["composite_format_version"] != COMPOSITE_EXCHANGE_VERSION:
            raise _fail(what, f"common composite_format_version must be {COMPOSITE_EXCHANGE_VERSION}")
        if _plain(common["child_implementations"]) != self._child_implementations:
            raise _fail(
                what,
                f"the source's children {_plain(common['child_implementations'])} differ from this composite's "
                f"{self._child_implementations}",
            )
        children_common = common["children"]
        if not isinstance(children_common, Mapping) or set(children_common) != {r for r, _ in self._children}:
            raise _fail(what, "common children must have one entry per role")
        routing = self._dense_routing()
        if set(slots) != set(routing):
            missing, extra = sorted(set(routing) - set(slots)), sorted(set(slots) - set(routing))
            raise _fail(
                what, f"the loaded parameters differ from the live ones (missing {missing[:5]}, unexpected {extra[:5]})"
            )
        parts: dict[str, dict[str, DenseShardLoad]] = {role: {} for role, _ in self._children}
        for fqn, load in slots.items():
            role = routing[fqn][0]
            if type(load) is not DenseShardLoad:
                raise _fail(what, f"parameter {fqn!r}: expected a DenseShardLoad, got {type(load).__name__}")
            variant = _strip_role(role, load.variant, fqn, what)
            parts[role][fqn] = DenseShardLoad(fqn, load.options, variant, load.counters, load.fields)
        staged = {
            role: child.prepare_dense_shard_load(children_common[role], parts[role])  # type: ignore[attr-defined]
            for role, child in self._children
        }
        return StagedTransaction(self, kind=_DENSE_KIND, token=self._freshness(), payload=staged)

    def commit_dense_shard_load(self, staged: StagedTransaction) -> None:
        """Publish every child's prepared load (single use; ``StaleTransactionError`` and no change
        when the composite or a child changed since preparation)."""
        self._verify_identity("commit_dense_shard_load")
        self._commit_children(_DENSE_KIND, staged, "commit_dense_shard_load")

"""The composite's ``DenseShardCodec``, by delegation to its children.

:class:`CompositeDenseShardMethods` is a base class of
:class:`~gefen_hybrid.composite.CompositeOptimizer`, so ``gefen_dcp.GefenDCPState`` saves and
reshards a composite as it does any codec (FSDP2 N -> M ranks, beside the model):

* ``dense_shard_common()``: ``{"composite_format_version": 1, "child_implementations": {role:
  name}, "children": {role: the child's common record}}``;
* ``dense_shard_slots()``: the union of the children's slots (their FQNs are disjoint), each
  variant tagged ``"<role>.<variant>"`` so the checkpoint records which role trained it;
* ``materialize_dense_field(fqn, field)``: the owning child's, found by the routing;
* ``prepare_dense_shard_load(common, slots)``: the loads are partitioned by the live routing
  (a parameter saved under another role, another child implementation, or a missing or extra
  parameter is refused) and every child is prepared before any commits; preparing mutates
  nothing, so a child that refuses leaves both untouched;
* ``commit_dense_shard_load(staged)``: claims the composite's transaction under its freshness
  token (see :mod:`gefen_hybrid.composite_binding`), then commits each child.

Portable state needs no method here: gefen-portable's composite wrapper
(``export_portable_composite_state``) and gefen-dcp's ``save_portable_dcp`` serve a composite
through its children's ``PortableAdapter`` methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_DENSE_SHARD_CODEC,
    DenseShardCodec,
    DenseShardLoad,
    DenseShardSlot,
    NotSupportedError,
    OptimizerContract,
    StagedTransaction,
    StateValidationError,
    require_transaction,
)

from .composite_binding import ChangeCounter

__all__ = ["COMPOSITE_DENSE_SHARD_VERSION", "CompositeDenseShardMethods"]

#: Version of the composite's dense-shard common record.
COMPOSITE_DENSE_SHARD_VERSION = 1
_DENSE_KIND = "gefen.CompositeOptimizer.dense_shard_load"
_COMMON_KEYS = {"composite_format_version", "child_implementations", "children"}


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"composite dense-shard state: {message}")


def _plain(value: Any) -> Any:
    """Mappings as ``dict`` and tuples as ``list``, recursively (tensors and primitives kept)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return [_plain(item) for item in value]
    return value


def _strip_role(role: str, variant: str, fqn: str) -> str:
    prefix = f"{role}."
    if not variant.startswith(prefix):
        source = variant.partition(".")[0] if "." in variant else "no role"
        raise _fail(
            f"parameter {fqn!r} was saved by {source!r} (variant {variant!r}) but routes to {role!r} here; "
            "the routing of the target differs from the source's",
        )
    return variant[len(prefix) :]


class CompositeDenseShardMethods:
    """Dense-shard checkpoints for a composite (see the module docstring)."""

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

    def _ready(self, where: str) -> None:
        self._verify_identity(where)
        self.optimizer_contract().require(FEATURE_DENSE_SHARD_CODEC)

    # -- DenseShardCodec ------------------------------------------------------------------------

    def _dense_routing(self) -> dict[str, tuple[str, Any]]:
        routing: dict[str, tuple[str, Any]] = {}
        for role, child in self._children:
            for slot in child.dense_shard_slots():  # type: ignore[attr-defined]
                if slot.fqn in routing:
                    raise _fail(f"parameter {slot.fqn!r} is listed by two children")
                routing[slot.fqn] = (role, child)
        return routing

    def dense_shard_common(self) -> Mapping[str, Any]:
        """The children's common records by role, with their implementations."""
        self._ready("dense_shard_common")
        return {
            "composite_format_version": COMPOSITE_DENSE_SHARD_VERSION,
            "child_implementations": dict(self._child_implementations),
            "children": {role: _plain(child.dense_shard_common()) for role, child in self._children},  # type: ignore[attr-defined]
        }

    def dense_shard_slots(self) -> tuple[DenseShardSlot, ...]:
        """The union of the children's slots, each variant tagged ``"<role>.<variant>"``."""
        self._ready("dense_shard_slots")
        slots = []
        seen: set[str] = set()
        for role, child in self._children:
            for slot in child.dense_shard_slots():  # type: ignore[attr-defined]
                if slot.fqn in seen:
                    raise _fail(f"parameter {slot.fqn!r} is listed by two children")
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
        self._ready("prepare_dense_shard_load")
        if not isinstance(common, Mapping) or set(common) != _COMMON_KEYS:
            keys = sorted(common) if isinstance(common, Mapping) else type(common).__name__
            raise _fail(f"common must have the keys {sorted(_COMMON_KEYS)}, got {keys}")
        if common["composite_format_version"] != COMPOSITE_DENSE_SHARD_VERSION:
            raise _fail(f"common composite_format_version must be {COMPOSITE_DENSE_SHARD_VERSION}")
        if _plain(common["child_implementations"]) != self._child_implementations:
            raise _fail(
                f"the source's children {_plain(common['child_implementations'])} differ from this composite's "
                f"{self._child_implementations}",
            )
        children_common = common["children"]
        if not isinstance(children_common, Mapping) or set(children_common) != {r for r, _ in self._children}:
            raise _fail("common children must have one entry per role")
        routing = self._dense_routing()
        if set(slots) != set(routing):
            missing, extra = sorted(set(routing) - set(slots)), sorted(set(slots) - set(routing))
            raise _fail(
                f"the loaded parameters differ from the live ones (missing {missing[:5]}, unexpected {extra[:5]})"
            )
        parts: dict[str, dict[str, DenseShardLoad]] = {role: {} for role, _ in self._children}
        for fqn, load in slots.items():
            role = routing[fqn][0]
            if type(load) is not DenseShardLoad:
                raise _fail(f"parameter {fqn!r}: expected a DenseShardLoad, got {type(load).__name__}")
            variant = _strip_role(role, load.variant, fqn)
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
        payload = require_transaction(staged).claim(self, kind=_DENSE_KIND, current_token=self._freshness())
        assert isinstance(payload, dict)
        for role, child in self._children:
            child.commit_dense_shard_load(payload[role])  # type: ignore[attr-defined]
        self._changes.bump()

"""Conformance checks for the portable claims, contributed to the kit through ``gefen.conformance``.

* ``portable.roundtrip`` (``feature:portable_state`` and ``checkpoint:canonical_global:replicated``):
  export, materialize, ``torch.save`` +
  ``torch.load(weights_only=True)``, import into a fresh twin; the twin's native state must
  equal the source's bit for bit (a lossy export that re-exports identically is caught
  here), the re-export's digest must be the document's, the document must not change when
  the source trains on (an export must not alias live state), then both continue bit for bit.
* ``portable.atomic_import`` (``checkpoint:canonical_global:replicated:atomic``): corrupted
  documents (a flipped tensor byte, edited fields with and without a recomputed digest, a
  foreign implementation, a missing parameter, a wrong shape, a non-finite value) must each
  be refused with a typed error and leave the optimizer and model deep-snapshot unchanged.

Both run in one process with a one-member checkpoint binding; a composite whose children are
adapters is checked through the composite wrapper. Claims about other layouts and topology
transitions need several processes and a factory that can build sharded optimizers, so they
stay unverified here (gefen-portable's own gloo tests cover the machinery).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from gefen_contracts import (
    CompositeOptimizer,
    ContractError,
    ContractTypeError,
    NotSupportedError,
    ParameterLayout,
    PortableAdapter,
    PortableStateLimits,
    ProcessGroupIdentity,
    StaleTransactionError,
)
from gefen_contracts.testing import CheckContext, ConformanceCheck, deep_snapshot, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.context import Unverifiable
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, tensor_digest

from .composite import export_portable_composite_state, import_portable_composite_state, wrapper_payload
from .document import reseal_document
from .export import export_portable_state
from .importer import import_portable_state

__all__ = ["PortableAtomicImportCheck", "PortableRoundTripCheck", "checks"]

_TRANSPORT = "canonical_global"
_REPLICATED = f"checkpoint:{_TRANSPORT}:{ParameterLayout.REPLICATED.value}"
_LIMITS = PortableStateLimits()
_TYPED = (ContractError, ContractTypeError, NotSupportedError, StaleTransactionError)


def checks() -> Iterable[ConformanceCheck]:
    """The entry point of the ``gefen.conformance`` group."""
    return (PortableRoundTripCheck(), PortableAtomicImportCheck())


def _adapters(optimizer: Any) -> list[Any]:
    if isinstance(optimizer, PortableAdapter):
        return [optimizer]
    if isinstance(optimizer, CompositeOptimizer):
        children = list(optimizer.child_optimizers().values())
        if children and all(isinstance(c, PortableAdapter) for c in children):
            return children
    raise AssertionError("claims portable_state but neither is a PortableAdapter nor a composite of adapters")


def _binding(optimizer: Any) -> CheckpointProcessGroupBinding:
    groups = set()
    for adapter in _adapters(optimizer):
        for shard in adapter.portable_layout().manifest.shards:
            groups.add(shard.process_group)
    grouped = {g for g in groups if g is not None}
    if len(grouped) > 1:
        raise Unverifiable("the optimizer's parameters use several process groups")
    identity = grouped.pop() if grouped else ProcessGroupIdentity("conformance", ("member:0",))
    if len(identity.ordered_members) != 1:
        raise Unverifiable(f"the optimizer is laid out over {len(identity.ordered_members)} members")
    return CheckpointProcessGroupBinding(identity, identity.ordered_members[0], None, torch.device("cpu"))


def _require_replicated(optimizer: Any) -> None:
    layouts = {s.layout for a in _adapters(optimizer) for s in a.portable_layout().manifest.shards}
    if layouts != {ParameterLayout.REPLICATED}:
        raise Unverifiable(f"the single-process optimizer is laid out as {sorted(x.value for x in layouts)}")


def _export(optimizer: Any, binding: CheckpointProcessGroupBinding, label: str) -> dict[str, Any]:
    if isinstance(optimizer, PortableAdapter):
        state = export_portable_state(optimizer, checkpoint_process_group=binding, transaction_id=label, limits=_LIMITS)
        return state.materialize()
    composite = export_portable_composite_state(
        optimizer, checkpoint_process_group=binding, transaction_id=label, limits=_LIMITS
    )
    return composite.materialize()


def _import(optimizer: Any, document: Any, binding: CheckpointProcessGroupBinding, label: str) -> None:
    if isinstance(optimizer, PortableAdapter):
        import_portable_state(
            optimizer, document, checkpoint_process_group=binding, transaction_id=label, limits=_LIMITS
        )
    else:
        import_portable_composite_state(
            optimizer, document, checkpoint_process_group=binding, transaction_id=label, limits=_LIMITS
        )


class PortableRoundTripCheck:
    """Export -> weights-only document -> import into a fresh twin -> identical re-export and
    bit-exact continuation."""

    name = "portable.roundtrip"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({"feature:portable_state", _REPLICATED}) & claims

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model, optimizer = context.trained(steps)
        binding = _binding(optimizer)
        _require_replicated(optimizer)
        before = deep_snapshot(optimizer, model)
        document = _export(optimizer, binding, "conformance-export")
        diffs = snapshot_diff(before, optimizer, model)
        assert not diffs, "exporting portable state changed the optimizer: " + "; ".join(diffs[:3])
        saved = context.weights_only_roundtrip(document)
        twin_model, twin = context.fresh()
        context.copy_parameters(model, twin_model)
        _import(twin, saved, binding, "conformance-import")
        assert_trees_equal(optimizer.state_dict(), twin.state_dict(), "native state after a portable import")
        again = _export(twin, binding, "conformance-re-export")
        assert again["completion"]["digest"] == document["completion"]["digest"], (
            "re-exporting the imported state gives a different document (the import lost or changed state)"
        )
        exported = deep_snapshot(document)
        context.train(model, optimizer, steps, start=steps)
        diffs = snapshot_diff(exported, document)
        assert not diffs, "the exported document changed when the optimizer stepped (it aliases live state): " + (
            "; ".join(diffs[:3])
        )
        context.train(twin_model, twin, steps, start=steps)
        context.assert_models_bitwise_equal(model, twin_model, "continuation after a portable round trip")
        context.notes.append("round trip, identical re-export and bit-exact continuation")


def _edits(document: dict[str, Any]) -> list[tuple[str, Callable[[dict[str, Any]], None], bool]]:
    """(name, in-place edit, reseal the digest afterwards) for one plain document."""

    def some_parameter(doc: dict[str, Any]) -> dict[str, Any]:
        for record in doc["parameters"].values():
            if record["fields"] or record["counters"]:
                return record  # type: ignore[no-any-return]
        first: dict[str, Any] = next(iter(doc["parameters"].values()))
        return first

    def fragment_fields(doc: dict[str, Any], floating: bool = False) -> Iterator[tuple[dict[str, Any], str]]:
        for record in doc["parameters"].values():
            for frag in record["fragments"]:
                for name, value in frag["fields"].items():
                    if value.numel() and (value.is_floating_point() or not floating):
                        yield frag["fields"], name

    def flip_tensor(doc: dict[str, Any]) -> None:
        for fields, name in fragment_fields(doc):
            value = fields[name]
            value.view(-1)[0] = value.view(-1)[0] + 1
            return
        doc["implementation"] = doc["implementation"] + ".x"

    def bump_counter(doc: dict[str, Any]) -> None:
        record = some_parameter(doc)
        if record["counters"]:
            name = sorted(record["counters"])[0]
            record["counters"][name] += 1
        else:
            record["counters"]["gefen_conformance_counter"] = 1

    def negative_counter(doc: dict[str, Any]) -> None:
        record = some_parameter(doc)
        record["counters"][sorted(record["counters"] or {"step": 0})[0]] = -1

    def foreign_implementation(doc: dict[str, Any]) -> None:
        doc["implementation"] = "gefen_conformance.Foreign"

    def drop_parameter(doc: dict[str, Any]) -> None:
        doc["parameters"].pop(sorted(doc["parameters"])[0])

    def wrong_shape(doc: dict[str, Any]) -> None:
        for fields, name in fragment_fields(doc):
            value = fields[name]
            fields[name] = torch.cat([value.reshape(-1), torch.zeros(1, dtype=value.dtype)])
            return
        doc["parameters"][sorted(doc["parameters"])[0]]["identity"]["global_shape"].append(2)

    def non_finite(doc: dict[str, Any]) -> None:
        for fields, name in fragment_fields(doc, floating=True):
            fields[name].view(-1)[0] = float("nan")
            return
        doc["policy"]["gefen_conformance_nan"] = float("nan")

    def unknown_variant(doc: dict[str, Any]) -> None:
        some_parameter(doc)["variant"] = "gefen_conformance_unknown_variant"

    def extra_key(doc: dict[str, Any]) -> None:
        doc["gefen_conformance_extra"] = 1

    return [
        ("flipped tensor value", flip_tensor, False),
        ("edited counter", bump_counter, False),
        ("negative counter (digest recomputed)", negative_counter, True),
        ("foreign implementation (digest recomputed)", foreign_implementation, True),
        ("missing parameter (digest recomputed)", drop_parameter, True),
        ("wrong field shape (digest recomputed)", wrong_shape, True),
        ("non-finite value (digest recomputed)", non_finite, True),
        ("unknown variant (digest recomputed)", unknown_variant, True),
        ("unexpected top-level key", extra_key, False),
    ]


def _reseal(document: dict[str, Any]) -> None:
    # A payload the digest cannot hold (a NaN float) keeps its old digest; it is refused anyway.
    with contextlib.suppress(Exception):
        reseal_document(document)


def _corrupt(document: dict[str, Any], edit: Callable[[dict[str, Any]], None], reseal: bool) -> dict[str, Any]:
    """A deep copy with ``edit`` applied (to the first child of a composite wrapper)."""
    copied = copy.deepcopy(document)
    if "parameters" in copied:
        edit(copied)
        if reseal:
            _reseal(copied)
        return copied
    role = copied["roles"][0]
    edit(copied["children"][role])
    if reseal:
        _reseal(copied["children"][role])
        digests = {r: child["completion"]["digest"] for r, child in copied["children"].items()}
        wrapper = wrapper_payload(copied["implementation"], tuple(copied["roles"]), copied["routing"], digests)
        copied["completion"]["digest"] = tensor_digest(wrapper)
    return copied


class PortableAtomicImportCheck:
    """Corrupted portable documents are refused with a typed error and change nothing."""

    name = "portable.atomic_import"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({f"{_REPLICATED}:atomic"}) & claims

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        _source_model, source = context.trained(steps)
        binding = _binding(source)
        _require_replicated(source)
        document = _export(source, binding, "conformance-atomic-export")
        model, optimizer = context.trained(steps + 1)
        problems: list[str] = []
        for name, edit, reseal in _edits(document):
            corrupted = _corrupt(document, edit, reseal)
            before = deep_snapshot(optimizer, model)
            try:
                _import(optimizer, corrupted, binding, "conformance-atomic-import")
            except _TYPED:
                pass
            except Exception as exc:
                problems.append(f"{name}: refused with an untyped {type(exc).__name__}: {exc}")
            else:
                problems.append(f"{name}: the corrupted document was accepted")
                continue
            diffs = snapshot_diff(before, optimizer, model)
            if diffs:
                problems.append(f"{name}: a refused import changed the optimizer: " + "; ".join(diffs[:3]))
        assert not problems, "; ".join(problems)
        context.notes.append(f"{len(_edits(document))} corrupted documents refused without mutation")

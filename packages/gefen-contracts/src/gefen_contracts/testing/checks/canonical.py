"""Canonical local state as an executed check: export, a weights-only round trip, import into a
reordered fresh twin and bit-exact continuation; prepare mutates neither side; stale, reused
and foreign preparations are refused without mutation; corrupted documents are refused."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from ...enums import CheckpointTransport, ParameterLayout
from ...errors import StaleTransactionError
from ...protocols import CanonicalLocalState, IdentityBindable
from ..claims import atomic_claim, checkpoint_claim
from ..context import CheckContext
from ..snapshot import deep_snapshot, snapshot_diff
from .checkpoint import assert_trees_equal
from .refusals import expect_refusal
from .twins import BoundTwin, build_model_and_optimizer, named_trainable

__all__ = ["CanonicalLocalCheck", "corrupted_documents"]

FEATURE = "feature:canonical_local_state"
_TRANSPORT = CheckpointTransport.CANONICAL_LOCAL.value
_REPL = ParameterLayout.REPLICATED.value
_ENVELOPE = ("format", "format_version", "coverage", "implementation")


def _parameter_tables(document: Any, depth: int = 0) -> Iterator[dict[str, Any]]:
    """Every ``parameters`` table in a document: its own, or its nested parts' (a composite
    nests its children's documents)."""
    if type(document) is not dict or depth > 4:
        return
    if type(document.get("parameters")) is dict:
        yield document["parameters"]
        return
    for value in document.values():
        yield from _parameter_tables(value, depth + 1)


def _first_table(document: dict[str, Any]) -> dict[str, Any] | None:
    return next((t for t in _parameter_tables(document) if t), None)


def _first_state_tensor(document: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    for entry in (e for t in _parameter_tables(document) for e in t.values()):
        state = entry.get("state") if isinstance(entry, dict) else None
        if isinstance(state, dict):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0:
                    return state, key
    return None


def _first_state(document: dict[str, Any], minimum: int) -> dict[str, Any] | None:
    for entry in (e for t in _parameter_tables(document) for e in t.values()):
        state = entry.get("state") if isinstance(entry, dict) else None
        if isinstance(state, dict) and len(state) >= minimum:
            return state
    return None


def _edits() -> list[tuple[str, Callable[[dict[str, Any]], bool]]]:
    def setter(key: str, value: object) -> Callable[[dict[str, Any]], bool]:
        def edit(doc: dict[str, Any]) -> bool:
            doc[key] = value
            return True

        return edit

    def policy(doc: dict[str, Any]) -> bool:
        if not isinstance(doc.get("policy"), dict):
            return False
        doc["policy"]["kit.extra"] = 1
        return True

    def drop_parameter(doc: dict[str, Any]) -> bool:
        table = _first_table(doc)
        if table is None:
            return False
        table.pop(next(iter(table)))
        return True

    def rename_parameter(doc: dict[str, Any]) -> bool:
        table = _first_table(doc)
        if table is None:
            return False
        table["kit.renamed"] = table.pop(next(iter(table)))
        return True

    def variant(doc: dict[str, Any]) -> bool:
        table = _first_table(doc)
        entry = next(iter(table.values())) if table else None
        if not isinstance(entry, dict) or "variant" not in entry:
            return False
        entry["variant"] = "kit.no_such_variant"
        return True

    def nan(doc: dict[str, Any]) -> bool:
        found = _first_state_tensor(doc)
        if found is None:
            return False
        state, key = found
        state[key] = torch.full_like(state[key], float("nan"))
        return True

    def shape(doc: dict[str, Any]) -> bool:
        found = _first_state_tensor(doc)
        if found is None:
            return False
        state, key = found
        state[key] = torch.cat([state[key].reshape(-1), state[key].reshape(-1)[:1]])
        return True

    def unknown_key(doc: dict[str, Any]) -> bool:
        state = _first_state(doc, 1)
        if state is None:
            return False
        state["kit_unknown"] = torch.zeros(1)
        return True

    def dropped_key(doc: dict[str, Any]) -> bool:
        state = _first_state(doc, 2)
        if state is None:
            return False
        state.pop(next(iter(state)))
        return True

    def manifest(doc: dict[str, Any]) -> bool:
        record = doc.get("manifest")
        if not isinstance(record, dict) or not isinstance(record.get("shards"), list) or len(record["shards"]) < 2:
            return False
        record["shards"] = record["shards"][:-1]
        return True

    return [
        ("format_version_bool", setter("format_version", True)),
        ("implementation", setter("implementation", "kit.another_optimizer")),
        ("unknown_top_level_key", setter("kit_extra", 1)),
        ("policy", policy),
        ("missing_parameter", drop_parameter),
        ("renamed_parameter", rename_parameter),
        ("variant", variant),
        ("non_finite_state", nan),
        ("wrong_state_shape", shape),
        ("unknown_state_key", unknown_key),
        ("missing_state_key", dropped_key),
        ("manifest", manifest),
    ]


def corrupted_documents(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Corrupted deep copies of a canonical local document, one per applicable class.

    Every class breaks a rule any honest importer checks: envelope constants, implementation,
    policy, the FQN set, FQN keys, declared variants, finite values, state shapes and key
    sets, and the manifest. Per-parameter classes edit the first ``parameters`` table found,
    so a composite's nested child documents are corrupted too.
    """
    for name, edit in _edits():
        corrupted = copy.deepcopy(document)
        if edit(corrupted):
            yield name, corrupted


class _Subject:
    """A model and an optimizer ready for canonical state (finalized first when the optimizer
    needs ``post_sharding`` for canonical FQNs)."""

    def __init__(self, context: CheckContext, bind: bool, seed: int = 0, *, reverse: bool = False) -> None:
        if bind:
            twin = BoundTwin.replicated(context, seed, reverse=reverse)
            self.model, self.optimizer = twin.model, twin.optimizer
        else:
            self.model, self.optimizer = build_model_and_optimizer(context, seed, reverse=reverse)


class CanonicalLocalCheck:
    """Claimed canonical local state works end to end (see the module docstring)."""

    name = "checkpoint.canonical_local"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        wanted = {FEATURE, checkpoint_claim(_TRANSPORT, _REPL), atomic_claim(_TRANSPORT, _REPL)}
        return frozenset(wanted) & claims

    def run(self, context: CheckContext) -> None:
        _, fresh = build_model_and_optimizer(context)
        ready = fresh.optimizer_contract().capabilities.supports("canonical_local_state")  # type: ignore[attr-defined]
        bind = not ready and isinstance(fresh, IdentityBindable) and "feature:post_sharding" in context.claims
        steps = context.target.steps
        source = _Subject(context, bind)
        context.train(source.model, source.optimizer, steps)
        optimizer = source.optimizer
        if not isinstance(optimizer, CanonicalLocalState):
            raise AssertionError("claims canonical_local_state without implementing CanonicalLocalState")
        problems: list[str] = []
        before = deep_snapshot(optimizer, source.model)
        exported = optimizer.export_local_state()
        diffs = snapshot_diff(before, optimizer, source.model)
        if diffs:
            problems.append("export_local_state() changed the optimizer: " + "; ".join(diffs[:3]))
        document = context.weights_only_roundtrip(exported)
        missing = [key for key in _ENVELOPE if key not in document]
        assert not missing, f"the document lacks the envelope keys {missing}"
        fqns = sorted(name for name, _ in named_trainable(source.model))
        keyed = sorted(fqn for table in _parameter_tables(document) for fqn in table)
        assert keyed == fqns, f"the document's parameter entries {keyed} are not keyed by the FQNs {fqns}"
        reference = context.weights_only_roundtrip(document)
        target = _Subject(context, bind, 1, reverse=True)
        context.copy_parameters(source.model, target.model)
        before = deep_snapshot(target.optimizer, target.model)
        staged = target.optimizer.prepare_local_import(document)
        diffs = snapshot_diff(before, target.optimizer, target.model)
        if diffs:
            problems.append("prepare_local_import() changed the optimizer: " + "; ".join(diffs[:3]))
        assert_trees_equal(document, reference, "the document after prepare_local_import")
        target.optimizer.commit_local_import(staged)
        roots = (target.optimizer, target.model)
        expect_refusal(
            problems,
            "a prepared import committed twice",
            roots,
            lambda: target.optimizer.commit_local_import(staged),
            StaleTransactionError,
        )
        exported_before = deep_snapshot(exported)
        context.train(source.model, source.optimizer, steps, start=steps)
        aliased = snapshot_diff(exported_before, exported)
        if aliased:  # the document must be a snapshot, not a view of live state
            problems.append(
                "the exported document changed when the optimizer stepped (it aliases live state): "
                + "; ".join(aliased[:3])
            )
        context.train(target.model, target.optimizer, steps, start=steps)
        context.assert_models_bitwise_equal(
            source.model, target.model, "continuation after a canonical-local round trip"
        )
        stale = target.optimizer.prepare_local_import(document)
        context.train(target.model, target.optimizer, 1, start=2 * steps)
        expect_refusal(
            problems,
            "an import prepared before a step",
            roots,
            lambda: target.optimizer.commit_local_import(stale),
            StaleTransactionError,
        )
        other = _Subject(context, bind, 2)
        foreign = target.optimizer.prepare_local_import(document)
        expect_refusal(
            problems,
            "an import prepared by another optimizer",
            (other.optimizer, other.model),
            lambda: other.optimizer.commit_local_import(foreign),
            StaleTransactionError,
        )
        if atomic_claim(_TRANSPORT, _REPL) in context.claims:
            tried = 0
            for name, corrupted in corrupted_documents(document):
                tried += 1
                expect_refusal(
                    problems,
                    f"a corrupted document ({name})",
                    (other.optimizer, other.model),
                    partial(other.optimizer.prepare_local_import, corrupted),
                    Exception,
                )
            context.notes.append(f"{tried} corrupted documents refused without mutation")
        assert not problems, "; ".join(problems)

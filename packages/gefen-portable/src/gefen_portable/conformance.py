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
* ``portable.reshard`` (with ``feature:post_sharding``: ``checkpoint:canonical_global:
  flattened_element_shard`` and its ``:atomic``, and the ``placement_reshard`` transitions
  between ``replicated`` and ``flattened_element_shard``): the kit's own gloo ranks rebuild
  the target from ``MODULE:FACTORY`` and bind it with ``post_sharding``
  (:class:`~gefen_contracts.testing.gloo_members.GlooMember`). It runs flattened 2 members
  -> the same layout, replicated 1 process -> 2 replicated members, 1 process <-> 2
  flattened members and 2 -> 3 flattened members, and holds what the importing contracts'
  ``TopologyTransition.update_rtol`` states. The same layout must continue bit for bit.
  Across layouts the state is compared through the transition and its reverse (another
  layout may train differently, so only a twin of the source layout can tell a lost state
  from a different optimizer): a twin of the source imports the target's re-export and takes
  the next step from the same parameters and gradient as the uninterrupted source. Exact
  both ways (``0.0``): its document and its update equal the source's bit for bit.
  Approximate: its update is within the two ``update_rtol`` added (relative L2). A
  transition claimed one way only is imported and continued (finite losses). Every
  corrupted document is refused by both flattened members without mutation.

The first two run in one process with a one-member checkpoint binding; a composite whose
children are adapters is checked through the composite wrapper. Owner layouts
(``whole_parameter_owner``) and ``world_size_owner_redistribution`` transitions are not
executed by these checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from gefen_contracts.enums import ParameterLayout, TopologyChange
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.protocols import Composite, PortableAdapter
from gefen_contracts.testing import (
    CheckContext,
    ConformanceCheck,
    GlooWorld,
    RankFailure,
    deep_snapshot,
    snapshot_diff,
)
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.claims import atomic_claim, checkpoint_claim, transition_claim
from gefen_contracts.testing.context import Unverifiable
from gefen_contracts.torch_support import CheckpointProcessGroupBinding

from . import conformance_ranks as ranks

__all__ = [
    "RESHARD_CASES",
    "PortableAtomicImportCheck",
    "PortableReshardCheck",
    "PortableRoundTripCheck",
    "checks",
]

_TRANSPORT = "canonical_global"
_REPLICATED = f"checkpoint:{_TRANSPORT}:{ParameterLayout.REPLICATED.value}"
_FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD.value
_OWNER = ParameterLayout.WHOLE_PARAMETER_OWNER.value
#: Same-layout claim -> the GlooMember ``(layout, members)`` that saves and reloads it.
SAME_LAYOUT_CASES: dict[str, ranks.Member] = {_FLAT: ("flattened", 2), _OWNER: ("owner", 2)}
#: ``(source layout, target layout)`` claim -> the GlooMember ``(layout, members)`` it runs.
RESHARD_CASES: dict[tuple[str, str], tuple[ranks.Member, ranks.Member]] = {
    ("replicated", "replicated"): (("single", 1), ("replicated", 2)),
    ("replicated", _FLAT): (("single", 1), ("flattened", 2)),
    (_FLAT, "replicated"): (("flattened", 2), ("single", 1)),
    (_FLAT, _FLAT): (("flattened", 2), ("flattened", 3)),
    ("replicated", _OWNER): (("single", 1), ("owner", 2)),
    (_OWNER, "replicated"): (("owner", 2), ("single", 1)),
    (_OWNER, _OWNER): (("owner", 2), ("owner", 3)),
    (_FLAT, _OWNER): (("flattened", 2), ("owner", 3)),
    (_OWNER, _FLAT): (("owner", 3), ("flattened", 2)),
}


def checks() -> Iterable[ConformanceCheck]:
    """The entry point of the ``gefen.conformance`` group."""
    return (PortableRoundTripCheck(), PortableAtomicImportCheck(), PortableReshardCheck())


def _adapters(optimizer: Any) -> list[Any]:
    if isinstance(optimizer, PortableAdapter):
        return [optimizer]
    if isinstance(optimizer, Composite):
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
        document = ranks.export_document(optimizer, binding, "conformance-export")
        diffs = snapshot_diff(before, optimizer, model)
        assert not diffs, "exporting portable state changed the optimizer: " + "; ".join(diffs[:3])
        saved = context.weights_only_roundtrip(document)
        twin_model, twin = context.fresh()
        context.copy_parameters(model, twin_model)
        ranks.import_document(twin, saved, binding, "conformance-import")
        assert_trees_equal(optimizer.state_dict(), twin.state_dict(), "native state after a portable import")
        again = ranks.export_document(twin, binding, "conformance-re-export")
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
        document = ranks.export_document(source, binding, "conformance-atomic-export")
        model, optimizer = context.trained(steps + 1)
        variants = ranks.corruptions(document)
        problems = []
        for name, corrupted in variants:
            problem = ranks.refuse_attempt(optimizer, model, corrupted, binding)
            if problem:
                problems.append(f"{name}: {problem}")
        assert not problems, "; ".join(problems)
        context.notes.append(f"{len(variants)} corrupted documents refused without mutation")


def _transitions(source: str, target: str) -> frozenset[str]:
    """The transition claims ``source -> target`` of every kind (one case executes them all)."""
    return frozenset(transition_claim(_TRANSPORT, source, target, kind.value) for kind in TopologyChange)


def _first_error(failure: RankFailure) -> str:
    failed = next(o for o in failure.outcomes if not o.ok)
    return f"rank {failed.rank} raised {failed.error_type}: {failed.message}"


def _verdict(claim: str, what: str, outcome: dict[str, Any], *, same: bool, back: bool) -> list[str]:
    """What breaks the contract's promise for one case (see :class:`PortableReshardCheck`)."""
    rtol = outcome["update_rtol"]
    if rtol is None:
        return [f"{claim}: the importing optimizer's contract declares no such transition"]
    if not all(math.isfinite(loss) for loss in outcome["resumed"]):
        return [f"{claim}: the continuation after {what} is not finite"]
    if same:  # the same layout: bit for bit
        if outcome["bit_exact_continuation"]:
            return []
        return [f"{claim}: the continuation after {what} is not bit for bit"]
    if not back:
        return []  # a one-way transition: imported and continued; its state cannot be compared
    back_rtol = outcome["back_rtol"]
    gap = outcome["round_trip_update_gap"]
    if rtol == 0.0 and back_rtol == 0.0:
        if gap != 0.0 or not outcome["round_trip_identical"]:
            return [f"{claim}: declared exact both ways, but the state changed through {what} and back ({gap:.2e})"]
        return []
    bound = rtol + (back_rtol or 0.0)
    if not gap <= bound:
        return [
            f"{claim}: after {what} and back the first update differs by {gap:.2e} (update_rtol {rtol} + {back_rtol})"
        ]
    return []


class PortableReshardCheck:
    """Flattened portable state and the replicated/flattened transitions, executed on the
    kit's own gloo ranks from ``MODULE:FACTORY`` (module docstring)."""

    name = "portable.reshard"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        if not {"feature:portable_state", "feature:post_sharding"} <= claims:
            return frozenset()
        wanted = {checkpoint_claim(_TRANSPORT, layout) for layout in SAME_LAYOUT_CASES}
        wanted |= {atomic_claim(_TRANSPORT, layout) for layout in SAME_LAYOUT_CASES}
        for source, target in RESHARD_CASES:
            wanted |= _transitions(source, target)
        return frozenset(wanted) & claims

    def run(self, context: CheckContext) -> None:
        spec = context.target.spec
        if spec is None:
            raise Unverifiable("portable resharding needs an importable MODULE:FACTORY target for spawned ranks")
        if not torch.distributed.is_available():
            raise Unverifiable("torch.distributed is not available")
        claims = self.covers(context.claims)
        steps = context.target.steps
        cases: list[tuple[str, ranks.Member, ranks.Member, bool]] = []
        for layout, member in SAME_LAYOUT_CASES.items():
            if checkpoint_claim(_TRANSPORT, layout) in claims:
                cases.append((checkpoint_claim(_TRANSPORT, layout), member, member, True))
        for (source, target), (members, onto) in RESHARD_CASES.items():
            claimed = _transitions(source, target) & claims
            if claimed:
                back = bool(_transitions(target, source) & context.claims)
                cases.append((", ".join(sorted(claimed)), members, onto, back))
        problems: list[str] = []
        executed: list[str] = []
        with GlooWorld(3) as world:
            for claim, members, onto, back in cases:
                try:
                    outcome = world.run(ranks.transition, spec, members, onto, steps, back)[0]
                except RankFailure as failure:
                    problems.append(f"{claim}: {_first_error(failure)}")
                    continue
                what = f"{members[1]} {members[0]} -> {onto[1]} {onto[0]}"
                problems += _verdict(claim, what, outcome, same=members == onto, back=back)
                rtol, gap = outcome["update_rtol"], outcome.get("round_trip_update_gap")
                measured = f", next update {gap:.1e} away" if back and gap else ""
                bound = f"approximate, update_rtol {rtol}" if rtol else "exact"
                executed.append(f"{what}{' and back' if back else ''} ({bound}{measured})")
            for layout, member in SAME_LAYOUT_CASES.items():
                claim = atomic_claim(_TRANSPORT, layout)
                if claim not in claims:
                    continue
                try:
                    refused = world.run(ranks.refuse_corrupted, spec, member, steps)
                except RankFailure as failure:
                    refused = [[_first_error(failure)]]
                problems += [f"{claim}: rank {r}: {p}" for r, found in enumerate(refused) for p in found]
                executed.append(f"corrupted documents refused on {member[1]} {member[0]} members")
        assert not problems, "; ".join(problems)
        context.notes.append("; ".join(executed))

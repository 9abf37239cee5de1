"""Document plumbing and spawned-rank functions of gefen-portable's conformance checks.

:func:`export_document` / :func:`import_document` move an optimizer's portable state (an
adapter's or a composite's) through a complete weights-only document; :func:`corruptions`
lists the corrupted variants of one. Rank functions take ``(rank, world_size, spec, ...)``,
rebuild the target from its ``MODULE:FACTORY`` spec and bind it with
:class:`~gefen_contracts.testing.gloo_members.GlooMember`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from gefen_contracts import (
    CollectiveFailureError,
    ContractError,
    ContractTypeError,
    NotSupportedError,
    StaleTransactionError,
)
from gefen_contracts.enums import CheckpointTransport, ParameterLayout
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.protocols import Composite, PortableAdapter
from gefen_contracts.testing import deep_snapshot, load_target, snapshot_diff
from gefen_contracts.testing.gloo_members import GlooMember, init_member_groups, share
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, tensor_digest

from .composite import export_portable_composite_state, import_portable_composite_state, wrapper_payload
from .document import reseal_document
from .export import export_portable_state
from .importer import import_portable_state

__all__ = [
    "LIMITS",
    "TYPED_REFUSALS",
    "corruptions",
    "export_document",
    "import_document",
    "refuse_corrupted",
    "stated_update_rtol",
    "transition",
    "update_gap",
]

#: Small chunks, so every field of the kit's model spans several.
LIMITS = PortableStateLimits(chunk_bytes=4096)
#: What a refused import may raise (on several members, the collective refusal every member raises).
TYPED_REFUSALS = (CollectiveFailureError, ContractError, ContractTypeError, NotSupportedError, StaleTransactionError)
Member = tuple[str, int]


def _is_composite(optimizer: Any) -> bool:
    if isinstance(optimizer, PortableAdapter):
        return False
    if isinstance(optimizer, Composite):
        children = list(optimizer.child_optimizers().values())
        if children and all(isinstance(c, PortableAdapter) for c in children):
            return True
    raise AssertionError("claims portable_state but neither is a PortableAdapter nor a composite of adapters")


def export_document(optimizer: Any, binding: CheckpointProcessGroupBinding, label: str) -> dict[str, Any]:
    """The complete document of ``optimizer``'s portable state (collective over ``binding``)."""
    if _is_composite(optimizer):
        composite = export_portable_composite_state(
            optimizer, checkpoint_process_group=binding, transaction_id=label, limits=LIMITS
        )
        return composite.materialize(binding, limits=LIMITS)
    state = export_portable_state(optimizer, checkpoint_process_group=binding, transaction_id=label, limits=LIMITS)
    return state.materialize(binding, limits=LIMITS)


def import_document(optimizer: Any, document: Any, binding: CheckpointProcessGroupBinding, label: str) -> None:
    """Import a complete document into ``optimizer`` (collective over ``binding``)."""
    if _is_composite(optimizer):
        import_portable_composite_state(
            optimizer, document, checkpoint_process_group=binding, transaction_id=label, limits=LIMITS
        )
    else:
        import_portable_state(
            optimizer, document, checkpoint_process_group=binding, transaction_id=label, limits=LIMITS
        )


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


def corruptions(document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(name, corrupted deep copy)`` for every corruption class of one complete document."""
    probe = document["children"][document["roles"][0]] if "parameters" not in document else document
    return [(name, _corrupt(document, edit, reseal)) for name, edit, reseal in _edits(probe)]


def refuse_attempt(optimizer: Any, model: Any, document: Any, binding: CheckpointProcessGroupBinding) -> str:
    """Import a corrupted ``document``; what went wrong, or ``""`` for a typed, mutation-free refusal."""
    before = deep_snapshot(optimizer, model)
    try:
        import_document(optimizer, document, binding, "conformance-atomic-import")
    except TYPED_REFUSALS:
        pass
    except Exception as exc:
        return f"refused with an untyped {type(exc).__name__}: {exc}"
    else:
        return "the corrupted document was accepted"
    diffs = snapshot_diff(before, optimizer, model)
    return "a refused import changed the optimizer: " + "; ".join(diffs[:3]) if diffs else ""


# -- rank functions ----------------------------------------------------------------------------------


_LAYOUT_OF = {"flattened": ParameterLayout.FLATTENED_ELEMENT_SHARD, "owner": ParameterLayout.WHOLE_PARAMETER_OWNER}


def _layout(member_layout: str) -> ParameterLayout:
    return _LAYOUT_OF.get(member_layout, ParameterLayout.REPLICATED)


def stated_update_rtol(optimizer: Any, source: str, target: str) -> float | None:
    """The ``update_rtol`` of the ``canonical_global`` transition (of any kind) from GlooMember
    layout ``source`` to ``target`` that ``optimizer``'s contract declares (``None``: none)."""
    for entry in optimizer.optimizer_contract().capabilities.checkpoints:
        if entry.transport is CheckpointTransport.CANONICAL_GLOBAL:
            for change in entry.transitions:
                if change.allows(_layout(source), _layout(target)):
                    return float(change.update_rtol)
    return None


def update_gap(
    start: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]
) -> float:
    """Relative L2 distance of ``other``'s update from ``reference``'s (both taken from ``start``);
    exactly ``0.0`` when the updates are bit-identical."""
    difference = sum(float((other[n].double() - reference[n].double()).square().sum()) for n in start)
    if difference == 0.0:
        return 0.0
    size = sum(float((reference[n].double() - start[n].double()).square().sum()) for n in start)
    return float((difference / max(size, 1e-300)) ** 0.5)


def transition(
    rank: int, world_size: int, spec: str, source: Member, target: Member, steps: int, back: bool
) -> dict[str, Any]:
    """Train ``source`` (``(layout, members)``), export a complete document, import it into
    ``target`` and continue; with ``back``, import the target's re-export into a twin of the
    source and compare that twin's export with the first (the state's round trip, bit for bit).

    Rank 0 returns ``uninterrupted`` and ``resumed`` losses, ``update_rtol`` (what the
    target's contract states for the transition; ``0.0`` on the same layout),
    ``bit_exact_continuation`` (same driver bits after both continuations) and, with
    ``back``, ``back_rtol``, ``round_trip_identical`` and ``round_trip_update_gap`` (the
    returned twin's first update against the source's, :func:`update_gap`: the same layout,
    parameters and gradient, so only the state's trip there and back can tell them apart).
    """
    init_member_groups()
    conformance_target = load_target(spec)
    (src_layout, src_size), (tgt_layout, tgt_size) = source, target
    src = GlooMember(conformance_target, src_layout, src_size) if rank < src_size else None
    if src is not None:
        src.train(0, steps)
    checkpoint = share({n: p.detach().clone() for n, p in src.model.named_parameters()} if src else None)
    exported = export_document(src.optimizer, src.binding, "conformance-export") if src else None
    document = share(exported if rank == 0 else None)
    outcome: dict[str, Any] = {}
    after_source: dict[str, torch.Tensor] = {}
    if src is not None:
        first = src.train(steps, 1)
        after_source = src.parameter_values()
        outcome["uninterrupted"] = first + src.train(steps + 1, steps - 1)
    re_exported = None
    if rank < tgt_size:
        tgt = GlooMember(conformance_target, tgt_layout, tgt_size, values=checkpoint)
        import_document(tgt.optimizer, document, tgt.binding, "conformance-reshard")
        re_exported = export_document(tgt.optimizer, tgt.binding, "conformance-re-export")
        same = source == target
        outcome["update_rtol"] = 0.0 if same else stated_update_rtol(tgt.optimizer, src_layout, tgt_layout)
        outcome["resumed"] = tgt.train(steps, steps)
        if src is not None:
            outcome["bit_exact_continuation"] = tgt.parameters_bits() == src.parameters_bits()
    if back:
        returned = share(re_exported if rank == 0 else None)
        if src is not None:
            twin = GlooMember(conformance_target, src_layout, src_size, values=checkpoint)
            outcome["back_rtol"] = stated_update_rtol(twin.optimizer, tgt_layout, src_layout)
            import_document(twin.optimizer, returned, twin.binding, "conformance-back")
            again = export_document(twin.optimizer, twin.binding, "conformance-back-export")
            outcome["round_trip_identical"] = again["completion"]["digest"] == document["completion"]["digest"]
            twin.train(steps, 1)
            outcome["round_trip_update_gap"] = update_gap(checkpoint, after_source, twin.parameter_values())
    dist.barrier()
    return outcome


def refuse_corrupted(rank: int, world_size: int, spec: str, layout: Member, steps: int) -> list[str]:
    """Every member of ``layout`` refuses each corrupted variant of a document with a typed error
    and changes nothing; this rank's problems (``"<corruption>: <what went wrong>"``)."""
    init_member_groups()
    conformance_target = load_target(spec)
    name, size = layout
    if rank >= size:
        dist.barrier()
        return []
    member = GlooMember(conformance_target, name, size)
    member.train(0, steps)
    document = export_document(member.optimizer, member.binding, "conformance-atomic-export")
    member.train(steps, 1)
    problems = []
    for corruption, corrupted in corruptions(document):
        problem = refuse_attempt(member.optimizer, member.model, corrupted, member.binding)
        if problem:
            problems.append(f"{corruption}: {problem}")
    dist.barrier()
    return problems

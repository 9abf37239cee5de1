"""Rank functions for gefen-portable's gloo tests (run inside GlooWorld ranks).

Each case builds a replicated single-process reference on every rank (deterministic), a
source optimizer on the source members, exports, moves the result to the target members
(as a document, or as a PortableState whose missing fragments the import fetches), imports
into a target layout, and compares the target with the reference bit for bit, before and
after continuing training.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from unittest import mock

import gefen_portable
import torch
import torch.distributed as dist
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, CollectiveCounter
from gefen_portable import (
    PortableCollectiveError,
    PortableState,
    export_portable_composite_state,
    export_portable_state,
    import_portable_composite_state,
    import_portable_state,
)
from portable_sgd_adopter import (
    PortableComposite,
    PortableSGD,
    flattened_manifest,
    group,
    initial_values,
    owner_manifest,
    piece_of,
    region_manifest,
    replicated_manifest,
)

SPECS: dict[str, tuple[int, ...]] = {
    "layer.weight": (4, 6),
    "layer.bias": (6,),
    "odd": (7, 3),
    "scalar": (),
    "empty": (0, 3),
}
LIMITS = PortableStateLimits(chunk_bytes=40)
STEPS = 3
MORE = 2
_GROUPS: dict[int, Any] = {}


def _process_group(size: int) -> Any:
    """One cached gloo group per size over ranks [0, size) (every rank creates every group once)."""
    if not _GROUPS:
        for n in (2, 3):
            _GROUPS[n] = dist.new_group(list(range(n)))
    return None if size == 1 else _GROUPS[size]


def binding(rank: int, size: int) -> CheckpointProcessGroupBinding:
    pg = group(size, f"dp{size}")
    return CheckpointProcessGroupBinding(pg, f"rank:{rank}", _process_group(size), "cpu")


def manifest_for(layout: dict[str, Any]) -> Any:
    size = layout["members"]
    kind = layout["kind"]
    pg = group(size, f"dp{size}")
    if kind == "replicated":
        return replicated_manifest(SPECS, pg if size > 1 else None)
    if kind == "flattened":
        return flattened_manifest(SPECS, pg, layout.get("cuts"))
    if kind == "regions":
        return region_manifest(SPECS, pg, layout.get("cuts"))
    return owner_manifest(SPECS, pg, layout["owners"])


def build(layout: dict[str, Any], rank: int, values: dict[str, torch.Tensor], **options: Any) -> PortableSGD:
    size = layout["members"]
    member = None if (size == 1 and layout["kind"] == "replicated") else f"rank:{rank}"
    return PortableSGD(manifest_for(layout), member, values, **options)


def reference(scaled: bool, steps: int = STEPS) -> PortableSGD:
    ref = PortableSGD(replicated_manifest(SPECS, None), None, initial_values(SPECS), scaled=scaled)
    ref.train_steps(0, steps)
    return ref


def _share(value: Any, source: int = 0) -> Any:
    """Test plumbing only: give every rank rank ``source``'s object (weights-only bytes)."""
    payload = [None]
    if dist.get_rank() == source:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = [buffer.getvalue()]  # type: ignore[list-item]
    dist.broadcast_object_list(payload, src=source)
    return torch.load(io.BytesIO(payload[0]), weights_only=True)  # type: ignore[arg-type]


def _expected_piece(ref: PortableSGD, shard: ShardIdentity) -> tuple[torch.Tensor | None, int | None]:
    full, step = ref.dense_state()[shard.fqn]
    if full is None:
        return None, None
    return piece_of(full, shard), step


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def compare_with_reference(target: PortableSGD, ref: PortableSGD) -> list[str]:
    problems = []
    for fqn, shard in target.shards.items():
        expected, step = _expected_piece(ref, shard)
        got, got_step = target.dense_state()[fqn]
        if expected is None:
            if got is not None and got.numel():
                problems.append(f"{fqn}: unexpected state")
            continue
        if got is None or not _bitwise(got, expected) or got_step != step:
            problems.append(f"{fqn}: state differs")
        piece = target.pieces[fqn]
        ref_piece = ref.pieces[fqn]
        assert ref_piece is not None
        want = piece_of(ref_piece, shard)
        if piece is not None and (want is None or not _bitwise(piece.detach(), want)):
            problems.append(f"{fqn}: parameter differs")
    if target.global_step != ref.global_step:
        problems.append("global step differs")
    return problems


def reshard(
    rank: int, world_size: int, source: dict[str, Any], target: dict[str, Any], path: str, scaled: bool
) -> dict[str, Any]:
    """Train on ``source``, move the state by ``path`` ("document" or "state"), import on ``target``."""
    _process_group(2)
    ref = reference(scaled)
    n, m = source["members"], target["members"]
    exported = document = None
    catalog_digest = None
    source_ranks = range(world_size) if n == 1 else range(n)
    if rank in source_ranks:
        src_rank = 0 if n == 1 else rank
        optimizer = build(source, src_rank, initial_values(SPECS), scaled=scaled)
        optimizer.train_steps(0, STEPS)
        exported = export_portable_state(
            optimizer, checkpoint_process_group=binding(src_rank, n), transaction_id="export-1", limits=LIMITS
        )
        catalog_digest = exported.catalog_digest
        if path == "document":
            document = exported.materialize(binding(src_rank, n), limits=LIMITS)
    if path == "document" and n > 1:
        document = _share(document)
    if path == "state" and n > 1:
        record = _share(exported.catalog_record() if exported is not None else None)
        if rank >= n:
            exported = PortableState.from_parts(record, [], limits=LIMITS)
    result: dict[str, Any] = {"catalog": catalog_digest, "fetched": 0}
    if rank >= m:
        return result
    values = {fqn: t.detach().clone() for fqn, t in ref.pieces.items() if t is not None}
    target_opt = build(target, rank, values, scaled=scaled)
    incoming: Any = document if path == "document" else exported
    if path == "document":
        incoming = _roundtrip(document)
    counter = CollectiveCounter()
    with counter.patched():
        import_portable_state(
            target_opt, incoming, checkpoint_process_group=binding(rank, m), transaction_id="import-1", limits=LIMITS
        )
    problems = compare_with_reference(target_opt, ref)
    result["objects"] = counter.calls.get("broadcast_object_list", 0) + counter.calls.get("all_gather_object", 0)
    result["sent"] = counter.calls.get("send", 0)
    result["received"] = counter.calls.get("recv", 0)
    ref.train_steps(STEPS, MORE)
    target_opt.train_steps(STEPS, MORE)
    problems += [f"after continuing: {p}" for p in compare_with_reference(target_opt, ref)]
    result["problems"] = problems
    if path == "document":
        result["document_digest"] = document["completion"]["digest"]  # type: ignore[index]
    return result


def _roundtrip(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same_layout_continuation(rank: int, world_size: int, layout: dict[str, Any]) -> list[str]:
    """Export on a layout and import into a fresh optimizer of the same layout: bit-exact."""
    _process_group(2)
    size = layout["members"]
    if rank >= size:
        return []
    ref = reference(scaled=True)
    optimizer = build(layout, rank, initial_values(SPECS), scaled=True)
    optimizer.train_steps(0, STEPS)
    state = export_portable_state(
        optimizer, checkpoint_process_group=binding(rank, size), transaction_id="same", limits=LIMITS
    )
    values = {fqn: t.detach().clone() for fqn, t in ref.pieces.items() if t is not None}
    twin = build(layout, rank, values, scaled=True)
    import_portable_state(
        twin, state, checkpoint_process_group=binding(rank, size), transaction_id="same-in", limits=LIMITS
    )
    optimizer.train_steps(STEPS, MORE)
    twin.train_steps(STEPS, MORE)
    problems = []
    for fqn, piece in optimizer.pieces.items():
        other = twin.pieces[fqn]
        if piece is None:
            continue
        assert other is not None
        if not _bitwise(piece.detach(), other.detach()):
            problems.append(f"{fqn}: continuation differs")
    return problems


# -- failures -----------------------------------------------------------------------------


class _Boom(RuntimeError):
    pass


_SNAPSHOTS: dict[str, Any] = {}


def _raiser(*args: Any, **kwargs: Any) -> Any:
    raise _Boom("injected failure")


@contextmanager
def _fault(name: str, active: bool, target: PortableSGD | None) -> Iterator[None]:
    if not active:
        yield
        return
    patches = {
        "export.prepare": None,
        "export.announce": "gefen_portable.collectives.encode_wire",
        "export.metadata": "gefen_portable.collectives.parse_wire",
        "export.allocate": "gefen_portable.collectives._allocate",
        "export.verify": "gefen_portable.collectives.reconstruct_wire",
        "export.finalize": "gefen_portable.export.assemble_catalog",
        "import.fetch": "gefen_portable.projection.copy_overlap",
        "import.prepare": None,
    }
    if name == "export.prepare" or name == "import.prepare":
        method = "portable_export" if name == "export.prepare" else "portable_prepare_import"
        assert target is not None
        with mock.patch.object(target, method, _raiser):
            yield
        return
    if name == "import.commit":
        original = gefen_portable.importer.commit_on_session
        assert target is not None

        def step_then_commit(*args: Any, **kwargs: Any) -> None:
            # A concurrent step between staging and the freshness vote.
            target.train_steps(100, 1)
            _SNAPSHOTS["after_injection"] = deep_snapshot(target)
            original(*args, **kwargs)

        with mock.patch.object(gefen_portable.importer, "commit_on_session", step_then_commit):
            yield
        return
    if name == "import.document":
        yield
        return
    with mock.patch(patches[name], _raiser):
        yield


def failure_case(rank: int, world_size: int, fault: str, bad_rank: int) -> dict[str, Any]:
    """Run an export (2 members, flattened) then an import (3 members, flattened) with one
    injected failure; report what every rank raised and whether anything changed."""
    _process_group(2)
    operation = fault.split(".", maxsplit=1)[0]
    source = {"kind": "flattened", "members": 2}
    target = {"kind": "flattened", "members": 3}
    outcome: dict[str, Any] = {"error": None, "changed": []}
    exported = None
    if rank < 2:
        optimizer = build(source, rank, initial_values(SPECS), scaled=True)
        optimizer.train_steps(0, STEPS)
        before = deep_snapshot(optimizer)
        context = _fault(fault, operation == "export" and rank == bad_rank, optimizer)
        try:
            with context:
                exported = export_portable_state(
                    optimizer, checkpoint_process_group=binding(rank, 2), transaction_id="export", limits=LIMITS
                )
        except PortableCollectiveError as exc:
            outcome["error"] = (type(exc).__name__, exc.phase, str(exc))
        except Exception as exc:  # pragma: no cover - reported to the test
            outcome["error"] = (type(exc).__name__, "", str(exc))
        outcome["changed"] = snapshot_diff(before, optimizer)
    if operation == "export":
        return outcome
    record = _share(exported.catalog_record() if exported is not None else None)
    if rank >= 2:
        exported = PortableState.from_parts(record, [], limits=LIMITS)
    assert exported is not None
    ref = reference(scaled=True)
    values = {fqn: t.detach().clone() for fqn, t in ref.pieces.items() if t is not None}
    target_opt = build(target, rank, values, scaled=True)
    target_opt.train_steps(STEPS, 1)  # the target holds state of its own, which must survive a failed import
    incoming: Any = exported
    if fault == "import.document" and rank == bad_rank:
        incoming = {"format": "not a document"}
    before = deep_snapshot(target_opt)
    context = _fault(fault, rank == bad_rank, target_opt) if fault != "import.document" else nullcontext()
    try:
        with context:
            import_portable_state(
                target_opt, incoming, checkpoint_process_group=binding(rank, 3), transaction_id="import", limits=LIMITS
            )
    except PortableCollectiveError as exc:
        outcome["error"] = (type(exc).__name__, exc.phase, str(exc))
    except Exception as exc:  # pragma: no cover - reported to the test
        outcome["error"] = (type(exc).__name__, "", str(exc))
    before = _SNAPSHOTS.pop("after_injection", before)
    outcome["changed"] = snapshot_diff(before, target_opt)
    return outcome


def divergence_case(rank: int, world_size: int, what: str) -> dict[str, Any]:
    """One rank passes a different transaction id or limits: every rank fails the first gate."""
    _process_group(2)
    # Flattened pieces are 1-D: the kit's deep_snapshot on this branch cannot token 0-dim tensors yet.
    optimizer = build({"kind": "flattened", "members": 3}, rank, initial_values(SPECS))
    optimizer.train_steps(0, 1)
    transaction = "export"
    limits = LIMITS
    if rank == 1 and what == "transaction":
        transaction = "other"
    if rank == 1 and what == "limits":
        limits = PortableStateLimits(chunk_bytes=64)
    if rank == 1 and what == "invalid_transaction":
        transaction = " padded "
    before = deep_snapshot(optimizer)
    try:
        export_portable_state(
            optimizer, checkpoint_process_group=binding(rank, 3), transaction_id=transaction, limits=limits
        )
    except PortableCollectiveError as exc:
        return {"error": (exc.phase, str(exc)), "changed": snapshot_diff(before, optimizer)}
    return {"error": None, "changed": snapshot_diff(before, optimizer)}


def composite_case(rank: int, world_size: int, fail_second: bool) -> dict[str, Any]:
    """A composite of two children exported on 2 flattened members, imported on 3 members
    with the first child flattened and the second whole-owner; optionally the second child's
    staging fails on one rank, which must leave both children untouched everywhere."""
    _process_group(2)
    first_specs = {"layer.weight": SPECS["layer.weight"], "odd": SPECS["odd"]}
    second_specs = {"layer.bias": SPECS["layer.bias"], "gain": (2,), "shift": (3, 2)}
    values = initial_values({**SPECS, "gain": (2,), "shift": (3, 2)})

    def make(
        size: int, member_rank: int, owners: dict[str, int] | None, vals: dict[str, torch.Tensor]
    ) -> PortableComposite:
        pg = group(size, f"dp{size}")
        member = f"rank:{member_rank}"
        first = PortableSGD(flattened_manifest(first_specs, pg), member, vals, scaled=True)
        second_manifest = owner_manifest(second_specs, pg, owners) if owners else replicated_manifest(second_specs, pg)
        second = PortableSGD(second_manifest, member, vals, lr=0.02)
        return PortableComposite({"first": first, "second": second})

    exported = None
    if rank < 2:
        source = make(2, rank, None, values)
        source.train_steps(0, STEPS)
        exported = export_portable_composite_state(
            source, checkpoint_process_group=binding(rank, 2), transaction_id="c-export", limits=LIMITS
        )
        document = exported.materialize(binding(rank, 2), limits=LIMITS)
    else:
        document = None
    document = _roundtrip(_share(document))
    ref_first = PortableSGD(replicated_manifest(first_specs, None), None, values, scaled=True)
    ref_second = PortableSGD(replicated_manifest(second_specs, None), None, values, lr=0.02)
    ref_first.train_steps(0, STEPS)
    ref_second.train_steps(0, STEPS)
    trained = {**{f: t for f, t in ref_first.pieces.items()}, **{f: t for f, t in ref_second.pieces.items()}}
    target = make(
        3,
        rank,
        {"layer.bias": 2, "gain": 1, "shift": 0},
        {f: t.detach().clone() for f, t in trained.items() if t is not None},
    )
    before = deep_snapshot(target.children["first"], target.children["second"])
    context = (
        mock.patch.object(target.children["second"], "portable_prepare_import", _raiser)
        if fail_second and rank == 2
        else nullcontext()
    )
    error = None
    try:
        with context:
            import_portable_composite_state(
                target, document, checkpoint_process_group=binding(rank, 3), transaction_id="c-import", limits=LIMITS
            )
    except PortableCollectiveError as exc:
        error = (exc.phase, str(exc))
    changed = snapshot_diff(before, target.children["first"], target.children["second"])
    problems = []
    if not fail_second:
        problems += compare_with_reference(target.children["first"], ref_first)
        problems += compare_with_reference(target.children["second"], ref_second)
        target.train_steps(STEPS, MORE)
        ref_first.train_steps(STEPS, MORE)
        ref_second.train_steps(STEPS, MORE)
        problems += compare_with_reference(target.children["first"], ref_first)
        problems += compare_with_reference(target.children["second"], ref_second)
    return {"error": error, "changed": changed, "problems": problems, "digest": document["completion"]["digest"]}


def environment(rank: int, world_size: int) -> str:
    return os.environ.get("OMP_NUM_THREADS", "")

"""``load_portable_dcp``: read the catalog, then only the fragments this member needs.

Two DCP loads, each planned from the checkpoint's metadata before anything is allocated:

1. the envelope, the catalog (wire metadata and tensors) and every writer's chunk table:
   the namespace's key layout, dtypes, ranks and sizes are validated against the limits
   first; then the envelope is authenticated, the wire metadata parsed under the
   collective limits, the catalog rebuilt and its completion digest (the root digest)
   compared with the envelope's, and every chunk table must be bound to that root digest;
2. the fragments that overlap this member's target pieces
   (:func:`gefen_portable.needed_fragments`): each field's stored chunks must tile it and
   each must have exactly one recorded digest; chunks are read straight into the fragment's
   buffer and hashed there.

Failures after a read are voted on, so every member raises. Then
:func:`gefen_portable.import_portable_state` verifies every fragment against the catalog,
projects, stages, votes and commits (nothing changes unless every member succeeded).
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Callable
from typing import Any

import torch
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import ProcessGroupBinding, failure_vote
from gefen_portable import (
    Catalog,
    PortableCompositeState,
    PortableFragment,
    PortableState,
    import_portable_composite_state,
    import_portable_state,
    needed_fragments,
    parse_wire,
    reconstruct_wire,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .digest_table import chunk_digest
from .errors import CheckpointIntegrityError, CheckpointLayoutError
from .portable_format import (
    ChunkTable,
    CompositeEnvelope,
    FragmentChunk,
    PortableEnvelope,
    decode_chunk_table,
    decode_composite_envelope,
    decode_portable_envelope,
)
from .portable_save import is_composite
from .storage_identity import preflight, require_binding

__all__ = ["load_portable_dcp"]

_TENSOR_KEY = re.compile(r"^t[0-9]{6}$")
_WRITER_KEY = re.compile(r"^writer_[0-9]{5}$")


@dataclasses.dataclass
class _Layout:
    """The namespace's keys in the checkpoint, by role (validated shapes only, nothing read)."""

    envelope: str
    wire: str
    tensors: dict[int, str]
    writers: dict[int, str]
    fragments: dict[tuple[str, int, str], str]


def _md(metadata: Metadata, key: str) -> TensorStorageMetadata:
    md = metadata.state_dict_metadata.get(key)
    if type(md) is not TensorStorageMetadata:
        raise CheckpointLayoutError(f"{key}: expected tensor storage metadata, got {type(md).__name__}")
    return md


def _whole_bytes(metadata: Metadata, key: str, limit: int) -> int:
    md = _md(metadata, key)
    size = tuple(int(d) for d in md.size)
    if md.properties.dtype is not torch.uint8 or len(size) != 1 or not 0 < size[0] <= limit:
        raise CheckpointLayoutError(f"{key}: expected a 1-D uint8 tensor of 1 to {limit} bytes")
    if len(md.chunks) != 1 or tuple(md.chunks[0].offsets) != (0,) or tuple(md.chunks[0].sizes) != size:
        raise CheckpointLayoutError(f"{key}: expected exactly one whole chunk")
    return size[0]


def _keys_under(metadata: Metadata, prefix: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """``(flat key, path below prefix)`` for every checkpoint key under ``prefix``."""
    if type(metadata) is not Metadata or type(metadata.planner_data) is not dict:
        raise CheckpointLayoutError("the checkpoint has no flattened key mapping (not a portable DCP checkpoint)")
    found = []
    for key, path in metadata.planner_data.items():
        if type(path) is tuple and tuple(str(p) for p in path[: len(prefix)]) == prefix and len(path) > len(prefix):
            found.append((key, tuple(str(p) for p in path[len(prefix) :])))
    return found


def _layout(metadata: Metadata, prefix: tuple[str, ...], limits: PortableStateLimits) -> _Layout:
    namespace = ".".join(prefix)
    envelope = wire = None
    tensors: dict[int, str] = {}
    writers: dict[int, str] = {}
    fragments: dict[tuple[str, int, str], str] = {}
    for key, rest in _keys_under(metadata, prefix):
        if rest == ("envelope",):
            envelope = key
        elif rest == ("catalog", "wire"):
            wire = key
        elif len(rest) == 3 and rest[:2] == ("catalog", "tensors") and _TENSOR_KEY.match(rest[2]):
            tensors[int(rest[2][1:])] = key
        elif len(rest) == 2 and rest[0] == "writers" and _WRITER_KEY.match(rest[1]):
            writers[int(rest[1][7:])] = key
        elif len(rest) == 4 and rest[0] == "fragments" and rest[2].isdigit():
            fragments[(rest[1], int(rest[2]), rest[3])] = key
        elif rest[0] in ("composite", "roles"):
            raise CheckpointLayoutError(f"{namespace!r} holds a composite optimizer's state; load it into a composite")
        else:
            raise CheckpointLayoutError(f"{key}: unexpected key under the portable namespace {namespace!r}")
    if envelope is None or wire is None:
        raise CheckpointLayoutError(f"the checkpoint holds no portable state under the namespace {namespace!r}")
    if sorted(tensors) != list(range(len(tensors))) or len(tensors) > limits.max_tensors:
        raise CheckpointLayoutError(f"{namespace}: catalog tensors must be numbered 0..n-1 (at most max_tensors)")
    if not writers or sorted(writers) != list(range(len(writers))) or len(writers) > limits.max_members:
        raise CheckpointLayoutError(f"{namespace}: chunk tables must be numbered 0..n-1 (at most max_members)")
    if len(fragments) > limits.max_tensors:
        raise CheckpointLayoutError(f"{namespace}: more than max_tensors fragment fields")
    return _Layout(envelope, wire, tensors, writers, fragments)


class _Planner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose requests are planned from the metadata by ``plan``."""

    def __init__(self, plan: Callable[[Metadata], None]) -> None:
        super().__init__()
        self._plan = plan
        self.items: list[ReadItem] = []
        self.resolve: Callable[[ReadItem], torch.Tensor] | None = None
        self.commit: Callable[[ReadItem, torch.Tensor], None] | None = None
        self.keys: frozenset[str] = frozenset()

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if metadata is None:
            raise CheckpointLayoutError("the checkpoint has no metadata")
        self.state_dict_target = state_dict
        self._plan(metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[*plan.items, *self.items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn in self.keys and self.resolve is not None:
            return self.resolve(read_item)
        return super().resolve_tensor(read_item)  # type: ignore[no-any-return]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item.dest_index.fqn in self.keys and self.commit is not None:
            self.commit(read_item, tensor)
            return
        super().commit_tensor(read_item, tensor)


@dataclasses.dataclass
class _Header:
    envelope: PortableEnvelope
    catalog: Catalog
    tables: list[ChunkTable]
    layout: _Layout


def _nest(target: dict[str, Any], prefix: tuple[str, ...], value: dict[str, Any]) -> None:
    for key in prefix[:-1]:
        target = target.setdefault(key, {})
    target[prefix[-1]] = value


def _read_header(
    prefix: tuple[str, ...],
    namespace: str,
    storage_reader: StorageReader,
    limits: PortableStateLimits,
    dcp: dict[str, Any],
) -> _Header:
    collective = limits.collective()
    found: dict[str, Any] = {}

    def plan(metadata: Metadata) -> None:
        layout = _layout(metadata, prefix, limits)
        total = 0
        tensors = {}
        for index, key in sorted(layout.tensors.items()):
            md = _md(metadata, key)
            size = tuple(int(d) for d in md.size)
            if len(size) > limits.max_tensor_rank:
                raise CheckpointLayoutError(f"{key}: rank {len(size)} exceeds max_tensor_rank")
            total += math.prod(size) * md.properties.dtype.itemsize
            if total > collective.max_fragment_tensor_bytes:
                raise CheckpointLayoutError(f"{key}: catalog tensors exceed max_collective_tensor_bytes")
            tensors[f"t{index:06d}"] = torch.empty(size, dtype=md.properties.dtype)
        destinations = {
            "envelope": torch.empty(
                _whole_bytes(metadata, layout.envelope, limits.max_metadata_bytes), dtype=torch.uint8
            ),
            "catalog": {
                "wire": torch.empty(
                    _whole_bytes(metadata, layout.wire, collective.max_metadata_bytes), dtype=torch.uint8
                ),
                "tensors": tensors,
            },
            "writers": {
                f"writer_{index:05d}": torch.empty(
                    _whole_bytes(metadata, key, limits.max_metadata_bytes), dtype=torch.uint8
                )
                for index, key in sorted(layout.writers.items())
            },
        }
        found["layout"] = layout
        found["destinations"] = destinations
        _nest(planner.state_dict_target, prefix, destinations)

    planner = _Planner(plan)
    _read(storage_reader, planner, dcp)
    destinations = found["destinations"]
    layout: _Layout = found["layout"]
    envelope = decode_portable_envelope(bytes(destinations["envelope"].numpy().tobytes()), limits=limits)
    if envelope.namespace != namespace:
        raise CheckpointLayoutError(f"the envelope names namespace {envelope.namespace!r}, not {namespace!r}")
    if envelope.catalog_tensors != len(layout.tensors) or envelope.writers != len(layout.writers):
        raise CheckpointLayoutError("the envelope's catalog tensor or writer count differs from the stored keys")
    wire = parse_wire(bytes(destinations["catalog"]["wire"].numpy().tobytes()), limits=collective)
    if wire.digest != envelope.catalog_wire_digest:
        raise CheckpointIntegrityError("the catalog's wire digest differs from the envelope's")
    tensors = [destinations["catalog"]["tensors"][f"t{i:06d}"] for i in range(len(layout.tensors))]
    record = reconstruct_wire(wire, tensors, expected_digest=envelope.catalog_wire_digest)
    catalog = PortableState.from_parts(record, [], limits=limits).catalog
    if catalog.digest != envelope.catalog_digest:
        raise CheckpointIntegrityError("the catalog's completion digest differs from the envelope's root digest")
    tables = []
    for index in range(len(layout.writers)):
        table = decode_chunk_table(
            bytes(destinations["writers"][f"writer_{index:05d}"].numpy().tobytes()), limits=limits
        )
        if table.writer != index or table.catalog_digest != envelope.catalog_digest:
            raise CheckpointIntegrityError(f"chunk table {index} belongs to another writer or another catalog")
        tables.append(table)
    return _Header(envelope, catalog, tables, layout)


def _read_fragments(
    header: _Header,
    needed: frozenset[tuple[str, int]],
    storage_reader: StorageReader,
    limits: PortableStateLimits,
    dcp: dict[str, Any],
) -> tuple[list[PortableFragment], list[str]]:
    """Read the needed fragments; return them and the chunk digest mismatches seen."""
    catalog = header.catalog
    recorded: dict[tuple[str, int, str, int], FragmentChunk] = {}
    for table in header.tables:
        for chunk in table.chunks:
            if chunk.key in recorded:
                raise CheckpointIntegrityError(f"chunk {chunk.key} has digests from two writers")
            recorded[chunk.key] = chunk
    buffers: dict[tuple[str, int, str], torch.Tensor] = {}
    mismatches: list[str] = []
    lock = threading.Lock()
    keys: dict[str, tuple[str, int, str]] = {}

    def plan(metadata: Metadata) -> None:
        total = sum(catalog.fragments[fqn][index].nbytes for fqn, index in needed)
        if total > limits.max_fragment_tensor_bytes:
            raise CheckpointLayoutError(
                f"this member needs {total} bytes of fragments, over max_fragment_tensor_bytes={limits.max_fragment_tensor_bytes}"
            )
        items = []
        for fqn, index in sorted(needed):
            for name, (shape, dtype) in catalog.fragment_tensors(fqn, index).items():
                numel = math.prod(shape)
                key = header.layout.fragments.get((fqn, index, name))
                if key is None:
                    raise CheckpointLayoutError(f"fragment {index} of {fqn!r} field {name!r} is not in the checkpoint")
                md = _md(metadata, key)
                if md.properties.dtype is not dtype or tuple(md.size) != (numel,):
                    raise CheckpointLayoutError(f"{key}: expected 1-D {dtype} of {numel} elements")
                spans = sorted((int(c.offsets[0]), int(c.sizes[0]), i) for i, c in enumerate(md.chunks))
                cursor = 0
                for start, length, position in spans:
                    chunk = recorded.get((fqn, index, name, start))
                    if start != cursor or chunk is None or chunk.length != length:
                        raise CheckpointIntegrityError(
                            f"{key}: stored chunks do not match the recorded chunks at {start}"
                        )
                    cursor = start + length
                    if length:
                        items.append(
                            ReadItem(
                                type=LoadItemType.TENSOR,
                                dest_index=MetadataIndex(key, torch.Size([start])),
                                dest_offsets=torch.Size([0]),
                                storage_index=MetadataIndex(key, torch.Size([start]), position),
                                storage_offsets=torch.Size([0]),
                                lengths=torch.Size([length]),
                            )
                        )
                if cursor != numel:
                    raise CheckpointIntegrityError(f"{key}: stored chunks cover {cursor} of {numel} elements")
                keys[key] = (fqn, index, name)
        for fqn, index, name in keys.values():
            shape, dtype = catalog.fragment_tensors(fqn, index)[name]
            buffers[(fqn, index, name)] = torch.empty(math.prod(shape), dtype=dtype)
        planner.items = items
        planner.keys = frozenset(keys)

    def resolve(item: ReadItem) -> torch.Tensor:
        start, length = int(item.dest_index.offset[0]), int(item.lengths[0])  # type: ignore[index]
        return buffers[keys[item.dest_index.fqn]][start : start + length]

    def commit(item: ReadItem, tensor: torch.Tensor) -> None:
        fqn, index, name = keys[item.dest_index.fqn]
        start = int(item.dest_index.offset[0])  # type: ignore[index]
        expected = recorded[(fqn, index, name, start)].digest
        actual = chunk_digest(tensor)
        if actual != expected:
            with lock:
                mismatches.append(f"chunk at {start} of fragment {index} of {fqn!r} field {name!r}")

    planner = _Planner(plan)
    planner.resolve, planner.commit = resolve, commit
    _read(storage_reader, planner, dcp)
    fragments = [
        PortableFragment.from_catalog(
            catalog,
            fqn,
            index,
            {
                name: buffers[(fqn, index, name)].reshape(shape)
                for name, (shape, _) in catalog.fragment_tensors(fqn, index).items()
            },
        )
        for fqn, index in sorted(needed)
    ]
    return fragments, mismatches


def _read(storage_reader: StorageReader, planner: Any, dcp: dict[str, Any]) -> None:
    """``dcp.load`` of what ``planner`` plans. A failure raises the first failing member's own
    error (``CheckpointLayoutError``, ``CheckpointIntegrityError``, ...; DCP's
    ``CheckpointException`` as its cause) on every member: DCP raises its own exception, a
    ``BaseException`` that ``except Exception`` lets through."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    try:
        load({}, storage_reader=storage_reader, planner=planner, **dcp)
    except CheckpointException as exc:
        failures = [failure[0] for _, failure in sorted(exc.failures.items())]
        first = next((failure for failure in failures if isinstance(failure, Exception)), None)
        if first is None:
            raise
        raise first from exc


def _read_composite(
    namespace: str, storage_reader: StorageReader, limits: PortableStateLimits, dcp: dict[str, Any]
) -> CompositeEnvelope:
    found: dict[str, torch.Tensor] = {}

    def plan(metadata: Metadata) -> None:
        keys = {rest: key for key, rest in _keys_under(metadata, (namespace,))}
        key = keys.get(("composite",))
        if key is None or any(rest[0] not in ("composite", "roles") for rest in keys):
            raise CheckpointLayoutError(f"{namespace!r} holds no composite optimizer's state")
        found["envelope"] = torch.empty(_whole_bytes(metadata, key, limits.max_metadata_bytes), dtype=torch.uint8)
        planner.state_dict_target[namespace] = {"composite": found["envelope"]}

    planner = _Planner(plan)
    _read(storage_reader, planner, dcp)
    envelope = decode_composite_envelope(bytes(found["envelope"].numpy().tobytes()), limits=limits)
    if envelope.namespace != namespace:
        raise CheckpointLayoutError(f"the composite envelope names namespace {envelope.namespace!r}, not {namespace!r}")
    return envelope


def _load_single(
    optimizer: Any,
    binding: ProcessGroupBinding,
    storage_reader: StorageReader,
    transaction_id: str,
    limits: PortableStateLimits,
    namespace: str,
    dcp: dict[str, Any],
) -> None:
    error: BaseException | None = None
    header: _Header | None = None
    needed: frozenset[tuple[str, int]] = frozenset()
    try:
        header = _read_header((namespace,), namespace, storage_reader, limits, dcp)
    except Exception as exc:
        error = exc
    failure_vote(binding, "gefen_dcp.portable_load.catalog", error)
    assert header is not None
    try:
        needed = needed_fragments(header.catalog, optimizer.portable_layout())
    except Exception as exc:
        error = exc
    failure_vote(binding, "gefen_dcp.portable_load.plan", error)
    fragments, mismatches = _read_fragments(header, needed, storage_reader, limits, dcp)
    state: PortableState | None = None
    try:
        _raise_mismatches(mismatches)
        # inside the vote: a member whose fragments are refused (a non-finite value under
        # re-signed chunk digests) must not leave the others waiting in the import's first round
        state = PortableState(header.catalog, fragments)
    except Exception as exc:
        error = exc
    failure_vote(binding, "gefen_dcp.portable_load.verify", error)
    assert state is not None
    import_portable_state(
        optimizer, state, checkpoint_process_group=binding, transaction_id=transaction_id, limits=limits
    )


def _load_composite(
    optimizer: Any,
    binding: ProcessGroupBinding,
    storage_reader: StorageReader,
    transaction_id: str,
    limits: PortableStateLimits,
    namespace: str,
    dcp: dict[str, Any],
) -> None:
    error: BaseException | None = None
    envelope: CompositeEnvelope | None = None
    headers: dict[str, _Header] = {}
    needed: dict[str, frozenset[tuple[str, int]]] = {}
    try:
        envelope = _read_composite(namespace, storage_reader, limits, dcp)
        digests = dict(envelope.children)
        for role in envelope.roles:
            headers[role] = _read_header((namespace, "roles", role), namespace, storage_reader, limits, dcp)
            if headers[role].catalog.digest != digests[role]:
                raise CheckpointIntegrityError(f"the catalog of role {role!r} differs from the composite envelope's")
        children = dict(optimizer.child_optimizers())
        if tuple(children) != envelope.roles:
            raise CheckpointLayoutError(
                f"the checkpoint's roles {envelope.roles} differ from the composite's {tuple(children)}"
            )
        needed = {
            role: needed_fragments(headers[role].catalog, children[role].portable_layout()) for role in envelope.roles
        }
    except Exception as exc:
        error = exc
    failure_vote(binding, "gefen_dcp.portable_load.catalog", error)
    assert envelope is not None
    states: dict[str, PortableState] = {}
    mismatches: list[str] = []
    read = {}
    for role in envelope.roles:
        read[role], bad = _read_fragments(headers[role], needed[role], storage_reader, limits, dcp)
        mismatches += [f"role {role!r}: {m}" for m in bad]
    try:
        _raise_mismatches(mismatches)
        states = {role: PortableState(headers[role].catalog, read[role]) for role in envelope.roles}
    except Exception as exc:  # voted, as the single load's
        error = exc
    failure_vote(binding, "gefen_dcp.portable_load.verify", error)
    composite: PortableCompositeState | None = None
    try:
        composite = PortableCompositeState(envelope.implementation, dict(envelope.routing), states)
        if composite.digest != envelope.wrapper_digest:
            raise CheckpointIntegrityError("the composite wrapper digest differs from the composite envelope's")
    except Exception as exc:
        error = exc
    failure_vote(binding, "gefen_dcp.portable_load.composite", error)
    assert composite is not None
    import_portable_composite_state(
        optimizer, composite, checkpoint_process_group=binding, transaction_id=transaction_id, limits=limits
    )


def _raise_mismatches(mismatches: list[str]) -> None:
    if mismatches:
        raise CheckpointIntegrityError(
            f"{len(mismatches)} fragment chunk(s) are corrupted (SHA-256 differs from the recorded digest): "
            + "; ".join(mismatches[:3])
        )


def load_portable_dcp(
    optimizer: Any,
    *,
    checkpoint_process_group: ProcessGroupBinding,
    storage_reader: StorageReader,
    transaction_id: str,
    limits: PortableStateLimits,
    namespace: str = "optimizer",
) -> None:
    """Load a checkpoint written by :func:`~gefen_dcp.save_portable_dcp` into ``optimizer``.

    Collective over ``checkpoint_process_group`` (any member count and layout the optimizer's
    contract declares). Every member agrees on the namespace, storage, transaction and limits
    first; reads and authenticates the envelope, catalog and chunk tables; reads only the
    fragments overlapping its target pieces, checking each chunk's SHA-256; and imports with
    :func:`gefen_portable.import_portable_state` (a composite: every child's state, checked
    against the composite envelope, then :func:`gefen_portable.import_portable_composite_state`).
    Any failure makes every member raise (a planning or read failure as the first failing
    member's typed error, DCP's ``CheckpointException`` its cause; the others as the typed
    error or a :class:`~gefen_contracts.CollectiveFailureError`) with no optimizer changed.
    """
    binding = require_binding(checkpoint_process_group)
    preflight(
        binding,
        direction="load",
        namespace=namespace,
        storage=storage_reader,
        transaction_id=transaction_id,
        limits=limits,
    )
    dcp: dict[str, Any] = {"process_group": binding.process_group} if binding.communicates else {"no_dist": True}
    load = _load_composite if is_composite(optimizer) else _load_single
    load(optimizer, binding, storage_reader, transaction_id, limits, namespace, dcp)

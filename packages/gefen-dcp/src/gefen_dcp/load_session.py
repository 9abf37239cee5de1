"""The load side: check a checkpoint's metadata against the live layout, read only the
chunks this rank's shards need, verify every chunk read, and assemble ``DenseShardLoad``s.

A :class:`LoadSession` is planned by :class:`~gefen_dcp.GefenLoadPlanner` from DCP's
``Metadata`` before anything is allocated or read: the key layout under the state's
namespace, dtypes, shapes, chunk bounds, overlap and coverage, and the limits. Each stored
chunk that overlaps this rank's local shard is read whole into a scratch buffer, hashed,
copied into the destination and dropped, so the transient is one chunk (chunks are at most
``chunk_bytes`` when gefen-dcp wrote them). :meth:`LoadSession.finish` then authenticates
the envelope, matches every chunk read against the writers' digest tables and builds the
codec's input.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import DenseShardLoad, PortableStateLimits
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .digest_table import ChunkKey, DigestTable, chunk_digest, decode_digest_table
from .envelope import DenseShardEnvelope, decode_envelope
from .errors import CheckpointIntegrityError, CheckpointLayoutError, EnvelopeFormatError
from .geometry import FIELD_ELEMENT_BYTES, ShardGeometry
from .save_session import SaveSession

__all__ = ["LoadSession", "StoredChunk"]


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A chunk as DCP's metadata lists it (``index`` is its position in the key's chunk list)."""

    index: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _layout_error(message: str) -> CheckpointLayoutError:
    return CheckpointLayoutError(message)


def _check_chunks(key: str, size: tuple[int, ...], chunks: list[StoredChunk]) -> None:
    """Every chunk inside the tensor, no two overlapping, together covering it exactly."""
    volume = 0
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
            raise _layout_error(f"{key}: chunk rank differs from tensor rank {len(size)}")
        for axis, (offset, length, dim) in enumerate(zip(chunk.offsets, chunk.sizes, size)):
            if offset < 0 or length < 0 or offset + length > dim:
                raise _layout_error(f"{key}: chunk {chunk.offsets}+{chunk.sizes} leaves the tensor on axis {axis}")
        volume += math.prod(chunk.sizes)
    if size:
        ordered = sorted((c for c in chunks if math.prod(c.sizes) > 0), key=lambda c: c.offsets[0])
        for i, first in enumerate(ordered):
            end = first.offsets[0] + first.sizes[0]
            for second in ordered[i + 1 :]:
                if second.offsets[0] >= end:
                    break
                if all(
                    a < b + lb and b < a + la
                    for a, la, b, lb in zip(first.offsets, first.sizes, second.offsets, second.sizes)
                ):
                    raise _layout_error(f"{key}: chunks at {first.offsets} and {second.offsets} overlap")
    elif len(chunks) != 1:
        raise _layout_error(f"{key}: a 0-d tensor must be stored as exactly one chunk, got {len(chunks)}")
    if volume != math.prod(size):
        raise _layout_error(f"{key}: stored chunks cover {volume} of {math.prod(size)} elements (truncated metadata)")


def _tensor_md(metadata: Metadata, key: str) -> TensorStorageMetadata:
    md = metadata.state_dict_metadata.get(key)
    if type(md) is not TensorStorageMetadata:
        raise _layout_error(f"{key}: expected tensor storage metadata, got {type(md).__name__}")
    return md


def _stored_chunks(md: TensorStorageMetadata, key: str, limits: PortableStateLimits) -> list[StoredChunk]:
    if len(md.chunks) > limits.max_tensors:
        raise _layout_error(f"{key}: {len(md.chunks)} chunks exceed max_tensors={limits.max_tensors}")
    return [
        StoredChunk(index, tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
        for index, chunk in enumerate(md.chunks)
    ]


def _bytes_md(metadata: Metadata, key: str, limits: PortableStateLimits) -> int:
    md = _tensor_md(metadata, key)
    size = tuple(int(d) for d in md.size)
    if md.properties.dtype is not torch.uint8 or len(size) != 1:
        raise _layout_error(f"{key}: expected a 1-D uint8 tensor, got {md.properties.dtype} of shape {size}")
    if not 0 < size[0] <= limits.max_metadata_bytes:
        raise _layout_error(f"{key}: {size[0]} bytes is outside (0, max_metadata_bytes={limits.max_metadata_bytes}]")
    chunks = _stored_chunks(md, key, limits)
    if len(chunks) != 1 or chunks[0].offsets != (0,) or chunks[0].sizes != size:
        raise _layout_error(f"{key}: expected exactly one whole chunk")
    return size[0]


class LoadSession:
    """Planned reads and verification for one dense-shard state dict (module docstring)."""

    def __init__(
        self,
        *,
        path: tuple[str, ...],
        live: SaveSession,
        metadata: Metadata,
        limits: PortableStateLimits,
    ) -> None:
        self.live = live
        self.limits = limits
        self._lock = threading.Lock()
        self._scratch: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._computed: dict[ChunkKey, str] = {}
        if type(metadata) is not Metadata:
            raise _layout_error(f"DCP metadata must be a Metadata, got {type(metadata).__name__}")
        planner_data = metadata.planner_data
        if type(planner_data) is not dict:
            raise _layout_error("the checkpoint has no flattened key mapping (saved without flatten_state_dict=True?)")
        depth = len(path)
        envelope_key: str | None = None
        table_keys: dict[str, str] = {}
        dense_keys: dict[tuple[str, str], str] = {}
        for key, key_path in planner_data.items():
            if type(key_path) is not tuple or tuple(str(p) for p in key_path[:depth]) != path:
                continue
            rest = tuple(key_path[depth:])
            if rest == ("envelope",):
                envelope_key = key
            elif len(rest) == 2 and rest[0] == "digests" and type(rest[1]) is str:
                table_keys[rest[1]] = key
            elif len(rest) == 3 and rest[0] == "dense" and type(rest[1]) is str and type(rest[2]) is str:
                dense_keys[(rest[1], rest[2])] = key
            else:
                raise _layout_error(f"{key}: unexpected key {rest} under the dense-shard state {'.'.join(path)!r}")
        namespace = ".".join(path)
        if envelope_key is None:
            raise _layout_error(f"the checkpoint holds no dense-shard state under {namespace!r}")
        if not table_keys or len(table_keys) > limits.max_members:
            raise _layout_error(f"{namespace}: expected 1 to {limits.max_members} digest tables, got {len(table_keys)}")
        self.envelope_key = envelope_key
        self.envelope_buffer = torch.empty(_bytes_md(metadata, envelope_key, limits), dtype=torch.uint8)
        self.table_buffers = {
            name: torch.empty(_bytes_md(metadata, key, limits), dtype=torch.uint8)
            for name, key in sorted(table_keys.items())
        }
        self.stored: dict[tuple[str, str], list[StoredChunk]] = {}
        self.keys: dict[str, tuple[str, str]] = {}
        total_chunks = 0
        total_bytes = 0
        for (fqn, name), key in sorted(dense_keys.items()):
            slot = live.slots.get(fqn)
            if slot is None:
                raise _layout_error(f"{key}: the checkpoint has parameter {fqn!r}, which the optimizer does not hold")
            md = _tensor_md(metadata, key)
            if md.properties.dtype is not torch.float32:
                raise _layout_error(f"{key}: dense fields must be float32, got {md.properties.dtype}")
            size = tuple(int(d) for d in md.size)
            if size != slot.geometry.global_shape:
                raise _layout_error(
                    f"{key}: saved with global shape {size}, the live parameter has {slot.geometry.global_shape}"
                )
            chunks = _stored_chunks(md, key, limits)
            _check_chunks(key, size, chunks)
            total_chunks += len(chunks)
            total_bytes += slot.geometry.numel * FIELD_ELEMENT_BYTES
            self.stored[(fqn, name)] = chunks
            self.keys[key] = (fqn, name)
        if total_chunks > limits.max_tensors:
            raise _layout_error(f"{namespace}: {total_chunks} chunks exceed max_tensors={limits.max_tensors}")
        if total_bytes > limits.max_fragment_tensor_bytes:
            raise _layout_error(
                f"{namespace}: loading needs {total_bytes} bytes of dense fields on this rank, over "
                f"max_fragment_tensor_bytes={limits.max_fragment_tensor_bytes}"
            )
        self.destinations = {
            (fqn, name): torch.zeros(live.slots[fqn].geometry.sizes, dtype=torch.float32) for (fqn, name) in self.stored
        }

    # -- reading ---------------------------------------------------------------------

    def read_items(self) -> list[ReadItem]:
        """One read per stored chunk that overlaps this rank's local shard (the whole chunk)."""
        items = []
        for key, (fqn, name) in sorted(self.keys.items()):
            geometry = self.live.slots[fqn].geometry
            for chunk in self.stored[(fqn, name)]:
                if math.prod(chunk.sizes) == 0 or geometry.overlap(chunk.offsets, chunk.sizes) is None:
                    continue
                zeros = torch.Size([0] * len(chunk.offsets))
                items.append(
                    ReadItem(
                        type=LoadItemType.TENSOR,
                        dest_index=MetadataIndex(key, torch.Size(chunk.offsets)),
                        dest_offsets=zeros,
                        storage_index=MetadataIndex(key, torch.Size(chunk.offsets), chunk.index),
                        storage_offsets=zeros,
                        lengths=torch.Size(chunk.sizes),
                    )
                )
        return items

    def resolve(self, item: ReadItem) -> torch.Tensor:
        """A scratch buffer for one whole stored chunk."""
        offsets = tuple(int(o) for o in (item.dest_index.offset or ()))
        buffer = torch.empty(tuple(int(n) for n in item.lengths), dtype=torch.float32)
        with self._lock:
            self._scratch[(item.dest_index.fqn, offsets)] = buffer
        return buffer

    def commit(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Hash the chunk read, copy its overlap with the local shard, drop the scratch buffer."""
        key = item.dest_index.fqn
        offsets = tuple(int(o) for o in (item.dest_index.offset or ()))
        with self._lock:
            buffer = self._scratch.pop((key, offsets), tensor)
        fqn, name = self.keys[key]
        digest = chunk_digest(buffer)
        geometry: ShardGeometry = self.live.slots[fqn].geometry
        sizes = tuple(int(n) for n in buffer.shape)
        overlap = geometry.overlap(offsets, sizes)
        if overlap is not None:
            starts, lengths = overlap
            local = tuple(slice(s - o, s - o + n) for s, o, n in zip(starts, geometry.offsets, lengths))
            inside = tuple(slice(s - o, s - o + n) for s, o, n in zip(starts, offsets, lengths))
            self.destinations[(fqn, name)][local] = buffer[inside]
        with self._lock:
            self._computed[(fqn, name, offsets)] = digest

    # -- after the read --------------------------------------------------------------

    def _tables(self) -> list[DigestTable]:
        tables = []
        for name, buffer in self.table_buffers.items():
            table = decode_digest_table(bytes(buffer.numpy().tobytes()), limits=self.limits)
            if name != f"writer_{table.writer:05d}":
                raise EnvelopeFormatError(f"digest table {name!r} names writer {table.writer}")
            tables.append(table)
        return tables

    def _verify(self, tables: list[DigestTable]) -> None:
        recorded: dict[ChunkKey, tuple[tuple[int, ...], str]] = {}
        for table in tables:
            for record in table.chunks:
                if not record.written:
                    continue
                if record.key in recorded:
                    raise CheckpointIntegrityError(f"chunk {record.key} has digests from two writers")
                recorded[record.key] = (record.sizes, record.digest)
        stored_keys = {
            (fqn, name, chunk.offsets): chunk.sizes for (fqn, name), chunks in self.stored.items() for chunk in chunks
        }
        for key, sizes in stored_keys.items():
            found = recorded.get(key)
            if found is None:
                raise CheckpointIntegrityError(
                    f"stored chunk {key} has no recorded digest (a writer's table is missing)"
                )
            if found[0] != sizes:
                raise CheckpointIntegrityError(f"stored chunk {key} has sizes {sizes} but its digest covers {found[0]}")
        extra = sorted(set(recorded) - set(stored_keys))
        if extra:
            raise CheckpointIntegrityError(f"digest tables list chunks the checkpoint does not hold: {extra[:3]}")
        for key, digest in sorted(self._computed.items()):
            if recorded[key][1] != digest:
                raise CheckpointIntegrityError(
                    f"chunk {key[0]!r}.{key[1]} at offsets {key[2]} is corrupted: its SHA-256 differs from the digest "
                    f"recorded when it was written"
                )

    def finish(self) -> tuple[DenseShardEnvelope, dict[str, Any], dict[str, DenseShardLoad]]:
        """Authenticate and match everything read; return the envelope, common and loads."""
        if self._scratch:
            raise CheckpointIntegrityError(f"{len(self._scratch)} chunk reads never completed")
        envelope = decode_envelope(bytes(self.envelope_buffer.numpy().tobytes()), limits=self.limits)
        self._verify(self._tables())
        live = self.live.envelope
        if envelope.implementation != live.implementation:
            raise _layout_error(
                f"the checkpoint was saved by {envelope.implementation!r}, the optimizer is {live.implementation!r}"
            )
        saved = envelope.by_fqn()
        live_fqns = set(self.live.slots)
        if set(saved) != live_fqns:
            missing, extra = sorted(live_fqns - set(saved)), sorted(set(saved) - live_fqns)
            raise _layout_error(
                f"the checkpoint's parameters differ from the optimizer's (missing {missing[:5]}, unexpected {extra[:5]})"
            )
        loads: dict[str, DenseShardLoad] = {}
        for fqn, entry in sorted(saved.items()):
            geometry = self.live.slots[fqn].geometry
            if entry.global_shape != geometry.global_shape:
                raise _layout_error(
                    f"parameter {fqn!r} was saved with shape {entry.global_shape}, the live one is {geometry.global_shape}"
                )
            present = tuple(sorted(name for (f, name) in self.stored if f == fqn))
            if present != entry.fields:
                raise _layout_error(
                    f"parameter {fqn!r}: the envelope lists fields {entry.fields}, stored are {present}"
                )
            fields: Mapping[str, torch.Tensor] = {name: self.destinations[(fqn, name)] for name in entry.fields}
            loads[fqn] = DenseShardLoad(fqn, entry.options, entry.variant, entry.counters, fields)
        return envelope, dict(envelope.common), loads

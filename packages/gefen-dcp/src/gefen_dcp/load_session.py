"""The load side: check a checkpoint's metadata against the live parameters, read only the
chunks this rank's state tensors need, verify every chunk read, and rebuild the native
state dict.

A :class:`LoadSession` is planned by :class:`~gefen_dcp.GefenLoadPlanner` from DCP's
``Metadata`` before anything is allocated or read: the key layout under the state's
namespace (``tensors/<placement>/<key>``: the placement class and, for ``state/<i>/...``
keys, the parameter are in the key), dtypes, shapes, chunk bounds, overlap and coverage,
and the limits. Each stored chunk that overlaps this rank's local box is read whole into a
scratch buffer, hashed, copied into the destination and dropped, so the transient is one
chunk (one rank's shard of one state tensor). :meth:`LoadSession.finish` then authenticates
the envelope, matches every chunk read against the writers' digest tables and rebuilds the
optimizer's native state dict with each tensor placed for this rank (a DTensor like its
parameter, a replicated DTensor, or a plain tensor).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import dtensor_from_local
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from .digest_table import ChunkKey, DigestTable, chunk_digest, decode_digest_table
from .envelope import (
    DCP_STATE_FORMAT,
    DCP_STATE_FORMAT_VERSION,
    LIKE_PARAMETER,
    PLACEMENTS,
    PLAIN,
    DcpStateEnvelope,
    decode_envelope,
)
from .errors import CheckpointIntegrityError, CheckpointLayoutError, EnvelopeFormatError
from .geometry import ShardGeometry, is_dtensor, local_box
from .row_packs import Member, unpacked
from .save_session import SaveSession
from .skeleton import parameter_index, rebuild

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
    """Planned reads and verification for one DCP state dict (module docstring)."""

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
        tensor_keys: dict[str, tuple[str, str]] = {}
        for key, key_path in planner_data.items():
            if type(key_path) is not tuple or tuple(str(p) for p in key_path[:depth]) != path:
                continue
            rest = tuple(key_path[depth:])
            if rest == ("envelope",):
                envelope_key = key
            elif len(rest) == 2 and rest[0] == "digests" and type(rest[1]) is str:
                table_keys[rest[1]] = key
            elif len(rest) == 3 and rest[0] == "tensors" and rest[1] in PLACEMENTS and type(rest[2]) is str:
                tensor_keys[rest[2]] = (key, rest[1])
            elif rest[:1] == ("dense",):
                raise EnvelopeFormatError(
                    f"{'.'.join(path)!r} holds 'gefen.dense_shard_state' version 1 (dense fp32 fields); this library "
                    f"reads {DCP_STATE_FORMAT!r} version {DCP_STATE_FORMAT_VERSION} (compact state): load it with the "
                    f"gefen-dcp release that wrote it"
                )
            else:
                raise _layout_error(f"{key}: unexpected key {rest} under the DCP state {'.'.join(path)!r}")
        namespace = ".".join(path)
        if envelope_key is None:
            raise _layout_error(f"the checkpoint holds no GefenDCPState under {namespace!r}")
        if not table_keys or len(table_keys) > limits.max_members:
            raise _layout_error(f"{namespace}: expected 1 to {limits.max_members} digest tables, got {len(table_keys)}")
        self.envelope_buffer = torch.empty(_bytes_md(metadata, envelope_key, limits), dtype=torch.uint8)
        self.table_buffers = {
            name: torch.empty(_bytes_md(metadata, key, limits), dtype=torch.uint8)
            for name, key in sorted(table_keys.items())
        }
        self.stored: dict[str, list[StoredChunk]] = {}
        self.placements: dict[str, str] = {}
        self.targets: dict[str, str] = {}
        self.boxes: dict[str, ShardGeometry] = {}
        self.keys: dict[str, str] = {}
        self.destinations: dict[str, torch.Tensor] = {}
        total_chunks = 0
        total_bytes = 0
        parameters = live.parameters
        for name, (key, placement) in sorted(tensor_keys.items()):
            md = _tensor_md(metadata, key)
            size = tuple(int(d) for d in md.size)
            parameter = None
            target = placement
            if placement != PLAIN:
                index = parameter_index(name)
                if index is None or index >= len(parameters):
                    raise _layout_error(
                        f"{key}: a {placement} state tensor of parameter {index} but the optimizer holds "
                        f"{len(parameters)} parameters"
                    )
                parameter = parameters[index]
                if index in live.held_whole:
                    target = PLAIN  # this optimizer keeps the parameter's state whole on every rank
            box = local_box(size, parameter if target == LIKE_PARAMETER else None, where=key)
            chunks = _stored_chunks(md, key, limits)
            _check_chunks(key, size, chunks)
            total_chunks += len(chunks)
            total_bytes += box.numel * md.properties.dtype.itemsize
            self.stored[name] = chunks
            self.placements[name] = placement
            self.targets[name] = target
            self.boxes[name] = box
            self.keys[key] = name
            if total_chunks > limits.max_tensors:
                raise _layout_error(f"{namespace}: more than max_tensors={limits.max_tensors} chunks")
            if total_bytes > limits.max_fragment_tensor_bytes:
                raise _layout_error(
                    f"{namespace}: loading needs more than max_fragment_tensor_bytes={limits.max_fragment_tensor_bytes} "
                    f"bytes of state on this rank"
                )
        # only once every tensor passed the limits: a forged size is refused before it is allocated
        for key, name in self.keys.items():
            dtype = _tensor_md(metadata, key).properties.dtype
            self.destinations[name] = torch.zeros(self.boxes[name].sizes, dtype=dtype)

    # -- reading ---------------------------------------------------------------------

    def read_items(self) -> list[ReadItem]:
        """One read per stored chunk that overlaps this rank's local box (the whole chunk)."""
        items = []
        for key, name in sorted(self.keys.items()):
            box = self.boxes[name]
            for chunk in self.stored[name]:
                if math.prod(chunk.sizes) == 0 or box.overlap(chunk.offsets, chunk.sizes) is None:
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
        name = self.keys[item.dest_index.fqn]
        buffer = torch.empty(tuple(int(n) for n in item.lengths), dtype=self.destinations[name].dtype)
        with self._lock:
            self._scratch[(item.dest_index.fqn, offsets)] = buffer
        return buffer

    def commit(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Hash the chunk read, copy its overlap with the local box, drop the scratch buffer."""
        key = item.dest_index.fqn
        offsets = tuple(int(o) for o in (item.dest_index.offset or ()))
        with self._lock:
            buffer = self._scratch.pop((key, offsets), tensor)
        name = self.keys[key]
        digest = chunk_digest(buffer)
        box = self.boxes[name]
        sizes = tuple(int(n) for n in buffer.shape)
        overlap = box.overlap(offsets, sizes)
        if overlap is not None:
            starts, lengths = overlap
            local = tuple(slice(s - o, s - o + n) for s, o, n in zip(starts, box.offsets, lengths))
            inside = tuple(slice(s - o, s - o + n) for s, o, n in zip(starts, offsets, lengths))
            self.destinations[name][local] = buffer[inside]
        with self._lock:
            self._computed[(name, offsets)] = digest

    # -- after the read --------------------------------------------------------------

    def _tables(self, save_id: str) -> list[DigestTable]:
        tables = []
        for name, buffer in self.table_buffers.items():
            table = decode_digest_table(bytes(buffer.numpy().tobytes()), limits=self.limits)
            if name != f"writer_{table.writer:05d}":
                raise EnvelopeFormatError(f"digest table {name!r} names writer {table.writer}")
            if table.save_id != save_id:
                raise CheckpointIntegrityError(
                    f"writer {table.writer}'s data belongs to save {table.save_id}, the checkpoint's envelope to save "
                    f"{save_id}: files from two saves were mixed"
                )
            tables.append(table)
        return tables

    def _verify(self, tables: list[DigestTable]) -> None:
        recorded: dict[ChunkKey, tuple[tuple[int, ...], str]] = {}
        for table in tables:
            for record in table.chunks:
                if not record.written:
                    continue
                if record.chunk in recorded:
                    raise CheckpointIntegrityError(f"chunk {record.chunk} has digests from two writers")
                recorded[record.chunk] = (record.sizes, record.digest)
        stored_keys = {(name, chunk.offsets): chunk.sizes for name, chunks in self.stored.items() for chunk in chunks}
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
                    f"state tensor {key[0]!r} at offsets {key[1]} is corrupted: its SHA-256 differs from the digest "
                    f"recorded when it was written"
                )

    def _placed(self, name: str, local: torch.Tensor, placement: str, global_shape: tuple[int, ...]) -> torch.Tensor:
        """The loaded tensor ``name`` (its ``local`` piece) as this rank's optimizer holds it."""
        if placement == PLAIN:
            return local
        index = parameter_index(name)
        assert index is not None
        parameter = self.live.parameters[index]
        if not is_dtensor(parameter):
            return local.to(parameter.device)
        from torch.distributed.tensor import Replicate

        mesh = parameter.device_mesh
        placements = parameter.placements if placement == LIKE_PARAMETER else (Replicate(),) * mesh.ndim
        return dtensor_from_local(local.to(parameter.to_local().device), mesh, placements, global_shape)

    def finish(self) -> tuple[DcpStateEnvelope, dict[str, Any]]:
        """Authenticate and match everything read; return the envelope and the native state dict."""
        if self._scratch:
            raise CheckpointIntegrityError(f"{len(self._scratch)} chunk reads never completed")
        envelope = decode_envelope(bytes(self.envelope_buffer.numpy().tobytes()), limits=self.limits)
        self._verify(self._tables(envelope.save_id))
        live = self.live.envelope
        if envelope.implementation != live.implementation:
            raise _layout_error(
                f"the checkpoint was saved by {envelope.implementation!r}, the optimizer is {live.implementation!r}"
            )
        stored = set(self.stored)
        if set(envelope.tensors) != stored:
            missing, extra = sorted(set(envelope.tensors) - stored), sorted(stored - set(envelope.tensors))
            raise _layout_error(
                f"the envelope's tensors differ from the stored ones (missing {missing[:5]}, unexpected {extra[:5]})"
            )
        for name, entry in envelope.tensors.items():
            box = self.boxes[name]
            if entry.shape != box.global_shape or entry.dtype is not self.destinations[name].dtype:
                raise _layout_error(
                    f"state tensor {name!r}: the envelope says {entry.dtype} {entry.shape}, the checkpoint stores "
                    f"{self.destinations[name].dtype} {box.global_shape}"
                )
            if entry.placement != self.placements[name]:
                raise _layout_error(
                    f"state tensor {name!r}: stored as {self.placements[name]}, the envelope says {entry.placement}"
                )

        # a row pack's members, cut out of the pack (each named once: the envelope's check)
        members: dict[str, tuple[torch.Tensor, tuple[int, ...], str]] = {}
        for pack, entry in envelope.tensors.items():
            if entry.members:
                rows = entry.shape[0]
                cut = unpacked(self.destinations[pack], tuple(Member(k, t) for k, t in entry.members))
                for key, trailing in entry.members:
                    if key in members or key in envelope.tensors or parameter_index(key) != parameter_index(pack):
                        raise EnvelopeFormatError(
                            f"row pack {pack!r} names member {key!r} twice or of another parameter"
                        )
                    members[key] = (cut[key], (rows, *trailing), self.targets[pack])

        def tensor(name: str) -> torch.Tensor:
            if name in members:
                local, global_shape, target = members[name]
                return self._placed(name, local, target, global_shape)
            if name not in self.destinations or envelope.tensors[name].members:
                raise EnvelopeFormatError(f"the skeleton names tensor {name!r}, which the checkpoint does not hold")
            return self._placed(name, self.destinations[name], self.targets[name], self.boxes[name].global_shape)

        return envelope, rebuild(envelope.skeleton, tensor)

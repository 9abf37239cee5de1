"""The save side of one ``GefenDCPState.state_dict()`` result.

A :class:`SaveSession` holds the agreed envelope, the local shard geometry of every
parameter, the field source (the live codec, or a frozen snapshot of it), and the chunk
digests computed while the writer consumes the chunks. Its stand-ins
(:mod:`gefen_dcp.standins`) are what DCP plans and writes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import PortableStateLimits

from .digest_table import ChunkKey, ChunkRecord, DigestTable, chunk_digest, encode_digest_table
from .envelope import DenseShardEnvelope, encode_envelope
from .errors import CheckpointLayoutError, DenseFieldError
from .field_source import DenseFieldSource, DenseShardSnapshot, DenseSnapshotSource, FieldReader
from .geometry import RowChunk, ShardGeometry

__all__ = ["SaveSession", "SlotLayout"]


@dataclass(frozen=True, slots=True, eq=False)
class SlotLayout:
    """One local parameter: its FQN, live parameter object, shard geometry and dense fields."""

    fqn: str
    parameter: Any
    geometry: ShardGeometry
    fields: tuple[str, ...]


class SaveSession:
    """Planning and writing state for one dense-shard state dict (see the module docstring)."""

    def __init__(
        self,
        *,
        envelope: DenseShardEnvelope,
        slots: dict[str, SlotLayout],
        source: DenseFieldSource,
        writer: int,
        chunk_bytes: int,
        limits: PortableStateLimits,
        frozen: bool = False,
    ) -> None:
        self.envelope = envelope
        self.envelope_bytes = encode_envelope(envelope, limits=limits)
        self.slots = slots
        self.writer = writer
        self.limits = limits
        self.chunk_bytes = chunk_bytes
        self.frozen = frozen
        self.reader = FieldReader(source, {fqn: slot.geometry.sizes for fqn, slot in slots.items()})
        self._chunks: dict[tuple[str, str], dict[tuple[int, ...], RowChunk]] = {}
        for fqn, slot in slots.items():
            chunks = slot.geometry.row_chunks(chunk_bytes)
            for name in slot.fields:
                self._chunks[(fqn, name)] = {chunk.offsets: chunk for chunk in chunks}
        if sum(len(c) for c in self._chunks.values()) > limits.max_tensors:
            raise CheckpointLayoutError(f"the dense fields need more than max_tensors={limits.max_tensors} chunks")
        self._lock = threading.Lock()
        self._digests: dict[ChunkKey, str] = {}
        self._written: frozenset[ChunkKey] = frozenset()
        self._bound = False
        self._snapshot: SaveSession | None = None
        self._snapshot_lock = threading.Lock()

    # -- planning --------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self._bound

    def bind(self) -> None:
        """Called by :class:`~gefen_dcp.GefenSavePlanner` before DCP plans this session."""
        self._bound = True

    def chunks(self, fqn: str, field: str) -> tuple[RowChunk, ...]:
        return tuple(self._chunks[(fqn, field)].values())

    def local_chunk_keys(self) -> list[tuple[ChunkKey, tuple[int, ...]]]:
        return [
            ((fqn, name, offsets), chunk.sizes)
            for (fqn, name), chunks in sorted(self._chunks.items())
            for offsets, chunk in chunks.items()
        ]

    def mark_written(self, keys: Iterable[ChunkKey]) -> None:
        """The chunks this rank writes after DCP's de-duplication (known when the plan is final)."""
        written = frozenset(keys)
        unknown = [k for k in written if k[2] not in self._chunks.get((k[0], k[1]), {})]
        if unknown:
            raise CheckpointLayoutError(f"DCP planned writes of chunks this rank does not hold: {unknown[:3]}")
        self._written = written

    def _table(self, *, digests: dict[ChunkKey, str]) -> DigestTable:
        records = tuple(
            ChunkRecord(key[0], key[1], key[2], sizes, key in self._written, digests.get(key, "0" * 64))
            for key, sizes in self.local_chunk_keys()
        )
        return DigestTable(self.writer, records)

    def table_nbytes(self) -> int:
        """The digest table's planned size (independent of which chunks end up written)."""
        return len(encode_digest_table(self._table(digests={}), limits=self.limits))

    # -- writing ---------------------------------------------------------------------

    def resolve_chunk(self, fqn: str, field: str, offsets: tuple[int, ...]) -> torch.Tensor:
        """Materialise one chunk (an owned, tight CPU fp32 tensor) and record its digest."""
        chunk = self._chunks.get((fqn, field), {}).get(offsets)
        if chunk is None:
            raise CheckpointLayoutError(f"no local chunk of {fqn!r}.{field} at offsets {offsets}")
        tensor = self.reader.chunk(fqn, field, chunk)
        digest = chunk_digest(tensor)
        with self._lock:
            previous = self._digests.setdefault((fqn, field, offsets), digest)
        if previous != digest:
            raise DenseFieldError(
                f"chunk {fqn!r}.{field} at {offsets} materialised to different values twice during one save; the "
                f"optimizer changed while it was being saved (use an async-safe writer or do not step during a save)"
            )
        return tensor

    def table_bytes(self) -> bytes:
        """The digest table, computing digests of written chunks the writer has not resolved yet."""
        for key in sorted(self._written):
            if key not in self._digests:
                self.resolve_chunk(*key)
        self.reader.release()
        with self._lock:
            digests = dict(self._digests)
        data = encode_digest_table(self._table(digests=digests), limits=self.limits)
        if len(data) != self.table_nbytes():  # pragma: no cover - fixed-width encoding
            raise AssertionError("digest table size changed between planning and writing")
        return data

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> SaveSession:
        """A session over a frozen copy of the field source, taken once per session.

        Repeated calls (several stand-ins of one state dict being copied) share it.
        """
        if self.frozen:
            return self
        with self._snapshot_lock:
            if self._snapshot is None:
                self._snapshot = SaveSession(
                    envelope=self.envelope,
                    slots=self.slots,
                    source=self._frozen_source(),
                    writer=self.writer,
                    chunk_bytes=self.chunk_bytes,
                    limits=self.limits,
                    frozen=True,
                )
            return self._snapshot

    def _frozen_source(self) -> DenseFieldSource:
        source = self.reader.source
        if isinstance(source, DenseShardSnapshot):
            frozen = source.dense_shard_snapshot()
            if not isinstance(frozen, DenseFieldSource):
                raise DenseFieldError("dense_shard_snapshot() must return an object with materialize_dense_field()")
            return frozen
        fields = {}
        for fqn, slot in self.slots.items():
            for name in slot.fields:
                fields[(fqn, name)] = self.reader.whole(fqn, name)
        return DenseSnapshotSource(fields)

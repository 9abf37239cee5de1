"""Per-writer chunk digest tables, ``gefen.dcp_digests`` version 3.

Every rank saves one table listing the state-tensor chunks it holds locally; for each chunk
it actually writes (after DCP's de-duplication of replicas) it records the SHA-256 of the
chunk's little-endian bytes, computed from the very tensor handed to the writer. Chunks another replica writes are listed as absent.
On load, every stored chunk must have exactly one recorded digest across all tables, and
every chunk a rank reads is hashed and compared before any value reaches the optimizer:
corruption and truncation are caught whatever storage reader DCP was given, and after any
resharding.

The table's byte length is fixed when DCP plans (digests and flags have fixed widths), so
it can be planned before the digests exist::

    {"format": "gefen.dcp_digests", "format_version": 3, "writer": int, "save_id": "<32 hex>",
     "chunks": [[key, [offset...], [size...], "w" | "-", "<64 hex or zeros>"], ...]}

``save_id`` is the envelope's: a load refuses a table of another save, so a rank's data
files swapped in from another save of the same run (same names, same sizes) are caught.
(Version 2 had no ``save_id``; version 1, ``gefen.dense_shard_digests``, named dense fields
by FQN and field.)
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import torch
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.validation import exact_int

from .canonical_json import dump_canonical, load_document
from .errors import EnvelopeFormatError

__all__ = [
    "DIGEST_TABLE_FORMAT",
    "DIGEST_TABLE_FORMAT_VERSION",
    "ChunkKey",
    "ChunkRecord",
    "DigestTable",
    "chunk_digest",
    "decode_digest_table",
    "encode_digest_table",
]

DIGEST_TABLE_FORMAT = "gefen.dcp_digests"
DIGEST_TABLE_FORMAT_VERSION = 3
_PLACEHOLDER = "0" * 64
_HEX = frozenset("0123456789abcdef")
_KEYS = frozenset({"format", "format_version", "writer", "save_id", "chunks"})

#: ``(tensor key, global offsets)`` names one stored chunk.
ChunkKey = tuple[str, tuple[int, ...]]


def chunk_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's elements as contiguous little-endian bytes (any dtype)."""
    data = tensor.detach().contiguous().reshape(-1)
    if data.device.type != "cpu":
        raise ValueError("chunk_digest needs a CPU tensor")
    if sys.byteorder == "big" and data.element_size() > 1:  # pragma: no cover - little-endian CI
        raise ValueError("chunk digests are defined on little-endian bytes; big-endian hosts are not supported")
    return hashlib.sha256(data.view(torch.uint8).numpy().data).hexdigest()  # the buffer itself, no copy


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk a writer held: where it sits, whether this writer wrote it, and its digest."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    written: bool
    digest: str

    @property
    def chunk(self) -> ChunkKey:
        return (self.key, self.offsets)


@dataclass(frozen=True, slots=True)
class DigestTable:
    writer: int
    save_id: str
    chunks: tuple[ChunkRecord, ...]


def _record_list(record: ChunkRecord) -> list[object]:
    return [
        record.key,
        list(record.offsets),
        list(record.sizes),
        "w" if record.written else "-",
        record.digest if record.written else _PLACEHOLDER,
    ]


def encode_digest_table(table: DigestTable, *, limits: PortableStateLimits) -> bytes:
    """Canonical bytes of ``table``; the length does not depend on flags or digests."""
    chunks = sorted(table.chunks, key=lambda r: r.chunk)
    for record in chunks:
        if record.written and (len(record.digest) != 64 or not set(record.digest) <= _HEX):
            raise EnvelopeFormatError(f"chunk {record.chunk} has a malformed digest {record.digest!r}")
    value = {
        "format": DIGEST_TABLE_FORMAT,
        "format_version": DIGEST_TABLE_FORMAT_VERSION,
        "writer": table.writer,
        "save_id": table.save_id,
        "chunks": [_record_list(r) for r in chunks],
    }
    return dump_canonical(value, limits=limits, what="digest table")


def _ints(value: object, where: str, limits: PortableStateLimits) -> tuple[int, ...]:
    if type(value) is not list or len(value) > limits.max_tensor_rank:
        raise EnvelopeFormatError(f"{where} must be a list of at most {limits.max_tensor_rank} ints")
    try:
        return tuple(exact_int(v, f"{where}[{i}]", minimum=0, maximum=2**63 - 1) for i, v in enumerate(value))
    except (TypeError, ValueError) as exc:
        raise EnvelopeFormatError(str(exc)) from None


def decode_digest_table(data: bytes, *, limits: PortableStateLimits) -> DigestTable:
    """Parse a digest table (exact keys, format, version, record shapes, sorted records)."""
    value = load_document(
        data,
        limits=limits,
        what="digest table",
        format=DIGEST_TABLE_FORMAT,
        version=DIGEST_TABLE_FORMAT_VERSION,
        keys=_KEYS,
    )
    try:
        writer = exact_int(value["writer"], "digest table writer", minimum=0)
    except (TypeError, ValueError) as exc:
        raise EnvelopeFormatError(str(exc)) from None
    save_id = value["save_id"]
    if type(save_id) is not str or len(save_id) != 32 or not set(save_id) <= _HEX:
        raise EnvelopeFormatError(f"digest table save_id must be 32 lowercase hex digits, got {save_id!r}")
    chunks = value["chunks"]
    if type(chunks) is not list or len(chunks) > limits.max_tensors:
        raise EnvelopeFormatError(f"digest table chunks must be a list of at most {limits.max_tensors} records")
    records = []
    for index, item in enumerate(chunks):
        where = f"digest table chunks[{index}]"
        if type(item) is not list or len(item) != 5:
            raise EnvelopeFormatError(f"{where} must be [key, offsets, sizes, flag, digest]")
        key = item[0]
        if type(key) is not str or not key:
            raise EnvelopeFormatError(f"{where}: the tensor key must be a non-empty str")
        offsets = _ints(item[1], f"{where} offsets", limits)
        sizes = _ints(item[2], f"{where} sizes", limits)
        if len(offsets) != len(sizes):
            raise EnvelopeFormatError(f"{where}: offsets and sizes differ in rank")
        flag, digest = item[3], item[4]
        if flag not in ("w", "-") or type(digest) is not str or len(digest) != 64 or not set(digest) <= _HEX:
            raise EnvelopeFormatError(f"{where}: malformed flag or digest")
        records.append(ChunkRecord(key, offsets, sizes, flag == "w", digest))
    keys = [r.chunk for r in records]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise EnvelopeFormatError("digest table records must be sorted and unique")
    return DigestTable(writer, save_id, tuple(records))

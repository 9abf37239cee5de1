"""Records of a rank-sharded portable checkpoint: ``gefen.portable_dcp`` v2 and
``gefen.portable_dcp_chunks`` v1 (canonical JSON, stored as 1-D ``uint8`` tensors).

The **envelope** (one per checkpoint, identical on every member) names the namespace, the
catalog's completion digest (the *root digest*: it covers every fragment digest), the
digest of the catalog's wire bytes, how many catalog tensors and writers there are, and the
chunk size, with a SHA-256 over all of it::

    {"format": "gefen.portable_dcp", "format_version": 2, "namespace": str,
     "catalog_digest": hex, "catalog_wire_digest": hex, "catalog_tensors": int,
     "writers": int, "chunk_bytes": int, "digest": hex}

Each member writes one **chunk table** for the fragment chunks it wrote, bound to the root
digest: every record is ``[fqn, fragment index, field, start, length, sha256]`` over the
chunk's little-endian bytes (of the field's dtype), sorted::

    {"format": "gefen.portable_dcp_chunks", "format_version": 1, "catalog_digest": hex,
     "writer": int, "chunks": [[...], ...]}
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gefen_contracts.digest import canonical_digest
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.validation import exact_int, identity_name

from .canonical_json import dump_canonical, load_document
from .errors import EnvelopeFormatError

__all__ = [
    "CHUNK_TABLE_FORMAT",
    "CHUNK_TABLE_FORMAT_VERSION",
    "PORTABLE_DCP_FORMAT",
    "PORTABLE_DCP_FORMAT_VERSION",
    "ChunkTable",
    "FragmentChunk",
    "PortableEnvelope",
    "check_namespace",
    "decode_chunk_table",
    "decode_portable_envelope",
    "encode_chunk_table",
    "encode_portable_envelope",
]

PORTABLE_DCP_FORMAT = "gefen.portable_dcp"
#: v2: the catalog is ``gefen.portable_state_catalog`` v2 and fragment fields keep their
#: dtype (compact codes and block scales) instead of dense fp32; v1 is refused
PORTABLE_DCP_FORMAT_VERSION = 2
CHUNK_TABLE_FORMAT = "gefen.portable_dcp_chunks"
CHUNK_TABLE_FORMAT_VERSION = 1
_NAMESPACE = re.compile(r"^[A-Za-z0-9_-]+$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_ENVELOPE_KEYS = frozenset(
    {
        "format",
        "format_version",
        "namespace",
        "catalog_digest",
        "catalog_wire_digest",
        "catalog_tensors",
        "writers",
        "chunk_bytes",
        "digest",
    }
)
_TABLE_KEYS = frozenset({"format", "format_version", "catalog_digest", "writer", "chunks"})


def field_name(value: object, where: str) -> str:
    """A field name: an identity name without dots (it becomes a DCP key component)."""
    try:
        name = identity_name(value, where)
    except (TypeError, ValueError) as exc:
        raise EnvelopeFormatError(str(exc)) from None
    if "." in name:
        raise EnvelopeFormatError(f"{where} {name!r} must not contain '.' (it becomes a DCP key component)")
    return name


def check_namespace(namespace: object, limits: PortableStateLimits) -> str:
    """A namespace: ASCII letters, digits, ``_`` and ``-`` only (no ``.``), within the string limit."""
    if type(namespace) is not str or not _NAMESPACE.match(namespace):
        raise EnvelopeFormatError(
            f"namespace must be a non-empty str of ASCII letters, digits, '_' and '-', got {namespace!r}"
        )
    if len(namespace) > limits.max_string_bytes:
        raise EnvelopeFormatError(f"namespace is longer than max_string_bytes={limits.max_string_bytes}")
    return namespace


def _hex(value: object, where: str) -> str:
    if type(value) is not str or not _HEX.match(value):
        raise EnvelopeFormatError(f"{where} must be 64 lowercase hex characters")
    return value


def _int(value: object, where: str, minimum: int = 0) -> int:
    try:
        return exact_int(value, where, minimum=minimum, maximum=2**63 - 1)
    except (TypeError, ValueError) as exc:
        raise EnvelopeFormatError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class PortableEnvelope:
    namespace: str
    catalog_digest: str
    catalog_wire_digest: str
    catalog_tensors: int
    writers: int
    chunk_bytes: int

    def body(self) -> dict[str, object]:
        return {
            "format": PORTABLE_DCP_FORMAT,
            "format_version": PORTABLE_DCP_FORMAT_VERSION,
            "namespace": self.namespace,
            "catalog_digest": self.catalog_digest,
            "catalog_wire_digest": self.catalog_wire_digest,
            "catalog_tensors": self.catalog_tensors,
            "writers": self.writers,
            "chunk_bytes": self.chunk_bytes,
        }


def encode_portable_envelope(envelope: PortableEnvelope, *, limits: PortableStateLimits) -> bytes:
    body = envelope.body()
    return dump_canonical({**body, "digest": canonical_digest(body)}, limits=limits, what="portable DCP envelope")


def decode_portable_envelope(data: bytes, *, limits: PortableStateLimits) -> PortableEnvelope:
    """Parse and authenticate an envelope (exact keys, format, version, digest)."""
    value = load_document(
        data,
        limits=limits,
        what="portable DCP envelope",
        format=PORTABLE_DCP_FORMAT,
        version=PORTABLE_DCP_FORMAT_VERSION,
        keys=_ENVELOPE_KEYS,
        older="version 1 stored dense fp32 fields; save it again",
    )
    body = {k: v for k, v in value.items() if k != "digest"}
    if value["digest"] != canonical_digest(body):
        raise EnvelopeFormatError("the portable DCP envelope's digest does not match its content (corrupted)")
    return PortableEnvelope(
        check_namespace(value["namespace"], limits),
        _hex(value["catalog_digest"], "envelope catalog_digest"),
        _hex(value["catalog_wire_digest"], "envelope catalog_wire_digest"),
        _int(value["catalog_tensors"], "envelope catalog_tensors"),
        _int(value["writers"], "envelope writers", minimum=1),
        _int(value["chunk_bytes"], "envelope chunk_bytes", minimum=1),
    )


@dataclass(frozen=True, slots=True)
class FragmentChunk:
    """One stored chunk of one field of one fragment: elements ``[start, start + length)``."""

    fqn: str
    index: int
    field: str
    start: int
    length: int
    digest: str

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.fqn, self.index, self.field, self.start)


@dataclass(frozen=True, slots=True)
class ChunkTable:
    catalog_digest: str
    writer: int
    chunks: tuple[FragmentChunk, ...]


def encode_chunk_table(table: ChunkTable, *, limits: PortableStateLimits) -> bytes:
    chunks = sorted(table.chunks, key=lambda c: c.key)
    value = {
        "format": CHUNK_TABLE_FORMAT,
        "format_version": CHUNK_TABLE_FORMAT_VERSION,
        "catalog_digest": table.catalog_digest,
        "writer": table.writer,
        "chunks": [[c.fqn, c.index, c.field, c.start, c.length, c.digest] for c in chunks],
    }
    return dump_canonical(value, limits=limits, what="portable DCP chunk table")


def decode_chunk_table(data: bytes, *, limits: PortableStateLimits) -> ChunkTable:
    """Parse a chunk table (exact keys, format, version, record shapes, sorted and unique)."""
    value = load_document(
        data,
        limits=limits,
        what="portable DCP chunk table",
        format=CHUNK_TABLE_FORMAT,
        version=CHUNK_TABLE_FORMAT_VERSION,
        keys=_TABLE_KEYS,
    )
    records = value["chunks"]
    if type(records) is not list or len(records) > limits.max_tensors:
        raise EnvelopeFormatError(f"chunk table chunks must be a list of at most {limits.max_tensors} records")
    chunks = []
    for position, item in enumerate(records):
        where = f"chunk table chunks[{position}]"
        if type(item) is not list or len(item) != 6:
            raise EnvelopeFormatError(f"{where} must be [fqn, index, field, start, length, sha256]")
        try:
            fqn = identity_name(item[0], f"{where} fqn")
        except (TypeError, ValueError) as exc:
            raise EnvelopeFormatError(str(exc)) from None
        chunks.append(
            FragmentChunk(
                fqn,
                _int(item[1], f"{where} index"),
                field_name(item[2], f"{where} field"),
                _int(item[3], f"{where} start"),
                _int(item[4], f"{where} length"),
                _hex(item[5], f"{where} sha256"),
            )
        )
    keys = [c.key for c in chunks]
    if keys != sorted(keys) or len(set(keys)) != len(keys):
        raise EnvelopeFormatError("chunk table records must be sorted and unique")
    return ChunkTable(
        _hex(value["catalog_digest"], "chunk table catalog_digest"),
        _int(value["writer"], "chunk table writer"),
        tuple(chunks),
    )


COMPOSITE_DCP_FORMAT = "gefen.portable_dcp_composite"
COMPOSITE_DCP_FORMAT_VERSION = 1
_COMPOSITE_KEYS = frozenset(
    {
        "format",
        "format_version",
        "namespace",
        "implementation",
        "roles",
        "routing",
        "children",
        "wrapper_digest",
        "digest",
    }
)


@dataclass(frozen=True, slots=True)
class CompositeEnvelope:
    """A composite optimizer's record (``gefen.portable_dcp_composite`` v1): its implementation,
    roles in order, the FQN -> role routing, each child's catalog root digest and the
    ``gefen.portable_composite_state`` wrapper digest over all of them; each child's state is
    stored below ``ns.roles.<role>`` like a non-composite one."""

    namespace: str
    implementation: str
    roles: tuple[str, ...]
    routing: tuple[tuple[str, str], ...]
    children: tuple[tuple[str, str], ...]
    wrapper_digest: str

    def body(self) -> dict[str, object]:
        return {
            "format": COMPOSITE_DCP_FORMAT,
            "format_version": COMPOSITE_DCP_FORMAT_VERSION,
            "namespace": self.namespace,
            "implementation": self.implementation,
            "roles": list(self.roles),
            "routing": dict(self.routing),
            "children": dict(self.children),
            "wrapper_digest": self.wrapper_digest,
        }


def encode_composite_envelope(envelope: CompositeEnvelope, *, limits: PortableStateLimits) -> bytes:
    body = envelope.body()
    return dump_canonical({**body, "digest": canonical_digest(body)}, limits=limits, what="composite DCP envelope")


def _names(value: object, where: str) -> tuple[str, ...]:
    if type(value) is not list:
        raise EnvelopeFormatError(f"{where} must be a list of names")
    try:
        names = tuple(identity_name(v, f"{where} item") for v in value)
    except (TypeError, ValueError) as exc:
        raise EnvelopeFormatError(str(exc)) from None
    if len(set(names)) != len(names):
        raise EnvelopeFormatError(f"{where} must not repeat a name")
    return names


def decode_composite_envelope(data: bytes, *, limits: PortableStateLimits) -> CompositeEnvelope:
    """Parse and authenticate a composite envelope (exact keys, format, version, digest, roles)."""
    value = load_document(
        data,
        limits=limits,
        what="composite DCP envelope",
        format=COMPOSITE_DCP_FORMAT,
        version=COMPOSITE_DCP_FORMAT_VERSION,
        keys=_COMPOSITE_KEYS,
    )
    body = {k: v for k, v in value.items() if k != "digest"}
    if value["digest"] != canonical_digest(body):
        raise EnvelopeFormatError("the composite DCP envelope's digest does not match its content (corrupted)")
    roles = _names(value["roles"], "composite envelope roles")
    routing, children = value["routing"], value["children"]
    if type(routing) is not dict or any(type(r) is not str or r not in roles for r in routing.values()):
        raise EnvelopeFormatError("composite envelope routing must map FQNs to listed roles")
    if type(children) is not dict or set(children) != set(roles):
        raise EnvelopeFormatError("composite envelope children must give one catalog digest per role")
    try:
        implementation = identity_name(value["implementation"], "composite envelope implementation")
    except (TypeError, ValueError) as exc:
        raise EnvelopeFormatError(str(exc)) from None
    return CompositeEnvelope(
        check_namespace(value["namespace"], limits),
        implementation,
        roles,
        tuple(sorted(routing.items())),
        tuple((role, _hex(children[role], f"composite envelope children[{role!r}]")) for role in roles),
        _hex(value["wrapper_digest"], "composite envelope wrapper_digest"),
    )


__all__ += [
    "COMPOSITE_DCP_FORMAT",
    "COMPOSITE_DCP_FORMAT_VERSION",
    "CompositeEnvelope",
    "decode_composite_envelope",
    "encode_composite_envelope",
]

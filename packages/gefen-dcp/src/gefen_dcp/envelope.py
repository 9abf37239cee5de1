"""The DCP state envelope, ``gefen.dcp_state`` version 4.

One envelope per checkpoint holds everything about an optimizer's saved state that is not
tensor data: the implementation name, the skeleton of its native state dict
(:mod:`gefen_dcp.skeleton`) and, per tensor key, its dtype, global shape and placement
class. It is identical on every rank (the ranks agree on its digest before saving) and is
stored as a 1-D ``uint8`` tensor of canonical JSON::

    {"format": "gefen.dcp_state", "format_version": 4,
     "save_id": "<32 hex>", "implementation": str, "skeleton": {...},
     "tensors": {key: {"dtype": str, "shape": [int...], "placement": str,
                       "members": [[key, [int...]], ...]}},   (members: row packs only)
     "digest": "<sha256 of the rest, gefen_contracts.digest.canonical_digest>"}

Placement classes: ``like_parameter`` (a DTensor on its parameter's mesh with the
parameter's placements, e.g. momentum codes or per-row scales under FSDP2),
``replicated`` (a DTensor replicated on its parameter's mesh, e.g. ``v_col``) and
``plain`` (an ordinary tensor equal on every rank, e.g. a codebook or a counter).
``save_id`` is one random 128-bit identity per save, agreed by every rank and repeated in
every writer's digest table (:mod:`gefen_dcp.digest_table`), so data files mixed from two
saves are refused. A row pack (:mod:`gefen_dcp.row_packs`) lists its ``members``: the
fields it holds side by side, each with its shape past the first dimension. Version 3 (no row
packs), version 2 (no ``save_id``) and version 1 (dense fp32 fields per parameter,
``gefen.dense_shard_state``) are refused naming both versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from gefen_contracts import CodecError
from gefen_contracts.digest import canonical_digest
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import dtype_from_name, dtype_name
from gefen_contracts.validation import exact_int, identity_name

from .canonical_json import dump_canonical, load_document
from .errors import EnvelopeFormatError

__all__ = [
    "DCP_STATE_FORMAT",
    "DCP_STATE_FORMAT_VERSION",
    "LIKE_PARAMETER",
    "PLACEMENTS",
    "PLAIN",
    "REPLICATED",
    "DcpStateEnvelope",
    "TensorEntry",
    "decode_envelope",
    "encode_envelope",
    "is_save_id",
]

DCP_STATE_FORMAT = "gefen.dcp_state"
DCP_STATE_FORMAT_VERSION = 4
_OLDER = (
    "'gefen.dense_shard_state' version 1 held dense fp32 fields, versions 2 and 3 had neither row packs nor writers "
    "bound to one save: load it with the gefen-dcp release that wrote it and save it again"
)
LIKE_PARAMETER = "like_parameter"
REPLICATED = "replicated"
PLAIN = "plain"
PLACEMENTS = (LIKE_PARAMETER, REPLICATED, PLAIN)
_TOP_KEYS = frozenset({"format", "format_version", "save_id", "implementation", "skeleton", "tensors", "digest"})
_TENSOR_KEYS = frozenset({"dtype", "shape", "placement"})
_HEX = frozenset("0123456789abcdef")


def is_save_id(value: object) -> bool:
    """A save identity: 32 lowercase hex digits."""
    return type(value) is str and len(value) == 32 and set(value) <= _HEX


def _fail(message: str) -> EnvelopeFormatError:
    return EnvelopeFormatError(message)


def _dtype(name: object, where: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except CodecError as exc:
        raise _fail(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One saved tensor: its dtype, global shape and placement class; for a row pack
    (:mod:`gefen_dcp.row_packs`), its members as ``(key, shape past the first dimension)``
    in column order."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    placement: str
    members: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def record(self) -> dict[str, object]:
        try:
            name = dtype_name(self.dtype)
        except CodecError as exc:
            raise _fail(f"a state tensor cannot be saved: {exc}") from None
        record: dict[str, object] = {"dtype": name, "shape": list(self.shape), "placement": self.placement}
        if self.members:
            record["members"] = [[key, list(trailing)] for key, trailing in self.members]
        return record


@dataclass(frozen=True, slots=True, eq=False)
class DcpStateEnvelope:
    """A decoded envelope."""

    implementation: str
    skeleton: object
    tensors: dict[str, TensorEntry]
    save_id: str
    _digest: list[str] = field(default_factory=list, repr=False)  # memo of digest(): the fields never change

    def body(self) -> dict[str, object]:
        """The primitive record the digest covers."""
        return {
            "format": DCP_STATE_FORMAT,
            "format_version": DCP_STATE_FORMAT_VERSION,
            "save_id": self.save_id,
            "implementation": self.implementation,
            "skeleton": self.skeleton,
            "tensors": {key: entry.record() for key, entry in sorted(self.tensors.items())},
        }

    def digest(self) -> str:
        """The digest of :meth:`body` (computed once: a save asks for it when the ranks agree on
        the layout, when it encodes the envelope and when an async save snapshots)."""
        if not self._digest:
            self._digest.append(canonical_digest(self.body()))
        return self._digest[0]


def encode_envelope(envelope: DcpStateEnvelope, *, limits: PortableStateLimits) -> bytes:
    """Canonical bytes of ``envelope`` with its digest."""
    body = envelope.body()
    return dump_canonical({**body, "digest": envelope.digest()}, limits=limits, what="DCP state envelope")


def _dims(value: object, where: str, limits: PortableStateLimits) -> tuple[int, ...]:
    if type(value) is not list or len(value) > limits.max_tensor_rank:
        raise _fail(f"{where} must be a list of at most {limits.max_tensor_rank} ints")
    try:
        return tuple(exact_int(d, f"{where}[{i}]", minimum=0, maximum=2**63 - 1) for i, d in enumerate(value))
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None


def _members(
    value: object, where: str, shape: tuple[int, ...], limits: PortableStateLimits
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A row pack's members: two or more ``[key, trailing dims]`` whose widths add up to the
    pack's second dimension."""
    if type(value) is not list or not 2 <= len(value) <= limits.max_tensors or len(shape) != 2:
        raise _fail(f"{where} must list two or more members of a 2-D pack")
    members = []
    for i, item in enumerate(value):
        if type(item) is not list or len(item) != 2 or type(item[0]) is not str or not item[0]:
            raise _fail(f"{where}[{i}] must be [key, [dims...]]")
        members.append((item[0], _dims(item[1], f"{where}[{i}][1]", limits)))
    if sum(math.prod(trailing) for _, trailing in members) != shape[1] or len({k for k, _ in members}) != len(members):
        raise _fail(f"{where}: the members' widths must add up to the pack's {shape[1]} columns, each key once")
    return tuple(members)


def _tensor_entry(key: object, record: object, limits: PortableStateLimits) -> TensorEntry:
    where = f"envelope tensors[{key!r}]"
    if type(record) is not dict or not _TENSOR_KEYS <= set(record) <= _TENSOR_KEYS | {"members"}:
        raise _fail(f"{where} must be a dict with keys {sorted(_TENSOR_KEYS)} (and 'members' for a row pack)")
    dims = _dims(record["shape"], f"{where}.shape", limits)
    if record["placement"] not in PLACEMENTS:
        raise _fail(f"{where}.placement must be one of {list(PLACEMENTS)}, got {record['placement']!r}")
    members = _members(record["members"], f"{where}.members", dims, limits) if "members" in record else ()
    if members and record["placement"] != LIKE_PARAMETER:
        raise _fail(f"{where}: a row pack is placed like its parameter, got {record['placement']!r}")
    return TensorEntry(_dtype(record["dtype"], where), dims, record["placement"], members)


def decode_envelope(data: bytes, *, limits: PortableStateLimits) -> DcpStateEnvelope:
    """Parse and authenticate envelope bytes (format, version, exact keys, digest)."""
    value = load_document(
        data,
        limits=limits,
        what="DCP state envelope",
        format=DCP_STATE_FORMAT,
        version=DCP_STATE_FORMAT_VERSION,
        keys=_TOP_KEYS,
        older=_OLDER,
    )
    if not is_save_id(value["save_id"]):
        raise _fail(f"envelope save_id must be 32 lowercase hex digits, got {value['save_id']!r}")
    body = {k: v for k, v in value.items() if k != "digest"}
    if value["digest"] != canonical_digest(body):
        raise _fail("the DCP state envelope's digest does not match its content (corrupted metadata)")
    try:
        implementation = identity_name(value["implementation"], "envelope implementation")
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    tensors = value["tensors"]
    if type(tensors) is not dict:
        raise _fail("envelope tensors must be a dict keyed by tensor key")
    entries = {key: _tensor_entry(key, record, limits) for key, record in sorted(tensors.items())}
    return DcpStateEnvelope(implementation, value["skeleton"], entries, value["save_id"])

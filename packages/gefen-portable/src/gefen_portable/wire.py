"""The canonical wire codec: a primitive tree with tensors <-> metadata bytes + tight tensors.

The value domain is ``None``, ``bool``, ``int``, finite ``float``, ``str``, ``list``, ``dict``
with ``str`` keys, and tensors of the twelve dtypes of :data:`~gefen_portable.tensors.DTYPE_BY_CODE`
(exact types; tuples are not part of the domain, so one value has exactly one encoding).

Metadata layout (all integers unsigned big-endian)::

    preamble    8 bytes   b"GFNPSW1\\0"
    header      u16 codec version = 1, u16 flags = 0, u32 reserved = 0
    root        one value (grammar below)
    count       u64 number of tensor descriptors
    descriptor  u16 dtype code, u16 rank, u32 flags = 0, rank x u64 dimension,
                u64 numel, u64 nbytes, 32-byte tensor digest          (count times)
    trailer     32-byte SHA-256 of b"gefen.portable_wire.metadata.v1\\0" + every byte above

==========  ======  ============================================================
tag         type    body
==========  ======  ============================================================
``0x00``    None    -
``0x01``    False   -
``0x02``    True    -
``0x03``    int     u8 sign (0 or 1), u64 length, big-endian magnitude without a
                    leading zero byte (zero has length 0 and sign 0)
``0x04``    float   binary64 (finite; ``-0.0`` kept)
``0x05``    str     u64 length, UTF-8
``0x06``    list    u64 count, items
``0x07``    dict    u64 count, then (``0x05`` key, value) pairs, keys strictly increasing
``0x08``    tensor  u64 index into the descriptors; indices appear as 0, 1, 2, ... in a
                    depth-first walk
==========  ======  ============================================================

The tensor digest is the contracts' digest of the tensor as a root value
(:func:`gefen_contracts.torch_support.tensor_digest`: dtype name, shape, byte count and the
row-major little-endian bytes), so there is one digest grammar in the project; the trailer
(the *metadata digest*) covers every descriptor and therefore every tensor digest. Tensor
payloads travel separately as their native little-endian bytes.

:func:`parse_wire` checks every limit of :class:`~gefen_contracts.limits.PortableStateLimits` and
every canonical-form rule before anything is allocated; :func:`reconstruct_wire` then checks
each payload tensor against its descriptor and digest before building fresh containers.
Differences from the reference (spec section 3): a trailer digest inside the metadata (so any
corruption of a stored payload is caught by the parser alone), no tuple tag, the contracts'
tensor digest instead of a second tensor-digest grammar, and no separate fragment digest
(the trailer already covers every tensor digest).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gefen_contracts import ContractTypeError
from gefen_contracts.limits import PortableStateLimits

from .errors import PortableIntegrityError, PortableLimitError, PortableStateError, WireFormatError
from .tensors import (
    DTYPE_BY_CODE,
    DTYPE_CODES,
    check_finite,
    is_tight_cpu,
    owned_cpu_copy,
    require_little_endian,
    tensor_nbytes,
    tensor_sha256,
)

__all__ = [
    "WIRE_CODEC_VERSION",
    "WIRE_PREAMBLE",
    "TensorSpec",
    "WireLayout",
    "WirePayload",
    "bounded_clone",
    "decode_wire",
    "encode_wire",
    "parse_wire",
    "reconstruct_wire",
    "require_limits",
]

WIRE_PREAMBLE = b"GFNPSW1\x00"
WIRE_CODEC_VERSION = 1
_METADATA_DOMAIN = b"gefen.portable_wire.metadata.v1\x00"
_TRAILER = 32
_HEADER = struct.Struct(">HHI")
_U8 = struct.Struct(">B")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")
_DESCRIPTOR_HEAD = struct.Struct(">HHI")
_MAX_DIMENSION = 2**63 - 1
_U64_MAX = 2**64 - 1

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _LIST, _DICT, _TENSOR = range(9)


def require_limits(limits: object) -> PortableStateLimits:
    """Return ``limits`` if it is exactly a :class:`PortableStateLimits` (``ContractTypeError`` otherwise)."""
    if type(limits) is not PortableStateLimits:
        raise ContractTypeError(f"limits must be a PortableStateLimits, got {type(limits).__name__}")
    return limits


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor descriptor: what a payload tensor must be, checked before it is used."""

    dtype_code: int
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    digest: bytes

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_BY_CODE[self.dtype_code].dtype


@dataclass(frozen=True, slots=True, eq=False)
class WirePayload:
    """An encoded value: canonical ``metadata`` bytes and the payload ``tensors`` in descriptor order.

    The tensors are tight CPU tensors; a tight CPU input tensor is referenced, not copied,
    unless ``encode_wire(..., copy=True)`` was asked for.
    """

    metadata: bytes
    tensors: tuple[torch.Tensor, ...]
    specs: tuple[TensorSpec, ...]

    @property
    def digest(self) -> str:
        """The metadata digest (the trailer) as 64 lowercase hex characters."""
        return self.metadata[-_TRAILER:].hex()

    @property
    def tensor_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


class _TensorRef:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass(frozen=True, slots=True, eq=False)
class WireLayout:
    """A parsed, fully validated metadata buffer; no tensor has been allocated yet."""

    root: object
    specs: tuple[TensorSpec, ...]
    digest: str
    metadata_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


def _seal(body: bytes) -> bytes:
    return body + hashlib.sha256(_METADATA_DOMAIN + body).digest()


# -- encoding --------------------------------------------------------------------------------


class _Encoder:
    def __init__(self, limits: PortableStateLimits, copy: bool) -> None:
        self.limits = limits
        self.copy = copy
        self.parts: list[bytes] = []
        self.size = 0
        self.nodes = 0
        self.tensors: list[torch.Tensor] = []
        self.specs: list[TensorSpec] = []
        self.tensor_bytes = 0

    def append(self, data: bytes) -> None:
        self.size += len(data)
        # reserve the 32-byte trailer so the sealed metadata still fits the limit
        if self.size + _TRAILER > self.limits.max_metadata_bytes:
            raise PortableLimitError("max_metadata_bytes", "the encoded metadata grows too large")
        self.parts.append(data)

    def visit(self, value: object, depth: int, path: str) -> None:
        self.nodes += 1
        if self.nodes > self.limits.max_tree_nodes:
            raise PortableLimitError("max_tree_nodes", f"too many values at {path}")
        if depth > self.limits.max_tree_depth:
            raise PortableLimitError("max_tree_depth", f"nesting too deep at {path}")
        kind = type(value)
        if value is None:
            self.append(bytes((_NONE,)))
        elif kind is bool:
            self.append(bytes((_TRUE if value else _FALSE,)))
        elif kind is int:
            self.integer(value, path)  # type: ignore[arg-type]
        elif kind is float:
            if not math.isfinite(value):  # type: ignore[arg-type]
                raise PortableStateError(f"{path} is a non-finite float")
            self.append(bytes((_FLOAT,)) + _F64.pack(value))
        elif kind is str:
            self.string(value, path)  # type: ignore[arg-type]
        elif kind is list:
            items: list[object] = value  # type: ignore[assignment]
            self.count(len(items), path)
            self.append(bytes((_LIST,)) + _U64.pack(len(items)))
            for index, item in enumerate(items):
                self.visit(item, depth + 1, f"{path}[{index}]")
        elif kind is dict:
            mapping: dict[object, object] = value  # type: ignore[assignment]
            self.count(len(mapping), path)
            # check every key before sorting: sorted() on mixed key types would raise a bare TypeError
            for key in mapping:
                if type(key) is not str:
                    raise PortableStateError(f"{path} has a non-str key of type {type(key).__name__}")
            self.append(bytes((_DICT,)) + _U64.pack(len(mapping)))
            for key in sorted(mapping):  # type: ignore[type-var]
                assert type(key) is str
                # a key counts as a node at the child depth, as _Reader.value counts it, so both enforce one limit
                self.nodes += 1
                if self.nodes > self.limits.max_tree_nodes:
                    raise PortableLimitError("max_tree_nodes", f"too many values at {path}")
                if depth + 1 > self.limits.max_tree_depth:
                    raise PortableLimitError("max_tree_depth", f"nesting too deep at {path}")
                self.string(key, f"{path} key")
                self.visit(mapping[key], depth + 1, f"{path}[{key!r}]")
        elif isinstance(value, torch.Tensor):
            self.tensor(value, path)
        elif kind is tuple:
            raise PortableStateError(f"{path} is a tuple; the wire value domain has lists only")
        else:
            raise PortableStateError(f"{path} holds an unsupported value of type {kind.__name__}")

    def count(self, count: int, path: str) -> None:
        if count > self.limits.max_container_items:
            raise PortableLimitError("max_container_items", f"{path} has {count} items")

    def integer(self, value: int, path: str) -> None:
        length = (abs(value).bit_length() + 7) // 8
        if length > self.limits.max_integer_bytes:
            raise PortableLimitError("max_integer_bytes", f"{path} is an integer of {length} bytes")
        magnitude = abs(value).to_bytes(length, "big")
        self.append(bytes((_INT, 1 if value < 0 else 0)) + _U64.pack(length) + magnitude)

    def string(self, value: str, path: str) -> None:
        if len(value) > self.limits.max_string_bytes:
            raise PortableLimitError("max_string_bytes", f"{path} is a string of {len(value)} characters")
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PortableStateError(f"{path} is not encodable as UTF-8: {exc.reason}") from None
        if len(data) > self.limits.max_string_bytes:
            raise PortableLimitError("max_string_bytes", f"{path} is a string of {len(data)} UTF-8 bytes")
        self.append(bytes((_STR,)) + _U64.pack(len(data)) + data)

    def tensor(self, value: torch.Tensor, path: str) -> None:
        if type(value) is not torch.Tensor:
            raise PortableStateError(f"{path} must be exactly torch.Tensor, got {type(value).__name__}")
        if value.layout is not torch.strided or value.is_meta:
            raise PortableStateError(f"{path} must be a materialized strided tensor")
        row = DTYPE_CODES.get(value.dtype)
        if row is None:
            raise PortableStateError(f"{path} has dtype {value.dtype}, which the wire codec cannot encode")
        if value.dim() > self.limits.max_tensor_rank:
            raise PortableLimitError("max_tensor_rank", f"{path} has rank {value.dim()}")
        if len(self.tensors) + 1 > self.limits.max_tensors:
            raise PortableLimitError("max_tensors", f"too many tensors at {path}")
        nbytes = tensor_nbytes(value)
        if self.tensor_bytes + nbytes > self.limits.max_fragment_tensor_bytes:
            raise PortableLimitError("max_fragment_tensor_bytes", f"tensor bytes exceed the bound at {path}")
        self.tensor_bytes += nbytes
        tight = value if (not self.copy and is_tight_cpu(value)) else None
        if tight is None:
            tight = owned_cpu_copy(value, chunk_bytes=self.limits.chunk_bytes)
        check_finite(tight, path)
        spec = TensorSpec(row.code, tuple(tight.shape), tight.numel(), nbytes, tensor_sha256(tight))
        self.append(bytes((_TENSOR,)) + _U64.pack(len(self.tensors)))
        self.tensors.append(tight)
        self.specs.append(spec)

    def finish(self) -> bytes:
        self.append(_U64.pack(len(self.specs)))
        for spec in self.specs:
            head = _DESCRIPTOR_HEAD.pack(spec.dtype_code, len(spec.shape), 0)
            dims = b"".join(_U64.pack(d) for d in spec.shape)
            self.append(head + dims + _U64.pack(spec.numel) + _U64.pack(spec.nbytes) + spec.digest)
        return _seal(b"".join(self.parts))


def encode_wire(value: object, *, limits: PortableStateLimits, copy: bool = False) -> WirePayload:
    """Encode ``value`` (see the module docstring), enforcing every limit while walking it.

    Each structural limit is checked as the walk reaches it, and each tensor's count, rank
    and byte limits are checked before that tensor is copied or hashed. Raises
    :class:`PortableLimitError` or :class:`PortableStateError` naming the path.
    """
    require_limits(limits)
    require_little_endian()
    encoder = _Encoder(limits, copy)
    encoder.append(WIRE_PREAMBLE + _HEADER.pack(WIRE_CODEC_VERSION, 0, 0))
    encoder.visit(value, 0, "value")
    metadata = encoder.finish()
    return WirePayload(metadata, tuple(encoder.tensors), tuple(encoder.specs))


# -- parsing ---------------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes, end: int, limits: PortableStateLimits) -> None:
        self.data = data
        self.pos = 0
        self.end = end
        self.limits = limits
        self.nodes = 0
        self.refs = 0

    def take(self, count: int, what: str) -> bytes:
        if count > self.end - self.pos:
            raise WireFormatError(f"wire metadata is truncated inside {what} at byte {self.pos}")
        start = self.pos
        self.pos += count
        return self.data[start : self.pos]

    def u8(self, what: str) -> int:
        return int(_U8.unpack(self.take(1, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack(self.take(8, what))[0])

    def node(self, depth: int) -> None:
        self.nodes += 1
        if self.nodes > self.limits.max_tree_nodes:
            raise PortableLimitError("max_tree_nodes", "wire metadata holds too many values")
        if depth > self.limits.max_tree_depth:
            raise PortableLimitError("max_tree_depth", "wire metadata is nested too deeply")

    def count(self, what: str) -> int:
        count = self.u64(what)
        if count > self.limits.max_container_items:
            raise PortableLimitError("max_container_items", f"a wire {what} announces {count} items")
        # every item takes at least one byte: refuse an impossible count before building its container
        if count > self.end - self.pos:
            raise WireFormatError(f"a wire {what} announces {count} items but only {self.end - self.pos} bytes remain")
        return count

    def string_body(self) -> str:
        length = self.u64("a string length")
        if length > self.limits.max_string_bytes:
            raise PortableLimitError("max_string_bytes", f"a wire string announces {length} bytes")
        raw = self.take(length, "a string")
        try:
            return raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            raise WireFormatError(f"a wire string at byte {self.pos - length} is not valid UTF-8") from None

    def value(self, depth: int) -> object:
        self.node(depth)
        tag = self.u8("a tag")
        if tag == _NONE:
            return None
        if tag == _FALSE:
            return False
        if tag == _TRUE:
            return True
        if tag == _INT:
            sign = self.u8("an integer sign")
            if sign > 1:
                raise WireFormatError(f"integer sign byte {sign} is not 0 or 1")
            length = self.u64("an integer length")
            if length > self.limits.max_integer_bytes:
                raise PortableLimitError("max_integer_bytes", f"a wire integer announces {length} bytes")
            magnitude = self.take(length, "an integer")
            if length and magnitude[0] == 0:
                raise WireFormatError("integer magnitude has a leading zero byte (non-canonical)")
            if not length and sign:
                raise WireFormatError("negative zero integer (non-canonical)")
            number = int.from_bytes(magnitude, "big")
            return -number if sign else number
        if tag == _FLOAT:
            real = float(_F64.unpack(self.take(8, "a float"))[0])
            if not math.isfinite(real):
                raise WireFormatError("non-finite float in wire metadata")
            return real
        if tag == _STR:
            return self.string_body()
        if tag == _LIST:
            count = self.count("list")
            return [self.value(depth + 1) for _ in range(count)]
        if tag == _DICT:
            count = self.count("dict")
            out: dict[str, object] = {}
            previous: str | None = None
            for _ in range(count):
                self.node(depth + 1)
                if self.u8("a dict key tag") != _STR:
                    raise WireFormatError("a wire dict key is not a string")
                key = self.string_body()
                if previous is not None and key <= previous:
                    raise WireFormatError(f"wire dict keys are not strictly increasing at {key!r}")
                previous = key
                out[key] = self.value(depth + 1)
            return out
        if tag == _TENSOR:
            index = self.u64("a tensor reference")
            # references must number 0, 1, 2, ... in walk order: one canonical form, each descriptor used once
            if index != self.refs:
                raise WireFormatError(f"tensor reference {index} is out of order (expected {self.refs})")
            if self.refs + 1 > self.limits.max_tensors:
                raise PortableLimitError("max_tensors", "wire metadata references too many tensors")
            self.refs += 1
            return _TensorRef(index)
        raise WireFormatError(f"unknown wire tag 0x{tag:02x} at byte {self.pos - 1}")

    def descriptor(self, index: int) -> TensorSpec:
        code, rank, flags = _DESCRIPTOR_HEAD.unpack(self.take(_DESCRIPTOR_HEAD.size, "a tensor descriptor"))
        row = DTYPE_BY_CODE.get(code)
        if row is None:
            raise WireFormatError(f"tensor {index} has unknown dtype code {code}")
        if rank > self.limits.max_tensor_rank:
            raise PortableLimitError("max_tensor_rank", f"tensor {index} has rank {rank}")
        if flags != 0:
            raise WireFormatError(f"tensor {index} has non-zero descriptor flags")
        shape = []
        product = 1
        for _ in range(rank):
            dim = self.u64("a tensor dimension")
            if dim > _MAX_DIMENSION:
                raise WireFormatError(f"tensor {index} has a dimension above 2**63 - 1")
            shape.append(dim)
            product *= dim
            if product > _U64_MAX:
                raise WireFormatError(f"tensor {index} has more than 2**64 - 1 elements")
        numel = self.u64("a tensor numel")
        nbytes = self.u64("a tensor byte count")
        if numel != product:
            raise WireFormatError(f"tensor {index} numel {numel} does not match its shape {tuple(shape)}")
        if nbytes != numel * row.itemsize:
            raise WireFormatError(f"tensor {index} byte count {nbytes} does not match {numel} x {row.itemsize}")
        digest = self.take(32, "a tensor digest")
        return TensorSpec(code, tuple(shape), numel, nbytes, digest)


def parse_wire(metadata: bytes, *, limits: PortableStateLimits) -> WireLayout:
    """Validate wire metadata completely without allocating any tensor.

    Checks, in order: total size, preamble, header, the trailer digest, then the value
    grammar with every structural limit and canonical-form rule, the descriptors, the
    aggregate tensor bytes and the absence of trailing bytes. Raises
    :class:`WireFormatError`, :class:`PortableIntegrityError` or :class:`PortableLimitError`.
    """
    require_limits(limits)
    require_little_endian()
    if type(metadata) is not bytes:
        raise ContractTypeError(f"wire metadata must be bytes, got {type(metadata).__name__}")
    if len(metadata) > limits.max_metadata_bytes:
        raise PortableLimitError("max_metadata_bytes", f"wire metadata of {len(metadata)} bytes")
    # preamble, header, a 1-byte root (a bare tag such as None), the u64 descriptor count, the trailer
    minimum = len(WIRE_PREAMBLE) + _HEADER.size + 1 + 8 + _TRAILER
    if len(metadata) < minimum:
        raise WireFormatError(f"wire metadata of {len(metadata)} bytes is shorter than the minimum {minimum}")
    if metadata[: len(WIRE_PREAMBLE)] != WIRE_PREAMBLE:
        raise WireFormatError("wire metadata does not start with the gefen-portable preamble")
    version, flags, reserved = _HEADER.unpack_from(metadata, len(WIRE_PREAMBLE))
    if version != WIRE_CODEC_VERSION:
        raise WireFormatError(f"wire codec version {version} is not supported (this library reads 1)")
    if flags or reserved:
        raise WireFormatError("wire header flags and reserved fields must be zero")
    # digest before the grammar walk: a corrupted value or descriptor surfaces as an integrity error
    body = metadata[:-_TRAILER]
    expected = hashlib.sha256(_METADATA_DOMAIN + body).digest()
    if not hmac.compare_digest(expected, metadata[-_TRAILER:]):
        raise PortableIntegrityError("wire metadata digest mismatch: the metadata is corrupted or truncated")
    # end stops before the trailer, so no value can be read out of the digest bytes
    reader = _Reader(metadata, len(body), limits)
    reader.pos = len(WIRE_PREAMBLE) + _HEADER.size
    root = reader.value(0)
    count = reader.u64("the descriptor count")
    if count != reader.refs:
        raise WireFormatError(f"wire metadata has {count} descriptors for {reader.refs} tensor references")
    specs = []
    total = 0
    for index in range(count):
        spec = reader.descriptor(index)
        total += spec.nbytes
        if total > limits.max_fragment_tensor_bytes:
            raise PortableLimitError("max_fragment_tensor_bytes", "wire tensors announce too many bytes")
        specs.append(spec)
    if reader.pos != reader.end:
        raise WireFormatError(f"wire metadata has {reader.end - reader.pos} trailing bytes")
    return WireLayout(root, tuple(specs), metadata[-_TRAILER:].hex(), len(metadata))


def reconstruct_wire(
    layout: WireLayout,
    tensors: Sequence[torch.Tensor],
    *,
    copy: bool = True,
    expected_digest: str | None = None,
) -> object:
    """Build the value of a parsed ``layout`` from its payload ``tensors``.

    ``expected_digest`` (optional) must equal the metadata digest. Each payload must be a
    tight CPU tensor matching its descriptor exactly; with ``copy`` it is cloned into owned
    storage first. Its digest is recomputed and compared before any container is built, so
    the result is complete and verified, and (with ``copy``) never aliases the inputs.
    """
    if type(layout) is not WireLayout:
        raise ContractTypeError("reconstruct_wire needs a WireLayout from parse_wire")
    if expected_digest is not None and not hmac.compare_digest(expected_digest, layout.digest):
        raise PortableIntegrityError("wire metadata digest differs from the expected digest")
    if type(tensors) not in (list, tuple):
        raise ContractTypeError("wire payload tensors must be a list or tuple")
    if len(tensors) != len(layout.specs):
        raise PortableStateError(f"wire payload has {len(tensors)} tensors, the metadata describes {len(layout.specs)}")
    owned: list[torch.Tensor] = []
    for index, (tensor, spec) in enumerate(zip(tensors, layout.specs)):
        where = f"wire tensor {index}"
        if type(tensor) is not torch.Tensor:
            raise PortableStateError(f"{where} must be exactly torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype is not spec.dtype or tuple(tensor.shape) != spec.shape:
            raise PortableStateError(
                f"{where} is {tensor.dtype}{tuple(tensor.shape)}, the descriptor says {spec.dtype}{spec.shape}"
            )
        if not is_tight_cpu(tensor):
            raise PortableStateError(f"{where} must be a tight CPU tensor")
        value = owned_cpu_copy(tensor) if copy else tensor
        check_finite(value, where)
        # hash what is returned (the copy when copying), so the verified bytes are the delivered bytes
        if not hmac.compare_digest(tensor_sha256(value), spec.digest):
            raise PortableIntegrityError(f"{where} digest mismatch: the tensor bytes are corrupted")
        owned.append(value)
    return _build(layout.root, owned)


def _build(node: object, tensors: list[torch.Tensor]) -> object:
    if isinstance(node, _TensorRef):
        return tensors[node.index]
    if type(node) is list:
        return [_build(item, tensors) for item in node]
    if type(node) is dict:
        return {key: _build(item, tensors) for key, item in node.items()}
    return node


def decode_wire(
    metadata: bytes,
    tensors: Sequence[torch.Tensor],
    *,
    limits: PortableStateLimits,
    expected_digest: str | None = None,
) -> object:
    """:func:`parse_wire` then :func:`reconstruct_wire` (copying): an untrusted payload to a value."""
    return reconstruct_wire(parse_wire(metadata, limits=limits), tensors, expected_digest=expected_digest)


def bounded_clone(value: object, *, limits: PortableStateLimits) -> object:
    """A deep, owned, verified copy of ``value`` made through the wire codec.

    Every structural and byte limit is enforced during the walk, before the tensor it
    protects is copied, so an oversized untrusted value is refused without being copied.
    """
    # encode references tight inputs; reconstruct_wire's copy is what detaches the result from value
    payload = encode_wire(value, limits=limits)
    layout = parse_wire(payload.metadata, limits=limits)
    return reconstruct_wire(layout, payload.tensors, expected_digest=payload.digest)

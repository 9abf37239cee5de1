"""The dense-shard envelope, ``gefen.dense_shard_state`` version 1.

One envelope per checkpoint holds everything about an optimizer's dense-shard state that
is not a dense field: the implementation name, the codec's optimizer-common record and,
per parameter (keyed by FQN), its global shape, options, state variant, counters and the
names of the dense fields saved for it. It is identical on every rank (the ranks agree on
its digest before saving) and is stored as a 1-D ``uint8`` tensor of canonical JSON::

    {"format": "gefen.dense_shard_state", "format_version": 1,
     "implementation": str, "common": {...},
     "parameters": {fqn: {"global_shape": [int...], "options": {...}, "variant": str,
                          "counters": {name: int}, "fields": [name...]}},
     "digest": "<sha256 of the rest, gefen_contracts.canonical_digest>"}

Field names are identity names without dots (they become DCP key components).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gefen_contracts import FrozenMap, PortableStateLimits, canonical_digest
from gefen_contracts.validation import exact_int, identity_name

from .canonical_json import dump_canonical, load_canonical
from .errors import EnvelopeFormatError

__all__ = [
    "DENSE_SHARD_FORMAT",
    "DENSE_SHARD_FORMAT_VERSION",
    "DenseShardEnvelope",
    "ParameterEntry",
    "decode_envelope",
    "encode_envelope",
    "field_name",
]

DENSE_SHARD_FORMAT = "gefen.dense_shard_state"
DENSE_SHARD_FORMAT_VERSION = 1
_TOP_KEYS = frozenset({"format", "format_version", "implementation", "common", "parameters", "digest"})
_PARAMETER_KEYS = frozenset({"global_shape", "options", "variant", "counters", "fields"})


def _fail(message: str) -> EnvelopeFormatError:
    return EnvelopeFormatError(message)


def field_name(value: object, where: str) -> str:
    """A dense field name: an identity name without dots."""
    try:
        name = identity_name(value, where)
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if "." in name:
        raise _fail(f"{where} {name!r} must not contain '.' (it becomes a DCP key component)")
    return name


def _thaw(value: object) -> object:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True, slots=True, eq=False)
class ParameterEntry:
    """One parameter's non-dense record (what a ``DenseShardSlot`` says, minus the tensor)."""

    fqn: str
    global_shape: tuple[int, ...]
    options: Mapping[str, object] = field(default_factory=FrozenMap)
    variant: str = ""
    counters: Mapping[str, int] = field(default_factory=FrozenMap)
    fields: tuple[str, ...] = ()

    def record(self) -> dict[str, object]:
        return {
            "global_shape": list(self.global_shape),
            "options": _thaw(self.options),
            "variant": self.variant,
            "counters": dict(self.counters),
            "fields": list(self.fields),
        }


@dataclass(frozen=True, slots=True, eq=False)
class DenseShardEnvelope:
    """A decoded envelope: implementation, common record and parameters sorted by FQN."""

    implementation: str
    common: Mapping[str, object]
    parameters: tuple[ParameterEntry, ...]

    def body(self) -> dict[str, object]:
        """The primitive record the digest covers."""
        return {
            "format": DENSE_SHARD_FORMAT,
            "format_version": DENSE_SHARD_FORMAT_VERSION,
            "implementation": self.implementation,
            "common": _thaw(self.common),
            "parameters": {entry.fqn: entry.record() for entry in sorted(self.parameters, key=lambda e: e.fqn)},
        }

    def digest(self) -> str:
        return canonical_digest(self.body())

    def by_fqn(self) -> dict[str, ParameterEntry]:
        return {entry.fqn: entry for entry in self.parameters}


def encode_envelope(envelope: DenseShardEnvelope, *, limits: PortableStateLimits) -> bytes:
    """Canonical bytes of ``envelope`` with its digest."""
    body = envelope.body()
    return dump_canonical({**body, "digest": canonical_digest(body)}, limits=limits, what="dense-shard envelope")


def _parse_parameter(fqn: object, record: object, limits: PortableStateLimits) -> ParameterEntry:
    try:
        name = identity_name(fqn, "envelope parameter FQN")
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    where = f"envelope parameters[{name!r}]"
    if type(record) is not dict or set(record) != _PARAMETER_KEYS:
        raise _fail(f"{where} must be a dict with keys {sorted(_PARAMETER_KEYS)}")
    shape = record["global_shape"]
    if type(shape) is not list or len(shape) > limits.max_tensor_rank:
        raise _fail(f"{where}.global_shape must be a list of at most {limits.max_tensor_rank} ints")
    try:
        dims = tuple(
            exact_int(d, f"{where}.global_shape[{i}]", minimum=0, maximum=2**63 - 1) for i, d in enumerate(shape)
        )
        counters = (
            {
                identity_name(k, f"{where}.counters key"): exact_int(v, f"{where}.counters[{k!r}]", minimum=0)
                for k, v in record["counters"].items()
            }
            if type(record["counters"]) is dict
            else None
        )
        variant = identity_name(record["variant"], f"{where}.variant")
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if counters is None:
        raise _fail(f"{where}.counters must be a dict")
    if type(record["options"]) is not dict:
        raise _fail(f"{where}.options must be a dict")
    fields = record["fields"]
    if type(fields) is not list:
        raise _fail(f"{where}.fields must be a list")
    names = tuple(field_name(f, f"{where}.fields[{i}]") for i, f in enumerate(fields))
    if len(set(names)) != len(names) or list(names) != sorted(names):
        raise _fail(f"{where}.fields must be sorted and unique")
    return ParameterEntry(name, dims, FrozenMap(record["options"]), variant, FrozenMap(counters), names)


def decode_envelope(data: bytes, *, limits: PortableStateLimits) -> DenseShardEnvelope:
    """Parse and authenticate envelope bytes (format, version, exact keys, digest)."""
    value = load_canonical(data, limits=limits, what="dense-shard envelope")
    if type(value) is not dict or set(value) != _TOP_KEYS:
        raise _fail(f"the dense-shard envelope must be a dict with keys {sorted(_TOP_KEYS)}")
    if value["format"] != DENSE_SHARD_FORMAT:
        raise _fail(f"envelope format {value['format']!r} is not {DENSE_SHARD_FORMAT!r}")
    version = value["format_version"]
    if type(version) is not int or version != DENSE_SHARD_FORMAT_VERSION:
        raise _fail(
            f"envelope format_version {version!r} is unsupported (this library reads {DENSE_SHARD_FORMAT_VERSION})"
        )
    body = {k: v for k, v in value.items() if k != "digest"}
    if value["digest"] != canonical_digest(body):
        raise _fail("the dense-shard envelope's digest does not match its content (corrupted metadata)")
    try:
        implementation = identity_name(value["implementation"], "envelope implementation")
    except (TypeError, ValueError) as exc:
        raise _fail(str(exc)) from None
    if type(value["common"]) is not dict:
        raise _fail("envelope common must be a dict")
    parameters = value["parameters"]
    if type(parameters) is not dict:
        raise _fail("envelope parameters must be a dict keyed by FQN")
    entries = tuple(_parse_parameter(fqn, record, limits) for fqn, record in sorted(parameters.items()))
    return DenseShardEnvelope(implementation, FrozenMap(value["common"]), entries)

"""The records a portable document and a portable catalog share.

A :class:`StateHeader` holds what is global to the optimizer (implementation, policy,
common state, source manifest); a :class:`ParameterRecord` holds what is global to one
logical parameter except its fragments (identity, original slot position and native name,
options, variant, counters, the :class:`FieldSpec` of every fragment field, replica fields,
projection hints). The catalog adds the list of fragments that hold the fields; the
document adds their tensors. Parsing is strict: exact key sets, exact types, canonical identity records (through
:func:`gefen_contracts.codec.from_primitive`), and every error names the record and field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gefen_contracts import CodecError, ContractError
from gefen_contracts.codec import from_primitive, to_primitive
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ParameterIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.torch_support import block_count, dtype_from_name, dtype_name

from .errors import PortableStateError
from .tensors import DTYPE_CODES, require_tight
from .values import check_name, plain_common, plain_primitive

__all__ = [
    "DIGEST_ALGORITHM",
    "DIGEST_GRAMMAR",
    "ELEMENT_PROJECTION",
    "PORTABLE_STATE_COVERAGE",
    "FieldSpec",
    "REPLICA_PROJECTION",
    "ParameterRecord",
    "StateHeader",
    "check_digest_text",
    "check_keys",
    "check_parameter_set",
    "check_positions",
    "completion_record",
    "parse_completion",
    "parse_field_specs",
    "shared_keys",
]

PORTABLE_STATE_COVERAGE = "global_logical_optimizer"
DIGEST_ALGORITHM = "sha256"
#: the contracts' digest grammar (``gefen_contracts.digest.canonical_digest`` with tensor leaves)
DIGEST_GRAMMAR = "gefen.digest.v1"
#: fields are assembled from and projected onto pieces by shard identity; block fields are
#: expanded per element on projection
ELEMENT_PROJECTION = "shard_identity_v2"
#: replica fields are bit-identical on every payload piece and copied onto every target piece
REPLICA_PROJECTION = "complete_piece_copy_v1"

_COMMON_KEYS = (
    "identity",
    "position",
    "compatibility_name",
    "options",
    "variant",
    "counters",
    "fields",
    "replica_fields",
    "projection_hints",
)
_HINT_KEYS = {"source_layout", "element_fields", "replica_fields"}
_SPEC_KEYS = {"dtype", "blocked"}
_COMPLETION_KEYS = {"status", "digest_algorithm", "digest_grammar", "digest"}
_HEX = frozenset("0123456789abcdef")


def check_keys(value: object, expected: set[str], where: str) -> dict[str, object]:
    """Return ``value`` if it is a plain ``dict`` with exactly the ``expected`` keys."""
    if type(value) is not dict:
        raise PortableStateError(f"{where} must be a dict, got {type(value).__name__}")
    keys = set(value)
    if keys != expected:
        missing = sorted(expected - keys, key=str)
        extra = sorted(keys - expected, key=str)
        raise PortableStateError(f"{where} has wrong keys (missing {missing}, unexpected {extra})")
    return value


def check_digest_text(value: object, where: str) -> str:
    # lowercase only: digests are compared as text, so one digest must have exactly one spelling
    if type(value) is not str or len(value) != 64 or not set(value) <= _HEX:
        raise PortableStateError(f"{where} must be 64 lowercase hex characters")
    return value


def completion_record(digest: str) -> dict[str, object]:
    """The completion marker holding a SHA-256 digest under the contracts' grammar."""
    return {
        "status": "complete",
        "digest_algorithm": DIGEST_ALGORITHM,
        "digest_grammar": DIGEST_GRAMMAR,
        "digest": digest,
    }


def parse_completion(value: object, where: str) -> str:
    """Validate a completion marker and return its digest."""
    record = check_keys(value, _COMPLETION_KEYS, where)
    if record["status"] != "complete":
        raise PortableStateError(f"{where}.status must be 'complete'")
    if record["digest_algorithm"] != DIGEST_ALGORITHM or record["digest_grammar"] != DIGEST_GRAMMAR:
        raise PortableStateError(f"{where} must use {DIGEST_ALGORITHM} under {DIGEST_GRAMMAR}")
    return check_digest_text(record["digest"], f"{where}.digest")


def _decode(value: object, expected: type, where: str) -> object:
    try:
        return from_primitive(value, expected)
    except (CodecError, ContractError, TypeError) as exc:
        raise PortableStateError(f"{where}: {exc}") from None


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How one fragment field of a parameter is stored.

    An element field (``blocked=False``) holds one value per element, shaped like the
    fragment. A block field (``blocked=True``) is 1-D with one value per run of the
    fragment's ``block_period`` consecutive elements (row-major order; the last run may be
    shorter), and is expanded per element when projected onto a target piece.
    """

    dtype: torch.dtype
    blocked: bool = False

    def to_record(self) -> dict[str, object]:
        return {"dtype": dtype_name(self.dtype), "blocked": self.blocked}

    def shape(self, piece: tuple[int, ...], block_period: int) -> tuple[int, ...]:
        """The shape of this field's tensor in a fragment of ``piece`` shape."""
        if not self.blocked:
            return piece
        numel = 1
        for size in piece:
            numel *= size
        return (block_count(numel, block_period),)


def parse_field_specs(value: object, where: str) -> dict[str, FieldSpec]:
    """A ``{name: {"dtype": str, "blocked": bool}}`` record decoded strictly (sorted by name)."""
    if type(value) is not dict:
        raise PortableStateError(f"{where} must be a dict of field name -> field spec")
    specs: dict[str, FieldSpec] = {}
    for name, raw in sorted(value.items()):
        check_name(name, f"{where} key")
        spec = check_keys(raw, _SPEC_KEYS, f"{where}[{name!r}]")
        try:
            dtype = dtype_from_name(spec["dtype"])
        except CodecError as exc:
            raise PortableStateError(f"{where}[{name!r}].dtype: {exc}") from None
        if dtype not in DTYPE_CODES:
            raise PortableStateError(f"{where}[{name!r}].dtype {spec['dtype']!r} is not a wire dtype")
        if type(spec["blocked"]) is not bool:
            raise PortableStateError(f"{where}[{name!r}].blocked must be a bool")
        specs[name] = FieldSpec(dtype, spec["blocked"])
    return specs


@dataclass(frozen=True, slots=True, eq=False)
class StateHeader:
    """What one portable state holds once for the whole optimizer."""

    implementation: str
    policy: dict[str, object]
    common: dict[str, object]
    manifest: ShardingManifest

    def to_record(self) -> dict[str, object]:
        return {
            "implementation": self.implementation,
            "policy": plain_primitive(self.policy, "policy"),
            "common": dict(self.common),
            "manifest": to_primitive(self.manifest),
        }

    @classmethod
    def parse(cls, record: Mapping[str, object], where: str) -> StateHeader:
        implementation = check_name(record["implementation"], f"{where}.implementation")
        policy = record["policy"]
        if type(policy) is not dict:
            raise PortableStateError(f"{where}.policy must be a dict")
        plain_policy = plain_primitive(policy, f"{where}.policy")
        common = plain_common(record["common"], f"{where}.common")
        manifest = _decode(record["manifest"], ShardingManifest, f"{where}.manifest")
        assert isinstance(plain_policy, dict) and isinstance(manifest, ShardingManifest)
        return cls(implementation, plain_policy, common, manifest)


@dataclass(frozen=True, slots=True, eq=False)
class ParameterRecord:
    """One logical parameter's state, except its fragments.

    ``fields`` describes every fragment field (sorted by name); ``replica_fields`` are
    small fp32 tensors identical on every piece.
    """

    identity: ParameterIdentity
    position: tuple[int, int]
    compatibility_name: str
    options: dict[str, object]
    variant: str
    counters: dict[str, int]
    fields: dict[str, FieldSpec]
    replica_fields: dict[str, torch.Tensor]
    source_layout: ParameterLayout

    @property
    def fqn(self) -> str:
        return self.identity.fqn

    @property
    def blocked(self) -> bool:
        """Whether any field is a block field (then every fragment names its block period)."""
        return any(spec.blocked for spec in self.fields.values())

    def to_record(self) -> dict[str, object]:
        """The parameter's record (the catalog adds its fragments)."""
        return {
            "identity": to_primitive(self.identity),
            "position": list(self.position),
            "compatibility_name": self.compatibility_name,
            "options": plain_primitive(self.options, "options"),
            "variant": self.variant,
            "counters": dict(self.counters),
            "fields": {name: spec.to_record() for name, spec in self.fields.items()},
            "replica_fields": dict(self.replica_fields),
            "projection_hints": {
                "source_layout": self.source_layout.value,
                "element_fields": ELEMENT_PROJECTION,
                "replica_fields": REPLICA_PROJECTION,
            },
        }

    @classmethod
    def parse(
        cls,
        fqn: str,
        record: dict[str, object],
        manifest: ShardingManifest,
        where: str,
    ) -> ParameterRecord:
        """Validate the shared keys of one parameter record against the source ``manifest``."""
        identity = _decode(record["identity"], ParameterIdentity, f"{where}.identity")
        assert isinstance(identity, ParameterIdentity)
        if identity.fqn != fqn:
            raise PortableStateError(f"{where}.identity names {identity.fqn!r}, not its key {fqn!r}")
        shards = manifest.for_parameter(fqn)
        if not shards or shards[0].parameter != identity:
            raise PortableStateError(f"{where}.identity differs from the manifest's identity of {fqn!r}")
        position = record["position"]
        if type(position) is not list or len(position) != 2 or any(type(p) is not int or p < 0 for p in position):
            raise PortableStateError(f"{where}.position must be [group_index, slot_index] with ints >= 0")
        name = record["compatibility_name"]
        if type(name) is not str:
            raise PortableStateError(f"{where}.compatibility_name must be a str")
        options = record["options"]
        if type(options) is not dict:
            raise PortableStateError(f"{where}.options must be a dict")
        plain_options = plain_primitive(options, f"{where}.options")
        assert isinstance(plain_options, dict)
        variant = check_name(record["variant"], f"{where}.variant")
        counters = record["counters"]
        if type(counters) is not dict:
            raise PortableStateError(f"{where}.counters must be a dict")
        for key, value in counters.items():
            check_name(key, f"{where}.counters key")
            if type(value) is not int or value < 0:
                raise PortableStateError(f"{where}.counters[{key!r}] must be an int >= 0")
        replica = record["replica_fields"]
        if type(replica) is not dict:
            raise PortableStateError(f"{where}.replica_fields must be a dict")
        for key, value in replica.items():
            check_name(key, f"{where}.replica_fields key")
            # any shape is allowed (taken from the tensor); a non-tensor must still reach require_tight's named error
            tensor = value if type(value) is torch.Tensor else None
            shape = tuple(tensor.shape) if tensor is not None else ()
            require_tight(value, shape, torch.float32, f"{where}.replica_fields[{key!r}]")
        fields = parse_field_specs(record["fields"], f"{where}.fields")
        if set(replica) & set(fields):
            raise PortableStateError(f"{where} names a field both as fragment and replica field")
        hints = check_keys(record["projection_hints"], _HINT_KEYS, f"{where}.projection_hints")
        layout = shards[0].layout
        if hints["source_layout"] != layout.value:
            raise PortableStateError(f"{where}.projection_hints.source_layout must be {layout.value!r}")
        if hints["element_fields"] != ELEMENT_PROJECTION or hints["replica_fields"] != REPLICA_PROJECTION:
            raise PortableStateError(
                f"{where}.projection_hints name projection rules this library does not implement "
                f"(it implements {ELEMENT_PROJECTION!r} and {REPLICA_PROJECTION!r})"
            )
        return cls(
            identity,
            (position[0], position[1]),
            name,
            plain_options,
            variant,
            dict(counters),
            fields,
            dict(replica),
            layout,
        )


def shared_keys() -> set[str]:
    return set(_COMMON_KEYS)


def check_positions(records: Mapping[str, ParameterRecord], where: str) -> None:
    """Original slot positions must be unique across parameters (so a target can restore order)."""
    seen: dict[tuple[int, int], str] = {}
    for fqn, record in records.items():
        other = seen.get(record.position)
        if other is not None:
            raise PortableStateError(f"{where}: parameters {other!r} and {fqn!r} share slot position {record.position}")
        seen[record.position] = fqn


def check_parameter_set(records: Mapping[str, object], manifest: ShardingManifest, where: str) -> None:
    """The parameter keys must be exactly the manifest's FQNs."""
    keys = set(records)
    expected = set(manifest.fqns)
    if keys != expected:
        raise PortableStateError(
            f"{where} must hold exactly the manifest's parameters "
            f"(missing {sorted(expected - keys)}, unexpected {sorted(keys - expected)})"
        )

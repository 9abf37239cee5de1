"""The complete portable document, ``gefen.portable_state`` v1 (our own first version).

A plain ``dict`` of exactly nine keys, every container a built-in ``dict``/``list``, every
leaf ``None``/``bool``/``int``/finite ``float``/``str`` or a tight, finite CPU tensor, so it
survives ``torch.save`` + ``torch.load(weights_only=True)``::

    {
      "format": "gefen.portable_state", "format_version": 1,
      "coverage": "global_logical_optimizer",
      "implementation": str,                  # the adapter's stable implementation name
      "policy": {...},                        # primitive, from the adapter
      "common": {...},                        # primitives and small tensors, from the adapter
      "manifest": <sharding_manifest record>, # the source layout (gefen_contracts codec)
      "parameters": {fqn: {
          "identity": <parameter_identity record>,
          "position": [group_index, slot_index],   # the original optimizer slot
          "compatibility_name": str,               # the slot's native name
          "options": {...}, "variant": str, "counters": {name: int},
          "element_fields": {name: fp32 tensor of the global shape},
          "replica_fields": {name: small fp32 tensor},
          "projection_hints": {"source_layout": str, "element_fields": "shard_identity_v1",
                               "replica_fields": "complete_piece_copy_v1"}
      }},
      "completion": {"status": "complete", "digest_algorithm": "sha256",
                     "digest_grammar": "gefen.digest.v1", "digest": hex}
    }

The completion digest is :func:`gefen_contracts.torch_support.tensor_digest` of the document
without ``completion``. Differences from the reference's ``gefen.portable_state`` v3 (spec
section 2): the envelope is generic (no Gefen policy, common or variant rules: those belong
to the adapter), it carries the source manifest and each parameter's slot position and
native name, counters and replica fields are generic maps, projection hints name versioned
projection rules instead of quantizer periods, there is no ``provenance`` key, the
completion marker names its digest grammar, and the digest is the contracts' grammar (dtype
names such as ``float32`` rather than torch's ``torch.float32`` spelling).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gefen_contracts import PortableStateLimits
from gefen_contracts.torch_support import tensor_digest

from .errors import PortableIntegrityError, PortableStateError
from .records import (
    PORTABLE_STATE_COVERAGE,
    ParameterRecord,
    StateHeader,
    check_keys,
    check_parameter_set,
    check_positions,
    completion_record,
    parse_completion,
    shared_keys,
)
from .tensors import require_tight_fp32
from .values import check_name
from .wire import bounded_clone, require_limits

__all__ = [
    "PORTABLE_STATE_FORMAT",
    "PORTABLE_STATE_FORMAT_VERSION",
    "ParsedDocument",
    "build_document",
    "parse_document",
    "portable_state_digest",
]

PORTABLE_STATE_FORMAT = "gefen.portable_state"
PORTABLE_STATE_FORMAT_VERSION = 1
_TOP_KEYS = {
    "format",
    "format_version",
    "coverage",
    "implementation",
    "policy",
    "common",
    "manifest",
    "parameters",
    "completion",
}

Fields = Mapping[str, Mapping[str, torch.Tensor]]


def portable_state_digest(payload: object) -> str:
    """The digest of a document payload (the contracts' grammar with tensor leaves)."""
    return tensor_digest(payload)


@dataclass(frozen=True, slots=True, eq=False)
class ParsedDocument:
    """A validated document: header, parameter records, dense global fields and its digest."""

    header: StateHeader
    parameters: Mapping[str, ParameterRecord]
    fields: Fields
    digest: str


def _payload(header: StateHeader, parameters: Mapping[str, ParameterRecord], fields: Fields) -> dict[str, object]:
    records: dict[str, object] = {}
    for fqn in sorted(parameters):
        record = parameters[fqn]
        entry = record.to_record()
        entry["element_fields"] = {name: fields[fqn][name] for name in record.element_fields}
        records[fqn] = entry
    return {
        "format": PORTABLE_STATE_FORMAT,
        "format_version": PORTABLE_STATE_FORMAT_VERSION,
        "coverage": PORTABLE_STATE_COVERAGE,
        **header.to_record(),
        "parameters": records,
    }


def _check_fields(parameters: Mapping[str, ParameterRecord], fields: Fields, where: str) -> None:
    for fqn, record in parameters.items():
        present = fields.get(fqn, {})
        if set(present) != set(record.element_fields):
            raise PortableStateError(
                f"{where}: element fields of {fqn!r} must be exactly {list(record.element_fields)}"
            )
        for name in record.element_fields:
            require_tight_fp32(
                present[name], record.identity.global_shape, f"{where}[{fqn!r}].element_fields[{name!r}]"
            )


def build_document(header: StateHeader, parameters: Mapping[str, ParameterRecord], fields: Fields) -> dict[str, object]:
    """Assemble a complete document and its completion digest (the tensors are referenced)."""
    check_parameter_set(parameters, header.manifest, "document.parameters")
    check_positions(parameters, "document")
    _check_fields(parameters, fields, "document.parameters")
    payload = _payload(header, parameters, fields)
    payload["completion"] = completion_record(portable_state_digest(payload))
    return payload


def parse_document(document: object, *, limits: PortableStateLimits) -> ParsedDocument:
    """Validate an untrusted document completely and verify its completion digest.

    The document is first copied through the wire codec under the collective limits, so an
    oversized document is refused before its tensors are copied, and the result never
    aliases the input. Raises :class:`PortableStateError` (or a subclass) naming the field.
    """
    require_limits(limits)
    clone = bounded_clone(document, limits=limits.collective())
    top = check_keys(clone, _TOP_KEYS, "document")
    if top["format"] != PORTABLE_STATE_FORMAT or top["coverage"] != PORTABLE_STATE_COVERAGE:
        raise PortableStateError(
            f"document format must be {PORTABLE_STATE_FORMAT!r} with coverage {PORTABLE_STATE_COVERAGE!r}"
        )
    if type(top["format_version"]) is not int or top["format_version"] != PORTABLE_STATE_FORMAT_VERSION:
        raise PortableStateError(f"document format_version must be {PORTABLE_STATE_FORMAT_VERSION}")
    header = StateHeader.parse(top, "document")
    raw_parameters = top["parameters"]
    if type(raw_parameters) is not dict:
        raise PortableStateError("document.parameters must be a dict")
    parameters: dict[str, ParameterRecord] = {}
    fields: dict[str, dict[str, torch.Tensor]] = {}
    keys = shared_keys() | {"element_fields"}
    for fqn, raw in raw_parameters.items():
        where = f"document.parameters[{fqn!r}]"
        entry = check_keys(raw, keys, where)
        element = entry["element_fields"]
        if type(element) is not dict:
            raise PortableStateError(f"{where}.element_fields must be a dict")
        for name in element:
            check_name(name, f"{where}.element_fields key")
        names = tuple(sorted(element))
        parameters[fqn] = ParameterRecord.parse(fqn, entry, names, header.manifest, where)
        fields[fqn] = dict(element)
    check_parameter_set(parameters, header.manifest, "document.parameters")
    check_positions(parameters, "document")
    _check_fields(parameters, fields, "document.parameters")
    claimed = parse_completion(top["completion"], "document.completion")
    if not hmac.compare_digest(portable_state_digest(_payload(header, parameters, fields)), claimed):
        raise PortableIntegrityError("document completion digest mismatch: the document was changed or corrupted")
    return ParsedDocument(header, parameters, fields, claimed)

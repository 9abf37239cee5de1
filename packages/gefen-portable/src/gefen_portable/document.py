"""The complete portable document, ``gefen.portable_state`` v2.

A document is the catalog (:mod:`gefen_portable.catalog`) with every fragment's tensors
inline: a plain ``dict`` whose containers are built-in ``dict``/``list`` and whose leaves are
``None``/``bool``/``int``/finite ``float``/``str`` or tight, finite CPU tensors, so it
survives ``torch.save`` + ``torch.load(weights_only=True)``::

    {
      "format": "gefen.portable_state", "format_version": 2,
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
          "fields": {name: {"dtype": str, "blocked": bool}},
          "replica_fields": {name: small fp32 tensor},
          "projection_hints": {"source_layout": str, "element_fields": "shard_identity_v2",
                               "replica_fields": "complete_piece_copy_v1"},
          "fragments": [{"extent": <logical_slice | logical_region>, "block_period": int,
                         "digest": hex, "nbytes": int, "fields": {name: tensor}}, ...]
      }},
      "completion": {"status": "complete", "digest_algorithm": "sha256",
                     "digest_grammar": "gefen.digest.v1", "digest": hex}
    }

The fragments are the source's pieces as exported (deduplicated, tiling each parameter),
so a quantised optimizer's document is as compact as its state: Gefen's holds uint8 codes
and per-block scales, about one byte per element, where v1 held dense fp32 fields of the
global shape. The completion digest is the catalog's (it covers every fragment digest,
and each fragment digest covers its tensors); every one is verified on parse. Version 1
is refused naming both versions. Differences from the reference's ``gefen.portable_state``
v3 (spec section 2): the envelope is generic (no Gefen policy, common or variant rules:
those belong to the adapter), it carries the source manifest and each parameter's slot
position and native name, counters and replica fields are generic maps, projection hints
name versioned projection rules instead of quantizer periods, there is no ``provenance``
key, the completion marker names its digest grammar, and the digest is the contracts'
grammar (dtype names such as ``float32`` rather than torch's ``torch.float32`` spelling).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import tensor_digest

from .catalog import CATALOG_FORMAT, CATALOG_FORMAT_VERSION, Catalog, parse_catalog_record
from .errors import PortableStateError
from .fragments import PortableFragment, record_digest, verify_fragment
from .values import check_name
from .wire import bounded_clone, require_limits

__all__ = [
    "PORTABLE_STATE_FORMAT",
    "PORTABLE_STATE_FORMAT_VERSION",
    "build_document",
    "parse_document",
    "portable_state_digest",
    "reseal_document",
]

PORTABLE_STATE_FORMAT = "gefen.portable_state"
PORTABLE_STATE_FORMAT_VERSION = 2


def build_document(catalog: Catalog, fragments: Mapping[tuple[str, int], PortableFragment]) -> dict[str, object]:
    """The complete document of ``catalog`` holding ``fragments`` (all of them; tensors referenced)."""
    record = catalog.to_record()
    record["format"] = PORTABLE_STATE_FORMAT
    record["format_version"] = PORTABLE_STATE_FORMAT_VERSION
    parameters = record["parameters"]
    assert isinstance(parameters, dict)
    for fqn, entry in parameters.items():
        for index, fragment_record in enumerate(entry["fragments"]):
            fragment = fragments.get((fqn, index))
            if fragment is None:
                raise PortableStateError(f"fragment {index} of {fqn!r} is missing from the document")
            fragment_record["fields"] = dict(fragment.fields)
    return record


def parse_document(document: object, *, limits: PortableStateLimits) -> tuple[Catalog, tuple[PortableFragment, ...]]:
    """Validate an untrusted document completely: structure, completion digest and every fragment digest.

    The document is first copied through the wire codec under the collective limits, so an
    oversized document is refused before its tensors are copied, and the result never
    aliases the input. Raises :class:`PortableStateError` (or a subclass) naming the field.
    """
    require_limits(limits)
    clone = bounded_clone(document, limits=limits.collective())
    top = clone if type(clone) is dict else {}
    # ahead of the structural checks, so another version is refused by its version (with the remedy)
    if top.get("format") == PORTABLE_STATE_FORMAT and top.get("format_version") != PORTABLE_STATE_FORMAT_VERSION:
        raise PortableStateError(
            f"document format_version is {top.get('format_version')!r}; this library reads version "
            f"{PORTABLE_STATE_FORMAT_VERSION} only (version 1 held dense fp32 fields; export it again)"
        )
    catalog, inline = parse_catalog_record(
        clone, PORTABLE_STATE_FORMAT, PORTABLE_STATE_FORMAT_VERSION, "document", inline=True, limits=limits
    )
    fragments = []
    for (fqn, index), raw in inline.items():
        where = f"document.parameters[{fqn!r}].fragments[{index}].fields"
        if type(raw) is not dict:
            raise PortableStateError(f"{where} must be a dict of field name -> tensor")
        for name in raw:
            check_name(name, f"{where} key")
        fragment = PortableFragment.from_catalog(catalog, fqn, index, raw)
        verify_fragment(fragment, catalog)
        fragments.append(fragment)
    return catalog, tuple(fragments)


def portable_state_digest(document: Mapping[str, Any]) -> str:
    """The root digest a plain document's ``completion`` must hold (its ``completion`` and
    fragment tensors ignored: the fragment digests stand for them)."""
    payload = {key: value for key, value in document.items() if key != "completion"}
    # the completion digest is the catalog's: hash the document as its catalog, without inline fields
    payload["format"], payload["format_version"] = CATALOG_FORMAT, CATALOG_FORMAT_VERSION
    parameters = {}
    for fqn, entry in dict(document["parameters"]).items():
        fragments = [{k: v for k, v in frag.items() if k != "fields"} for frag in entry["fragments"]]
        parameters[fqn] = {**entry, "fragments": fragments}
    payload["parameters"] = parameters
    return tensor_digest(payload)


def reseal_document(document: dict[str, Any]) -> None:
    """Recompute every fragment digest and the completion digest of a plain document in place.

    For tests and conformance checks that edit a document and want it refused by validation
    rather than by a digest.
    """
    for fqn, entry in document["parameters"].items():
        for frag in entry["fragments"]:
            frag["digest"] = record_digest(fqn, frag["extent"], frag["block_period"], frag["fields"])
    # last: the completion digest covers the fragment digests recomputed above
    document["completion"]["digest"] = portable_state_digest(document)

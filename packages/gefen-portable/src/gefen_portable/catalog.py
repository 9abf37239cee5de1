"""The portable catalog, ``gefen.portable_state_catalog`` v1: the global state minus dense data.

Every member of an export agrees on one catalog (its digest is voted on). It holds the
header (implementation, policy, common state, source manifest) and, per parameter, the
shared record plus the list of *fragments* that together hold its dense element fields::

    {
      "format": "gefen.portable_state_catalog", "format_version": 1,
      "coverage": "global_logical_optimizer",
      "implementation": str, "policy": {...}, "common": {...}, "manifest": <sharding_manifest>,
      "parameters": {fqn: {
          <shared record keys, see records.py>,
          "element_fields": [sorted field names],
          "fragments": [{"extent": <logical_slice | logical_region>, "digest": hex, "nbytes": int}, ...]
      }},
      "completion": {"status": "complete", "digest_algorithm": "sha256",
                     "digest_grammar": "gefen.digest.v1", "digest": hex}
    }

A fragment is one distinct piece of a parameter (deduplicated across replicas, in flat
order, tiling the parameter exactly once); its ``digest`` covers its tensors (see
:mod:`gefen_portable.fragments`), and the completion digest covers the catalog, hence every
fragment digest. A parameter without element fields has no fragments.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gefen_contracts import LogicalRegion, LogicalSlice, PortableStateLimits, from_primitive, to_primitive
from gefen_contracts.torch_support import tensor_digest

from .errors import PortableIntegrityError, PortableStateError
from .extents import Extent, fragment_shape, validate_tiling
from .records import (
    PORTABLE_STATE_COVERAGE,
    ParameterRecord,
    StateHeader,
    check_digest_text,
    check_keys,
    check_parameter_set,
    check_positions,
    completion_record,
    parse_completion,
    shared_keys,
)
from .values import check_name
from .wire import bounded_clone, require_limits

__all__ = ["CATALOG_FORMAT", "CATALOG_FORMAT_VERSION", "Catalog", "FragmentRecord", "parse_catalog", "parse_extent"]

CATALOG_FORMAT = "gefen.portable_state_catalog"
CATALOG_FORMAT_VERSION = 1
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
_FRAGMENT_KEYS = {"extent", "digest", "nbytes"}
_FP32_BYTES = 4


@dataclass(frozen=True, slots=True)
class FragmentRecord:
    """One fragment of a parameter: its extent, digest and tensor byte count."""

    extent: Extent
    digest: str
    nbytes: int

    def to_record(self) -> dict[str, object]:
        return {"extent": to_primitive(self.extent), "digest": self.digest, "nbytes": self.nbytes}


def _extent_numel(extent: Extent) -> int:
    if type(extent) is LogicalSlice:
        return extent.length
    assert type(extent) is LogicalRegion
    return math.prod(extent.lengths)


@dataclass(frozen=True, slots=True, eq=False)
class Catalog:
    """A validated catalog; build one with :meth:`build` or :func:`parse_catalog`."""

    header: StateHeader
    parameters: Mapping[str, ParameterRecord]
    fragments: Mapping[str, tuple[FragmentRecord, ...]]
    digest: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", MappingProxyType(dict(self.parameters)))
        object.__setattr__(self, "fragments", MappingProxyType(dict(self.fragments)))

    @classmethod
    def build(
        cls,
        header: StateHeader,
        parameters: Mapping[str, ParameterRecord],
        fragments: Mapping[str, tuple[FragmentRecord, ...]],
    ) -> Catalog:
        """Validate the parts and compute the completion digest."""
        ordered = {fqn: parameters[fqn] for fqn in sorted(parameters)}
        frags = {fqn: tuple(fragments.get(fqn, ())) for fqn in ordered}
        _validate(header, ordered, frags, "catalog")
        catalog = cls(header, ordered, frags, "0" * 64)
        digest = tensor_digest(catalog._payload())
        return cls(header, ordered, frags, digest)

    @property
    def implementation(self) -> str:
        return self.header.implementation

    def _payload(self) -> dict[str, object]:
        parameters: dict[str, object] = {}
        for fqn, record in self.parameters.items():
            entry = record.to_record()
            entry["element_fields"] = list(record.element_fields)
            entry["fragments"] = [f.to_record() for f in self.fragments[fqn]]
            parameters[fqn] = entry
        return {
            "format": CATALOG_FORMAT,
            "format_version": CATALOG_FORMAT_VERSION,
            "coverage": PORTABLE_STATE_COVERAGE,
            **self.header.to_record(),
            "parameters": parameters,
        }

    def to_record(self) -> dict[str, object]:
        """The catalog as a plain record (primitives and small CPU tensors, weights-only safe)."""
        record = self._payload()
        record["completion"] = completion_record(self.digest)
        return record

    def fragment_keys(self) -> tuple[tuple[str, int], ...]:
        """Every fragment as ``(fqn, index)``, in catalog order (sorted FQN, then flat order)."""
        return tuple((fqn, index) for fqn, frags in self.fragments.items() for index in range(len(frags)))

    def fragment_shape(self, fqn: str, index: int) -> tuple[int, ...]:
        return fragment_shape(self.fragments[fqn][index].extent, self.parameters[fqn].identity)

    @property
    def total_fragment_bytes(self) -> int:
        return sum(f.nbytes for frags in self.fragments.values() for f in frags)


def _validate(
    header: StateHeader,
    parameters: Mapping[str, ParameterRecord],
    fragments: Mapping[str, tuple[FragmentRecord, ...]],
    where: str,
) -> None:
    check_parameter_set(parameters, header.manifest, f"{where}.parameters")
    check_positions(parameters, where)
    for fqn, record in parameters.items():
        frags = fragments[fqn]
        if not record.element_fields:
            if frags:
                raise PortableStateError(f"{where}: parameter {fqn!r} has no element fields but lists fragments")
            continue
        validate_tiling([f.extent for f in frags], record.identity)
        for index, frag in enumerate(frags):
            expected = _extent_numel(frag.extent) * _FP32_BYTES * len(record.element_fields)
            if frag.nbytes != expected:
                raise PortableStateError(
                    f"{where}: fragment {index} of {fqn!r} announces {frag.nbytes} bytes, its extent holds {expected}"
                )


def parse_extent(value: object, where: str) -> Extent:
    """A ``logical_slice`` or ``logical_region`` record, decoded strictly."""
    if type(value) is not dict:
        raise PortableStateError(f"{where} must be a logical_slice or logical_region record")
    expected = LogicalSlice if value.get("record") == "logical_slice" else LogicalRegion
    try:
        extent = from_primitive(value, expected)
    except (ValueError, TypeError) as exc:
        raise PortableStateError(f"{where}: {exc}") from None
    assert type(extent) in (LogicalSlice, LogicalRegion)
    return extent  # type: ignore[return-value]


def parse_catalog(record: object, *, limits: PortableStateLimits) -> Catalog:
    """Validate an untrusted catalog record and verify its completion digest.

    The record is first copied through the wire codec under the collective limits (so an
    oversized record is refused before it is copied); the result never aliases ``record``.
    """
    require_limits(limits)
    clone = bounded_clone(record, limits=limits.collective())
    top = check_keys(clone, _TOP_KEYS, "catalog")
    if top["format"] != CATALOG_FORMAT or top["coverage"] != PORTABLE_STATE_COVERAGE:
        raise PortableStateError(f"catalog format must be {CATALOG_FORMAT!r} with coverage {PORTABLE_STATE_COVERAGE!r}")
    if type(top["format_version"]) is not int or top["format_version"] != CATALOG_FORMAT_VERSION:
        raise PortableStateError(f"catalog format_version must be {CATALOG_FORMAT_VERSION}")
    header = StateHeader.parse(top, "catalog")
    raw_parameters = top["parameters"]
    if type(raw_parameters) is not dict:
        raise PortableStateError("catalog.parameters must be a dict")
    parameters: dict[str, ParameterRecord] = {}
    fragments: dict[str, tuple[FragmentRecord, ...]] = {}
    keys = shared_keys() | {"element_fields", "fragments"}
    for fqn, raw in raw_parameters.items():
        where = f"catalog.parameters[{fqn!r}]"
        entry = check_keys(raw, keys, where)
        names = entry["element_fields"]
        if type(names) is not list:
            raise PortableStateError(f"{where}.element_fields must be a list of names")
        for name in names:
            check_name(name, f"{where}.element_fields item")
        if names != sorted(set(names)):
            raise PortableStateError(f"{where}.element_fields must be sorted and unique")
        parameters[fqn] = ParameterRecord.parse(fqn, entry, tuple(names), header.manifest, where)
        raw_frags = entry["fragments"]
        if type(raw_frags) is not list:
            raise PortableStateError(f"{where}.fragments must be a list")
        parsed = []
        for index, raw_frag in enumerate(raw_frags):
            frag = check_keys(raw_frag, _FRAGMENT_KEYS, f"{where}.fragments[{index}]")
            extent = parse_extent(frag["extent"], f"{where}.fragments[{index}].extent")
            digest = check_digest_text(frag["digest"], f"{where}.fragments[{index}].digest")
            nbytes = frag["nbytes"]
            if type(nbytes) is not int or nbytes < 0:
                raise PortableStateError(f"{where}.fragments[{index}].nbytes must be an int >= 0")
            parsed.append(FragmentRecord(extent, digest, nbytes))
        fragments[fqn] = tuple(parsed)
    _validate(header, parameters, fragments, "catalog")
    claimed = parse_completion(top["completion"], "catalog.completion")
    catalog = Catalog(header, parameters, fragments, claimed)
    if not hmac.compare_digest(tensor_digest(catalog._payload()), claimed):
        raise PortableIntegrityError("catalog completion digest mismatch: the catalog was changed or corrupted")
    return catalog

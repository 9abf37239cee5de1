"""The portable catalog, ``gefen.portable_state_catalog`` v2: the global state minus tensor data.

Every member of an export agrees on one catalog (its digest is voted on). It holds the
header (implementation, policy, common state, source manifest) and, per parameter, the
shared record plus the list of *fragments* that together hold its fields::

    {
      "format": "gefen.portable_state_catalog", "format_version": 2,
      "coverage": "global_logical_optimizer",
      "implementation": str, "policy": {...}, "common": {...}, "manifest": <sharding_manifest>,
      "parameters": {fqn: {
          <record keys, see records.py; "fields": {name: {"dtype": str, "blocked": bool}}>,
          "fragments": [{"extent": <logical_slice | logical_region>, "block_period": int,
                         "digest": hex, "nbytes": int}, ...]
      }},
      "completion": {"status": "complete", "digest_algorithm": "sha256",
                     "digest_grammar": "gefen.digest.v1", "digest": hex}
    }

A fragment is one distinct piece of a parameter (deduplicated across replicas, in flat
order, tiling the parameter exactly once); its ``block_period`` is the run length of its
block fields (0 when the parameter has none; fragments may differ), its ``digest`` covers
its tensors (see :mod:`gefen_portable.fragments`), and the completion digest covers the
catalog, hence every fragment digest. A parameter without fields has no fragments.
v1 (dense fp32 element fields only) is refused.

The complete document (:mod:`gefen_portable.document`) is this record with each
fragment's tensors inline.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from gefen_contracts.codec import from_primitive, to_primitive
from gefen_contracts.identity import LogicalRegion, LogicalSlice
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import tensor_digest

from .errors import PortableIntegrityError, PortableLimitError, PortableStateError
from .extents import Extent, fragment_shape, validate_tiling
from .records import (
    PORTABLE_STATE_COVERAGE,
    FieldSpec,
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
from .tensors import DTYPE_CODES
from .wire import bounded_clone, require_limits

__all__ = [
    "CATALOG_FORMAT",
    "CATALOG_FORMAT_VERSION",
    "Catalog",
    "FragmentRecord",
    "fragment_tensors",
    "parse_catalog",
    "parse_catalog_record",
    "parse_extent",
    "tensors_nbytes",
]

CATALOG_FORMAT = "gefen.portable_state_catalog"
CATALOG_FORMAT_VERSION = 2
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
_FRAGMENT_KEYS = {"extent", "block_period", "digest", "nbytes"}


@dataclass(frozen=True, slots=True)
class FragmentRecord:
    """One fragment of a parameter: its extent, block period, digest and tensor byte count."""

    extent: Extent
    block_period: int
    digest: str
    nbytes: int

    def to_record(self) -> dict[str, object]:
        return {
            "extent": to_primitive(self.extent),
            "block_period": self.block_period,
            "digest": self.digest,
            "nbytes": self.nbytes,
        }


def fragment_tensors(
    fields: Mapping[str, FieldSpec], piece: tuple[int, ...], block_period: int
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of every tensor of a fragment of ``piece`` shape."""
    return {name: (spec.shape(piece, block_period), spec.dtype) for name, spec in fields.items()}


def tensors_nbytes(tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(shape) * DTYPE_CODES[dtype].itemsize for shape, dtype in tensors.values())


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
        # sorted FQNs: a parsed catalog has this order too (the wire clone sorts dict keys), so fragment_keys() agrees
        ordered = {fqn: parameters[fqn] for fqn in sorted(parameters)}
        frags = {fqn: tuple(fragments.get(fqn, ())) for fqn in ordered}
        _validate(header, ordered, frags, "catalog", None)
        # placeholder digest: _payload() never reads it, this instance only serves to compute the real one
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
        """The shape of the fragment's piece (what its element fields look like)."""
        return fragment_shape(self.fragments[fqn][index].extent, self.parameters[fqn].identity)

    def fragment_tensors(self, fqn: str, index: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{name: (shape, dtype)}`` of every tensor fragment ``index`` of ``fqn`` holds."""
        period = self.fragments[fqn][index].block_period
        return fragment_tensors(self.parameters[fqn].fields, self.fragment_shape(fqn, index), period)

    @property
    def total_fragment_bytes(self) -> int:
        return sum(f.nbytes for frags in self.fragments.values() for f in frags)


def _validate(
    header: StateHeader,
    parameters: Mapping[str, ParameterRecord],
    fragments: Mapping[str, tuple[FragmentRecord, ...]],
    where: str,
    limits: PortableStateLimits | None,
) -> None:
    """Check a catalog's parts; ``limits`` bounds an untrusted catalog's announced bytes (an
    export checks its own bytes against the session's limits)."""
    check_parameter_set(parameters, header.manifest, f"{where}.parameters")
    check_positions(parameters, where)
    total = 0
    for fqn, record in parameters.items():
        frags = fragments[fqn]
        if not record.fields:
            if frags:
                raise PortableStateError(f"{where}: parameter {fqn!r} has no fields but lists fragments")
            continue
        for index, frag in enumerate(frags):
            if record.blocked != (frag.block_period > 0):
                raise PortableStateError(
                    f"{where}: fragment {index} of {fqn!r} must name a block period >= 1 exactly when the "
                    "parameter has block fields"
                )
            piece = fragment_shape(frag.extent, record.identity)
            expected = tensors_nbytes(fragment_tensors(record.fields, piece, frag.block_period))
            # nbytes feeds limit checks and holder balancing before any tensor is seen, so it must be exact
            if frag.nbytes != expected:
                raise PortableStateError(
                    f"{where}: fragment {index} of {fqn!r} announces {frag.nbytes} bytes, its extent holds {expected}"
                )
            if limits is None:
                continue
            if frag.nbytes > limits.max_fragment_tensor_bytes:
                raise PortableLimitError(
                    "max_fragment_tensor_bytes", f"{where}: fragment {index} of {fqn!r} holds {frag.nbytes} bytes"
                )
            total += frag.nbytes
            if total > limits.max_collective_tensor_bytes:
                raise PortableLimitError(
                    "max_collective_tensor_bytes", f"{where}: the fragments hold more than {total - frag.nbytes} bytes"
                )
    # after the byte bounds: a tiling check walks each region's runs, as many as its data's rows
    for fqn, record in parameters.items():
        if record.fields:
            validate_tiling([f.extent for f in fragments[fqn]], record.identity)


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
    catalog, _ = parse_catalog_record(
        clone, CATALOG_FORMAT, CATALOG_FORMAT_VERSION, "catalog", inline=False, limits=limits
    )
    return catalog


def parse_catalog_record(
    clone: object, format_name: str, version: int, where: str, *, inline: bool, limits: PortableStateLimits
) -> tuple[Catalog, dict[tuple[str, int], object]]:
    """Parse a catalog-shaped record already copied under the limits (see :func:`parse_catalog`);
    the fragments' announced bytes must keep within ``limits``' tensor bounds.

    With ``inline`` (a complete document) every fragment entry also holds ``"fields"``,
    returned unvalidated by ``(fqn, index)``; the caller checks them against the catalog.
    """
    top = check_keys(clone, _TOP_KEYS, where)
    if top["format"] != format_name or top["coverage"] != PORTABLE_STATE_COVERAGE:
        raise PortableStateError(f"{where} format must be {format_name!r} with coverage {PORTABLE_STATE_COVERAGE!r}")
    if type(top["format_version"]) is not int or top["format_version"] != version:
        raise PortableStateError(
            f"{where} format_version is {top['format_version']!r}; this library reads version {version} only"
        )
    header = StateHeader.parse(top, where)
    raw_parameters = top["parameters"]
    if type(raw_parameters) is not dict:
        raise PortableStateError(f"{where}.parameters must be a dict")
    parameters: dict[str, ParameterRecord] = {}
    fragments: dict[str, tuple[FragmentRecord, ...]] = {}
    inline_fields: dict[tuple[str, int], object] = {}
    keys = shared_keys() | {"fragments"}
    fragment_keys = _FRAGMENT_KEYS | {"fields"} if inline else _FRAGMENT_KEYS
    for fqn, raw in raw_parameters.items():
        here = f"{where}.parameters[{fqn!r}]"
        entry = check_keys(raw, keys, here)
        parameters[fqn] = ParameterRecord.parse(fqn, entry, header.manifest, here)
        raw_frags = entry["fragments"]
        if type(raw_frags) is not list:
            raise PortableStateError(f"{here}.fragments must be a list")
        parsed = []
        for index, raw_frag in enumerate(raw_frags):
            frag = check_keys(raw_frag, fragment_keys, f"{here}.fragments[{index}]")
            extent = parse_extent(frag["extent"], f"{here}.fragments[{index}].extent")
            digest = check_digest_text(frag["digest"], f"{here}.fragments[{index}].digest")
            period, nbytes = frag["block_period"], frag["nbytes"]
            if type(period) is not int or period < 0:
                raise PortableStateError(f"{here}.fragments[{index}].block_period must be an int >= 0")
            if type(nbytes) is not int or nbytes < 0:
                raise PortableStateError(f"{here}.fragments[{index}].nbytes must be an int >= 0")
            parsed.append(FragmentRecord(extent, period, digest, nbytes))
            if inline:
                inline_fields[(fqn, index)] = frag["fields"]
        fragments[fqn] = tuple(parsed)
    _validate(header, parameters, fragments, where, limits)
    claimed = parse_completion(top["completion"], f"{where}.completion")
    catalog = Catalog(header, parameters, fragments, claimed)
    if not hmac.compare_digest(tensor_digest(catalog._payload()), claimed):
        raise PortableIntegrityError(f"{where} completion digest mismatch: it was changed or corrupted")
    return catalog, inline_fields

"""Fragments: the unit in which a parameter's fields are held, moved and persisted.

A fragment is one distinct piece of one parameter (a flat slice, a DTensor region, or the
whole parameter) with every field of that piece as a tight CPU tensor: element fields
shaped like the piece, block fields with one value per run of ``block_period`` elements
(see :class:`~gefen_portable.records.FieldSpec`). Its digest is the contracts' digest
(:func:`gefen_contracts.torch_support.tensor_digest`) of::

    {"format": "gefen.portable_state_fragment", "format_version": 2,
     "fqn": str, "extent": <logical_slice | logical_region record>, "block_period": int,
     "fields": {name: tensor}}

so a fragment cannot be substituted for another parameter's or another extent's; the
catalog lists every fragment digest, and the catalog's own digest covers them all.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gefen_contracts.codec import to_primitive
from gefen_contracts.frozen import FrozenMap
from gefen_contracts.torch_support import tensor_digest

from .catalog import Catalog
from .errors import PortableIntegrityError, PortableStateError
from .extents import Extent
from .tensors import require_tight

__all__ = [
    "FRAGMENT_FORMAT",
    "FRAGMENT_FORMAT_VERSION",
    "PortableFragment",
    "fragment_digest",
    "record_digest",
    "verify_fragment",
]

FRAGMENT_FORMAT = "gefen.portable_state_fragment"
FRAGMENT_FORMAT_VERSION = 2


def fragment_digest(fqn: str, extent: Extent, block_period: int, fields: Mapping[str, torch.Tensor]) -> str:
    """The digest of a fragment's content (see the module docstring)."""
    return record_digest(fqn, to_primitive(extent), block_period, fields)


def record_digest(fqn: str, extent: object, block_period: object, fields: Mapping[str, object]) -> str:
    """:func:`fragment_digest` of a fragment given as plain record values (extent as its record)."""
    return tensor_digest(
        {
            "format": FRAGMENT_FORMAT,
            "format_version": FRAGMENT_FORMAT_VERSION,
            "fqn": fqn,
            "extent": extent,
            "block_period": block_period,
            "fields": dict(fields),
        }
    )


@dataclass(frozen=True, slots=True, eq=False)
class PortableFragment:
    """One piece of one parameter's fields: ``(fqn, index)`` names it in the catalog.

    ``fields`` maps each field name to a tight CPU tensor: an element field shaped like the
    piece (the global shape for a whole-parameter fragment, ``(length,)`` for a slice, the
    region's lengths for a region), a block field 1-D with one value per run of
    ``block_period`` elements. ``digest`` is what the catalog records for it.
    """

    fqn: str
    index: int
    extent: Extent
    block_period: int
    fields: Mapping[str, torch.Tensor]
    digest: str

    def __post_init__(self) -> None:
        # snapshot into an immutable map: later edits to the caller's dict cannot change the fragment
        object.__setattr__(self, "fields", FrozenMap(dict(self.fields)))

    @classmethod
    def from_catalog(
        cls, catalog: Catalog, fqn: str, index: int, fields: Mapping[str, torch.Tensor]
    ) -> PortableFragment:
        """The fragment ``(fqn, index)`` of ``catalog`` holding ``fields`` (e.g. read back from storage).

        Its extent and expected digest come from the catalog; the digest is verified when
        the fragment is used.
        """
        frags = catalog.fragments.get(fqn)
        if frags is None or not 0 <= index < len(frags):
            raise PortableStateError(f"the catalog has no fragment {index} of {fqn!r}")
        record = frags[index]
        return cls(fqn, index, record.extent, record.block_period, fields, record.digest)

    @property
    def key(self) -> tuple[str, int]:
        return (self.fqn, self.index)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())


def check_fragment_shape(fragment: PortableFragment, catalog: Catalog) -> None:
    """Structure only: the fragment exists in the catalog with this extent, digest and fields."""
    if type(fragment) is not PortableFragment:
        raise PortableStateError(f"expected a PortableFragment, got {type(fragment).__name__}")
    where = f"fragment {fragment.index} of {fragment.fqn!r}"
    frags = catalog.fragments.get(fragment.fqn)
    if frags is None or not 0 <= fragment.index < len(frags):
        raise PortableStateError(f"{where} is not in the catalog")
    record = frags[fragment.index]
    if (fragment.extent, fragment.block_period, fragment.digest) != (record.extent, record.block_period, record.digest):
        raise PortableStateError(f"{where} differs from the catalog's extent, block period or digest")
    tensors = catalog.fragment_tensors(fragment.fqn, fragment.index)
    if sorted(fragment.fields) != sorted(tensors):
        raise PortableStateError(f"{where} must hold exactly the fields {sorted(tensors)}")
    for name, (shape, dtype) in tensors.items():
        require_tight(fragment.fields[name], shape, dtype, f"{where} field {name!r}")


def verify_fragment(fragment: PortableFragment, catalog: Catalog) -> None:
    """Structure and content: recompute the digest and compare it with the catalog's."""
    check_fragment_shape(fragment, catalog)
    actual = fragment_digest(fragment.fqn, fragment.extent, fragment.block_period, fragment.fields)
    if not hmac.compare_digest(actual, catalog.fragments[fragment.fqn][fragment.index].digest):
        raise PortableIntegrityError(
            f"fragment {fragment.index} of {fragment.fqn!r} digest mismatch: its tensors were changed or corrupted"
        )

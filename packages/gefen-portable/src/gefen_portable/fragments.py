"""Fragments: the unit in which dense element fields are held, moved and persisted.

A fragment is one distinct piece of one parameter (a flat slice, a DTensor region, or the
whole parameter) with every element field of that piece as a tight fp32 CPU tensor. Its
digest is the contracts' digest (:func:`gefen_contracts.torch_support.tensor_digest`) of::

    {"format": "gefen.portable_state_fragment", "format_version": 1,
     "fqn": str, "extent": <logical_slice | logical_region record>, "fields": {name: tensor}}

so a fragment cannot be substituted for another parameter's or another extent's; the
catalog lists every fragment digest, and the catalog's own digest covers them all.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gefen_contracts import FrozenMap, to_primitive
from gefen_contracts.torch_support import tensor_digest

from .catalog import Catalog
from .errors import PortableIntegrityError, PortableStateError
from .extents import Extent
from .tensors import require_tight_fp32

__all__ = ["FRAGMENT_FORMAT", "FRAGMENT_FORMAT_VERSION", "PortableFragment", "fragment_digest", "verify_fragment"]

FRAGMENT_FORMAT = "gefen.portable_state_fragment"
FRAGMENT_FORMAT_VERSION = 1


def fragment_digest(fqn: str, extent: Extent, fields: Mapping[str, torch.Tensor]) -> str:
    """The digest of a fragment's content (see the module docstring)."""
    return tensor_digest(
        {
            "format": FRAGMENT_FORMAT,
            "format_version": FRAGMENT_FORMAT_VERSION,
            "fqn": fqn,
            "extent": to_primitive(extent),
            "fields": dict(fields),
        }
    )


@dataclass(frozen=True, slots=True, eq=False)
class PortableFragment:
    """One piece of one parameter's element fields: ``(fqn, index)`` names it in the catalog.

    ``fields`` maps each element field name to a tight fp32 CPU tensor shaped like the
    piece (the global shape for a whole-parameter fragment, ``(length,)`` for a slice, the
    region's lengths for a region). ``digest`` is what the catalog records for it.
    """

    fqn: str
    index: int
    extent: Extent
    fields: Mapping[str, torch.Tensor]
    digest: str

    def __post_init__(self) -> None:
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
        return cls(fqn, index, frags[index].extent, fields, frags[index].digest)

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
    if fragment.extent != record.extent or fragment.digest != record.digest:
        raise PortableStateError(f"{where} differs from the catalog's extent or digest")
    names = catalog.parameters[fragment.fqn].element_fields
    if tuple(sorted(fragment.fields)) != names:
        raise PortableStateError(f"{where} must hold exactly the fields {list(names)}")
    shape = catalog.fragment_shape(fragment.fqn, fragment.index)
    for name in names:
        require_tight_fp32(fragment.fields[name], shape, f"{where} field {name!r}")


def verify_fragment(fragment: PortableFragment, catalog: Catalog) -> None:
    """Structure and content: recompute the digest and compare it with the catalog's."""
    check_fragment_shape(fragment, catalog)
    actual = fragment_digest(fragment.fqn, fragment.extent, fragment.fields)
    if not hmac.compare_digest(actual, catalog.fragments[fragment.fqn][fragment.index].digest):
        raise PortableIntegrityError(
            f"fragment {fragment.index} of {fragment.fqn!r} digest mismatch: its tensors were changed or corrupted"
        )

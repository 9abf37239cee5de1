"""``PortableState``: what an export returns and an import accepts, sized for large models.

It holds the *catalog* every member agreed on (small: records, fragment digests, replica
fields, common state) and *this member's fragments* (its share of the fields). Nothing
requires a member to hold the whole state: a rank-sharded save writes each member's
fragments and one catalog; an import reads only the fragments that overlap its target
pieces. :meth:`PortableState.materialize` builds the complete
``gefen.portable_state`` document when that is wanted (small models, tests, one file).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gefen_contracts import ContractTypeError
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import ProcessGroupBinding

from .catalog import Catalog, parse_catalog
from .collectives import fetch_fragments
from .document import build_document, parse_document
from .errors import PortableIntegrityError, PortableStateError
from .fragments import PortableFragment, check_fragment_shape, verify_fragment
from .protocol import Session
from .values import clone_tree
from .wire import require_limits

__all__ = ["PortableState"]

_MATERIALIZE_TRANSACTION = "gefen-portable-materialize"


class PortableState:
    """The agreed catalog plus this member's fragments (see the module docstring).

    Build one with :func:`~gefen_portable.export_portable_state`, :meth:`from_document` or
    :meth:`from_parts`; it is immutable. Fragment digests are checked whenever fragments
    are used (import, materialize), not on construction.
    """

    __slots__ = ("_catalog", "_fragments")

    def __init__(self, catalog: Catalog, fragments: Iterable[PortableFragment]) -> None:
        if type(catalog) is not Catalog:
            raise ContractTypeError("PortableState needs a Catalog; use from_parts() for a catalog record")
        owned: dict[tuple[str, int], PortableFragment] = {}
        for fragment in fragments:
            check_fragment_shape(fragment, catalog)
            if fragment.key in owned:
                raise PortableStateError(f"fragment {fragment.index} of {fragment.fqn!r} is given twice")
            owned[fragment.key] = fragment
        self._catalog = catalog
        self._fragments = {key: owned[key] for key in catalog.fragment_keys() if key in owned}

    @classmethod
    def from_parts(
        cls, catalog: object, fragments: Iterable[PortableFragment], *, limits: PortableStateLimits
    ) -> PortableState:
        """Rebuild a state from a stored catalog record and any subset of its fragments."""
        return cls(parse_catalog(catalog, limits=limits), fragments)

    @classmethod
    def from_document(cls, document: object, *, limits: PortableStateLimits) -> PortableState:
        """Validate a complete document (every digest included) and hold all its fragments."""
        catalog, fragments = parse_document(document, limits=limits)
        return cls(catalog, fragments)

    # -- queries ------------------------------------------------------------------------

    @property
    def catalog(self) -> Catalog:
        """The agreed catalog (read it; do not mutate its records)."""
        return self._catalog

    @property
    def catalog_digest(self) -> str:
        return self._catalog.digest

    @property
    def implementation(self) -> str:
        return self._catalog.implementation

    def catalog_record(self) -> dict[str, object]:
        """The catalog as a fresh plain record (weights-only safe, its tensors cloned: editing it
        cannot change this state); store it once per checkpoint."""
        record = clone_tree(self._catalog.to_record())
        assert isinstance(record, dict)
        return record

    @property
    def fragments(self) -> tuple[PortableFragment, ...]:
        """This member's fragments, in catalog order."""
        return tuple(self._fragments.values())

    def fragment(self, fqn: str, index: int) -> PortableFragment | None:
        return self._fragments.get((fqn, index))

    @property
    def is_complete(self) -> bool:
        """True when this member holds every fragment (then materialize needs no collective)."""
        return len(self._fragments) == len(self._catalog.fragment_keys())

    @property
    def local_bytes(self) -> int:
        """Tensor bytes of this member's fragments."""
        return sum(f.nbytes for f in self._fragments.values())

    def held(self) -> Mapping[tuple[str, int], PortableFragment]:
        return dict(self._fragments)

    # -- materialization ----------------------------------------------------------------

    def materialize(
        self,
        checkpoint_process_group: ProcessGroupBinding | None = None,
        *,
        limits: PortableStateLimits | None = None,
        transaction_id: str = _MATERIALIZE_TRANSACTION,
    ) -> dict[str, Any]:
        """The complete ``gefen.portable_state`` document (fresh tensors, digest included).

        Without a communicating binding this member must hold every fragment. With one,
        every member of the group must call it (collectively); each receives the fragments
        it lacks and returns the same document. Peak memory per member: the whole compact
        state plus one fragment in flight.
        """
        limits = require_limits(PortableStateLimits() if limits is None else limits)
        catalog = self._catalog
        collected: dict[tuple[str, int], PortableFragment] = {}

        def sink(fragment: PortableFragment) -> None:
            collected[fragment.key] = fragment

        needed = set(catalog.fragment_keys())
        if checkpoint_process_group is not None and checkpoint_process_group.communicates:
            session = Session(checkpoint_process_group, "materialize", transaction_id, limits)
            session.gate("plan", None, context=catalog.digest)
            fetch_fragments(session, "materialize", catalog, self._fragments, needed, sink)
        else:
            missing = needed - set(self._fragments)
            if missing:
                raise PortableStateError(
                    f"this member holds {len(self._fragments)} of {len(needed)} fragments; pass the checkpoint "
                    "binding so the others are fetched"
                )
            for key in catalog.fragment_keys():
                fragment = self._fragments[key]
                verify_fragment(fragment, catalog)
                sink(fragment)
        if set(collected) != needed:
            raise PortableIntegrityError("the fragments delivered do not cover the catalog")
        document = build_document(catalog, collected)
        fresh = clone_tree(document)
        assert isinstance(fresh, dict)
        return fresh

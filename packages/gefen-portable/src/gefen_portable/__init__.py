"""gefen-portable: topology-neutral optimizer state for any optimizer that keeps the convention.

Free functions over any optimizer implementing :class:`gefen_contracts.protocols.PortableAdapter`:

* :func:`export_portable_state` -> :class:`PortableState` (the agreed catalog plus this
  member's fragments; :meth:`PortableState.materialize` gives the complete document);
* :func:`import_portable_state` accepts a :class:`PortableState` or a document, onto any
  target layout the optimizer's contract declares;
* :func:`export_portable_composite_state` / :func:`import_portable_composite_state` do the
  same for a :class:`gefen_contracts.protocols.Composite` whose children are adapters.

The wire codec (:func:`encode_wire`, :func:`parse_wire`, :func:`decode_wire`) is the
bounded, canonical byte form of any document or catalog.
"""

from __future__ import annotations

from ._version import __version__
from .catalog import CATALOG_FORMAT, CATALOG_FORMAT_VERSION, Catalog, FragmentRecord, parse_catalog
from .composite import (
    COMPOSITE_FORMAT,
    COMPOSITE_FORMAT_VERSION,
    PortableCompositeState,
    export_portable_composite_state,
    import_portable_composite_state,
)
from .document import PORTABLE_STATE_FORMAT, PORTABLE_STATE_FORMAT_VERSION, portable_state_digest, reseal_document
from .errors import (
    PortableCollectiveError,
    PortableIntegrityError,
    PortableLimitError,
    PortableStateError,
    WireFormatError,
)
from .export import export_portable_state
from .fragments import FRAGMENT_FORMAT, PortableFragment, fragment_digest
from .importer import import_portable_state
from .projection import needed_fragments
from .records import PORTABLE_STATE_COVERAGE, FieldSpec, ParameterRecord, StateHeader
from .state import PortableState
from .wire import (
    WIRE_CODEC_VERSION,
    WIRE_PREAMBLE,
    TensorSpec,
    WireLayout,
    WirePayload,
    bounded_clone,
    decode_wire,
    encode_wire,
    parse_wire,
    reconstruct_wire,
)

__all__ = [
    "CATALOG_FORMAT",
    "CATALOG_FORMAT_VERSION",
    "COMPOSITE_FORMAT",
    "COMPOSITE_FORMAT_VERSION",
    "FRAGMENT_FORMAT",
    "PORTABLE_STATE_COVERAGE",
    "PORTABLE_STATE_FORMAT",
    "PORTABLE_STATE_FORMAT_VERSION",
    "WIRE_CODEC_VERSION",
    "WIRE_PREAMBLE",
    "Catalog",
    "FieldSpec",
    "FragmentRecord",
    "ParameterRecord",
    "PortableCollectiveError",
    "PortableCompositeState",
    "PortableFragment",
    "PortableIntegrityError",
    "PortableLimitError",
    "PortableState",
    "PortableStateError",
    "StateHeader",
    "TensorSpec",
    "WireFormatError",
    "WireLayout",
    "WirePayload",
    "__version__",
    "bounded_clone",
    "decode_wire",
    "encode_wire",
    "export_portable_composite_state",
    "export_portable_state",
    "fragment_digest",
    "import_portable_composite_state",
    "import_portable_state",
    "needed_fragments",
    "parse_catalog",
    "parse_wire",
    "portable_state_digest",
    "reseal_document",
    "reconstruct_wire",
]

"""The composite's canonical local state document, ``gefen.composite_bound_state`` version 1.

It keeps the envelope every canonical local document has and nests each child's own
canonical document (a ``gefen.bound_state`` for ContractedAdamW and Gefen) under its role::

    {
        "format": "gefen.composite_bound_state",
        "format_version": 1,
        "coverage": "local_optimizer_fragment",
        "implementation": "<the composite's implementation>",
        "policy": {"child_implementations": {"muon": "...", "backup": "..."}},  # present roles
        "common": {},
        "manifest": <the composite's finalized ShardingManifest record>,
        "routing": [["<fqn>", "<role>"], ...],                              # sorted by FQN
        "children": {"<role>": <that child's canonical local document>, ...},
    }

Primitive containers and tensors only (``torch.load(weights_only=True)`` reads it). An import
requires the same composite implementation, child implementations, manifest and routing,
then hands each child its own document; the children route by exact FQN inside their parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from gefen_contracts import CodecError, StateValidationError
from gefen_contracts.codec import from_primitive, to_primitive
from gefen_contracts.manifest import ShardingManifest

__all__ = [
    "COMPOSITE_DOCUMENT_COVERAGE",
    "COMPOSITE_DOCUMENT_FORMAT",
    "COMPOSITE_DOCUMENT_KEYS",
    "COMPOSITE_DOCUMENT_VERSION",
    "build_composite_document",
    "children_of_document",
]

COMPOSITE_DOCUMENT_FORMAT = "gefen.composite_bound_state"
COMPOSITE_DOCUMENT_VERSION = 1
COMPOSITE_DOCUMENT_COVERAGE = "local_optimizer_fragment"
#: The keys of a composite document, exactly.
COMPOSITE_DOCUMENT_KEYS = frozenset(
    {"format", "format_version", "coverage", "implementation", "policy", "common", "manifest", "routing", "children"}
)


def _fail(message: str) -> NoReturn:
    raise StateValidationError(f"composite canonical state: {message}")


def build_composite_document(
    *,
    implementation: str,
    child_implementations: Mapping[str, str],
    manifest: ShardingManifest,
    routing: Sequence[tuple[str, str]],
    children: Mapping[str, dict[str, Any]],
) -> dict[str, Any]:
    """Assemble the document from the present children's own documents (not copied again)."""
    return {
        "format": COMPOSITE_DOCUMENT_FORMAT,
        "format_version": COMPOSITE_DOCUMENT_VERSION,
        "coverage": COMPOSITE_DOCUMENT_COVERAGE,
        "implementation": implementation,
        "policy": {"child_implementations": dict(child_implementations)},
        "common": {},
        "manifest": to_primitive(manifest),
        "routing": [[fqn, role] for fqn, role in routing],
        "children": {role: children[role] for role in child_implementations},
    }


def children_of_document(
    document: object,
    *,
    implementation: str,
    child_implementations: Mapping[str, str],
    manifest: ShardingManifest,
    routing: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """Validate the composite envelope for this composite; return role -> child document.

    Raises :class:`~gefen_contracts.StateValidationError` naming the problem. Reads only.
    """
    if type(document) is not dict:
        _fail(f"must be a dict, got {type(document).__name__}")
    keys = set(document)
    if keys != COMPOSITE_DOCUMENT_KEYS:
        _fail(
            f"keys must be {sorted(COMPOSITE_DOCUMENT_KEYS)}: missing {sorted(COMPOSITE_DOCUMENT_KEYS - keys)}, "
            f"extra {sorted(map(str, keys - COMPOSITE_DOCUMENT_KEYS))}"
        )
    if document["format"] != COMPOSITE_DOCUMENT_FORMAT:
        _fail(f"'format' must be {COMPOSITE_DOCUMENT_FORMAT!r}, got {document['format']!r}")
    version = document["format_version"]
    if type(version) is not int or version != COMPOSITE_DOCUMENT_VERSION:
        _fail(f"'format_version' {version!r} is not supported (this library reads {COMPOSITE_DOCUMENT_VERSION})")
    if document["coverage"] != COMPOSITE_DOCUMENT_COVERAGE:
        _fail(f"'coverage' must be {COMPOSITE_DOCUMENT_COVERAGE!r}")
    if document["implementation"] != implementation:
        _fail(f"'implementation' {document['implementation']!r} does not match {implementation!r}")
    policy = document["policy"]
    if policy != {"child_implementations": dict(child_implementations)}:
        _fail(
            f"'policy' {policy!r} differs from this composite's {{'child_implementations': {dict(child_implementations)}}}"
        )
    if document["common"] != {}:
        _fail("'common' must be empty")
    try:
        saved = from_primitive(document["manifest"], ShardingManifest)
    except CodecError as exc:
        _fail(f"'manifest': {exc}")
    if saved != manifest:
        _fail("the document's manifest differs from this composite's finalized manifest")
    saved_routing = document["routing"]
    if type(saved_routing) is not list or [tuple(p) if type(p) is list else p for p in saved_routing] != list(routing):
        _fail("the document's routing differs from this composite's (roles are fixed at post_sharding)")
    children = document["children"]
    if type(children) is not dict or set(children) != set(child_implementations):
        _fail(f"'children' must hold exactly the roles {sorted(child_implementations)}")
    return dict(children)

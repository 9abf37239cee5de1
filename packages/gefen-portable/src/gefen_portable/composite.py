"""The composite wrapper, ``gefen.portable_composite_state`` v1, for any role set.

A :class:`~gefen_contracts.protocols.Composite` whose children are portable adapters is
exported child by child (each with the full export protocol, phases prefixed by role) and
wrapped with its routing::

    {
      "format": "gefen.portable_composite_state", "format_version": 1,
      "coverage": "global_logical_composite_optimizer",
      "implementation": str,            # the composite's contract implementation
      "roles": [role, ...],             # the present children, in the composite's order
      "routing": {fqn: role, ...},      # every parameter, exactly the children's FQNs
      "children": {role: <gefen.portable_state document>, ...},
      "completion": {... "digest": hex}
    }

The wrapper digest covers everything but ``completion``, with each child document replaced
by its own completion digest (which covers the child), so verifying the wrapper never
re-hashes dense data. Import stages *every* child (each child's document, fetch and prepare
gates) before one shared freshness vote and then commits the children in role order, so a
failure in any child leaves every child untouched.

Differences from the reference (spec section 5): any roles and child implementations
(no ``backup_optimizer`` key, no fixed ``muon``/``backup`` pair, absent children are simply
not listed), one transaction id for the whole composite with role-prefixed phases instead
of derived child transaction ids, and a wrapper digest over child digests.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from gefen_contracts import ContractTypeError
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.protocols import Composite, ContractProvider
from gefen_contracts.torch_support import ProcessGroupBinding, routing_mismatch, tensor_digest

from .errors import PortableIntegrityError, PortableStateError
from .export import export_on_session
from .importer import commit_on_session, prepare_on_session
from .records import check_keys, completion_record, parse_completion
from .runtime import context_digest, open_session, require_adapter
from .state import PortableState
from .values import check_name
from .wire import bounded_clone, require_limits

__all__ = [
    "COMPOSITE_COVERAGE",
    "COMPOSITE_FORMAT",
    "COMPOSITE_FORMAT_VERSION",
    "PortableCompositeState",
    "export_portable_composite_state",
    "import_portable_composite_state",
    "wrapper_payload",
]

COMPOSITE_FORMAT = "gefen.portable_composite_state"
COMPOSITE_FORMAT_VERSION = 1
COMPOSITE_COVERAGE = "global_logical_composite_optimizer"
_TOP_KEYS = {"format", "format_version", "coverage", "implementation", "roles", "routing", "children", "completion"}


def wrapper_payload(
    implementation: str, roles: tuple[str, ...], routing: Mapping[str, str], digests: Mapping[str, str]
) -> dict[str, object]:
    """What the wrapper digest covers: the wrapper with each child replaced by its digest."""
    return {
        "format": COMPOSITE_FORMAT,
        "format_version": COMPOSITE_FORMAT_VERSION,
        "coverage": COMPOSITE_COVERAGE,
        "implementation": implementation,
        "roles": list(roles),
        "routing": dict(routing),
        "children": dict(digests),
    }


class PortableCompositeState:
    """Per-role :class:`PortableState` children of a composite, with the routing they obey.

    ``routing`` maps every FQN to its role and must equal the union of the children's
    parameters; roles are unique and ordered. ``digest`` covers the implementation, roles,
    routing and every child's catalog digest.
    """

    __slots__ = ("_children", "_implementation", "_roles", "_routing")

    def __init__(
        self,
        implementation: str,
        routing: Mapping[str, str],
        children: Mapping[str, PortableState],
    ) -> None:
        check_name(implementation, "composite implementation")
        roles = tuple(children)
        if not roles:
            raise PortableStateError("a composite state needs at least one child")
        union: dict[str, str] = {}
        for role, child in children.items():
            check_name(role, "composite role")
            if type(child) is not PortableState:
                raise ContractTypeError(f"child {role!r} must be a PortableState, got {type(child).__name__}")
            for fqn in child.catalog.parameters:
                if fqn in union:
                    raise PortableStateError(f"parameter {fqn!r} belongs to both {union[fqn]!r} and {role!r}")
                union[fqn] = role
        if dict(routing) != union:
            raise PortableStateError("the composite routing must map exactly the children's parameters to their roles")
        self._implementation = implementation
        self._roles = roles
        self._routing = dict(sorted(routing.items()))
        self._children = dict(children)

    @property
    def implementation(self) -> str:
        return self._implementation

    @property
    def roles(self) -> tuple[str, ...]:
        return self._roles

    @property
    def routing(self) -> dict[str, str]:
        return dict(self._routing)

    @property
    def children(self) -> dict[str, PortableState]:
        return dict(self._children)

    @property
    def digest(self) -> str:
        digests = {role: child.catalog_digest for role, child in self._children.items()}
        return tensor_digest(wrapper_payload(self._implementation, self._roles, self._routing, digests))

    def materialize(
        self, checkpoint_process_group: ProcessGroupBinding | None = None, *, limits: PortableStateLimits | None = None
    ) -> dict[str, Any]:
        """The complete wrapper document (collective when given a communicating binding)."""
        documents = {
            role: child.materialize(checkpoint_process_group, limits=limits) for role, child in self._children.items()
        }
        digests = {role: str(doc["completion"]["digest"]) for role, doc in documents.items()}
        payload = wrapper_payload(self._implementation, self._roles, self._routing, digests)
        completion = completion_record(tensor_digest(payload))
        return {**payload, "children": documents, "completion": completion}

    @classmethod
    def from_document(cls, document: object, *, limits: PortableStateLimits) -> PortableCompositeState:
        """Validate a wrapper document (its digest and every child's) under ``limits``."""
        require_limits(limits)
        top = check_keys(document, _TOP_KEYS, "composite document")
        children_raw = top["children"]
        if type(children_raw) is not dict:
            raise PortableStateError("composite document.children must be a dict")
        digests: dict[str, object] = {}
        for role, child in children_raw.items():
            completion = child.get("completion") if type(child) is dict else None
            digests[role] = parse_completion(completion, f"composite document.children[{role!r}].completion")
        # children stand in as their digests, so this copies no child tensors; each child is parsed below
        shallow = bounded_clone(
            {**{k: v for k, v in top.items() if k != "children"}, "children": digests}, limits=limits
        )
        assert isinstance(shallow, dict)
        if shallow["format"] != COMPOSITE_FORMAT or shallow["coverage"] != COMPOSITE_COVERAGE:
            raise PortableStateError(f"composite document format must be {COMPOSITE_FORMAT!r}")
        if type(shallow["format_version"]) is not int or shallow["format_version"] != COMPOSITE_FORMAT_VERSION:
            raise PortableStateError(
                f"composite document format_version is {shallow['format_version']!r}; this library reads version "
                f"{COMPOSITE_FORMAT_VERSION}"
            )
        implementation = check_name(shallow["implementation"], "composite document.implementation")
        roles = shallow["roles"]
        if type(roles) is not list:
            raise PortableStateError("composite document.roles must be a list")
        for role in roles:
            check_name(role, "composite document.roles item")
        if len(set(roles)) != len(roles) or set(roles) != set(children_raw):
            raise PortableStateError("composite document.roles must list each child exactly once")
        routing = shallow["routing"]
        if type(routing) is not dict or any(type(v) is not str for v in routing.values()):
            raise PortableStateError("composite document.routing must map FQNs to roles")
        claimed = parse_completion(shallow["completion"], "composite document.completion")
        payload = wrapper_payload(implementation, tuple(roles), routing, digests)  # type: ignore[arg-type]
        if not hmac.compare_digest(tensor_digest(payload), claimed):
            raise PortableIntegrityError("composite completion digest mismatch: the wrapper was changed or corrupted")
        children = {role: PortableState.from_document(children_raw[role], limits=limits) for role in roles}
        return cls(implementation, routing, children)


def _composite_children(optimizer: Any) -> tuple[str, dict[str, Any], dict[str, str]]:
    if not isinstance(optimizer, Composite):
        raise ContractTypeError(f"{type(optimizer).__name__} does not implement the Composite Protocol")
    if not isinstance(optimizer, ContractProvider):
        raise ContractTypeError(f"{type(optimizer).__name__} publishes no optimizer contract")
    implementation = optimizer.optimizer_contract().implementation
    children = dict(optimizer.child_optimizers())
    if not children:
        raise PortableStateError("the composite has no children")
    for child in children.values():
        require_adapter(child)
    routing_pairs = tuple(optimizer.parameter_routing())
    if list(routing_pairs) != sorted(routing_pairs):
        raise PortableStateError("parameter_routing() must be sorted")
    routing = dict(routing_pairs)
    if len(routing) != len(routing_pairs) or not set(routing.values()) <= set(children):
        raise PortableStateError("parameter_routing() must name each parameter once, with a present role")
    return implementation, children, routing


def export_portable_composite_state(
    optimizer: Any,
    *,
    checkpoint_process_group: ProcessGroupBinding,
    transaction_id: str,
    limits: PortableStateLimits,
) -> PortableCompositeState:
    """Export every child of a composite (collective; read-only; same failure rules as
    :func:`~gefen_portable.export_portable_state`)."""
    session = open_session(checkpoint_process_group, "composite_export", transaction_id, limits, optimizer)
    error: BaseException | None = None
    context = None
    implementation = ""
    children: dict[str, Any] = {}
    routing: dict[str, str] = {}
    try:
        implementation, children, routing = _composite_children(optimizer)
        context = context_digest("composite_export", implementation, roles=list(children), routing=routing)
    except Exception as exc:
        error = exc
    session.gate("composite.prepare", error, context=context)
    states = {role: export_on_session(child, session, prefix=f"{role}.") for role, child in children.items()}
    result = None
    digest = None
    try:
        result = PortableCompositeState(implementation, routing, states)
        digest = result.digest
    except Exception as exc:
        error = exc
    session.gate("composite.finalize", error, context=digest)
    assert result is not None
    return result


def import_portable_composite_state(
    optimizer: Any,
    state: PortableCompositeState | Mapping[str, Any],
    *,
    checkpoint_process_group: ProcessGroupBinding,
    transaction_id: str,
    limits: PortableStateLimits,
) -> None:
    """Import a composite state: stage every child, one shared freshness vote, commit all.

    The routing and the set of roles must equal the target composite's; each child then
    follows :func:`~gefen_portable.import_portable_state`'s rules, without publishing,
    until the shared vote.
    """
    session = open_session(checkpoint_process_group, "composite_import", transaction_id, limits, optimizer)
    error: BaseException | None = None
    context = None
    children: dict[str, Any] = {}
    composite = None
    try:
        implementation, children, routing = _composite_children(optimizer)
        if isinstance(state, PortableCompositeState):
            composite = state
        elif isinstance(state, Mapping):
            composite = PortableCompositeState.from_document(dict(state), limits=session.limits)
        else:
            raise ContractTypeError(f"expected a PortableCompositeState or a document, got {type(state).__name__}")
        if composite.implementation != implementation:
            raise PortableStateError(
                f"the document was exported by {composite.implementation!r}, the target is {implementation!r}"
            )
        if composite.roles != tuple(children):
            raise PortableStateError(
                f"the document's roles {list(composite.roles)} differ from the target composite's {list(children)}"
            )
        mismatch = routing_mismatch(composite.routing, routing)
        if mismatch is not None:
            raise PortableStateError(f"the document's routing differs from the target composite's: {mismatch}")
        context = context_digest("composite_import", implementation, document=composite.digest, routing=routing)
    except Exception as exc:
        error = exc
    session.gate("composite.document", error, context=context)
    assert composite is not None
    prepared = [
        prepare_on_session(child, composite.children[role], session, prefix=f"{role}.")
        for role, child in children.items()
    ]
    commit_on_session(session, prepared, phase="composite.commit")

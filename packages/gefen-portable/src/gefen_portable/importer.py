"""``import_portable_state``: stage on every member, vote once, publish by the adapter's swap."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gefen_contracts import ContractTypeError, StaleTransactionError
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.protocols import Composite, PortableAdapter
from gefen_contracts.torch_support import ProcessGroupBinding
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .collectives import fetch_fragments
from .errors import PortableStateError
from .freshness import optimizer_token
from .local_export import check_layout
from .projection import Projection, check_target
from .protocol import Session
from .runtime import check_transitions, context_digest, manifest_digest, open_session, require_adapter
from .state import PortableState
from .values import clone_tree

__all__ = ["PreparedImport", "commit_on_session", "import_portable_state", "prepare_on_session"]


@dataclass(frozen=True, slots=True, eq=False)
class PreparedImport:
    """A staged import of one adapter, with the freshness token taken when it was staged."""

    optimizer: Any
    staged: StagedTransaction
    token: tuple[object, ...]


def import_portable_state(
    optimizer: Any,
    state: PortableState | Mapping[str, Any],
    *,
    checkpoint_process_group: ProcessGroupBinding,
    transaction_id: str,
    limits: PortableStateLimits,
) -> None:
    """Import a portable state (a :class:`PortableState` or a complete document) into ``optimizer``.

    Collective over ``checkpoint_process_group``; the target layout may differ from the
    source (any member count, any layout pair the target's contract declares). Each member
    validates the document (its digest, every limit), fetches only the fragments that
    overlap its own pieces, projects them onto its slots and lets the adapter stage the
    result without mutation; then every member votes, checks that its optimizer did not
    change since staging, votes again and publishes with the adapter's commit. Any failure
    before the last vote leaves every member's optimizer untouched and makes every member
    raise the same :class:`~gefen_portable.PortableCollectiveError` (a one-member binding
    raises the original, typed error). Not covered: process death, a backend failure or a
    concurrent mutation after the last vote.
    """
    if isinstance(optimizer, Composite) and not isinstance(optimizer, PortableAdapter):
        raise ContractTypeError(
            f"{type(optimizer).__name__} is a composite optimizer; use import_portable_composite_state"
        )
    session = open_session(checkpoint_process_group, "import", transaction_id, limits, optimizer)
    prepared = prepare_on_session(optimizer, state, session, prefix="")
    commit_on_session(session, [prepared], phase="commit")


def _as_state(source: object, limits: PortableStateLimits) -> PortableState:
    if isinstance(source, PortableState):
        return source
    if isinstance(source, Mapping):
        return PortableState.from_document(source, limits=limits)
    raise ContractTypeError(f"a portable import needs a PortableState or a document dict, got {type(source).__name__}")


def prepare_on_session(optimizer: Any, source: object, session: Session, *, prefix: str) -> PreparedImport:
    """Validate, fetch, project and stage on every member (three gates; nothing published)."""
    error: BaseException | None = None
    state = layout = context = None
    try:
        require_adapter(optimizer)
        layout = optimizer.portable_layout()
        check_layout(layout, session.binding)
        state = _as_state(source, session.limits)
        check_target(state.catalog, layout)
        check_transitions(optimizer, state.catalog.header.manifest, layout)
        context = context_digest(
            "import", layout.implementation, catalog=state.catalog_digest, target=manifest_digest(layout.manifest)
        )
    except Exception as exc:
        error = exc
    session.gate(f"{prefix}document", error, context=context)
    # the gate raised on every member if any member failed, so these are all set here
    assert state is not None and layout is not None
    catalog = state.catalog
    projection = None
    try:
        projection = Projection(catalog, layout, max_bytes=session.limits.max_fragment_tensor_bytes)
    except Exception as exc:
        error = exc
    # after a local failure this member still joins every transfer; the fetch gate reports the error
    needed = projection.needed if projection is not None else set()
    fetch_fragments(
        session,
        f"{prefix}fetch",
        catalog,
        state.held(),
        needed,
        projection.accept if projection is not None else (lambda fragment: None),
        error,
    )
    assert projection is not None
    staged = None
    token: tuple[object, ...] = ()
    try:
        slots = projection.slot_states()
        header = catalog.header
        before = optimizer_token(optimizer)
        result = optimizer.portable_prepare_import(
            implementation=header.implementation,
            policy=clone_tree(header.policy),
            common=clone_tree(header.common),
            slots=slots,
        )
        staged = require_transaction(result)
        token = optimizer_token(optimizer)
        if token != before:
            raise PortableStateError("portable_prepare_import() changed the optimizer (it must only stage)")
        if not staged.belongs_to(optimizer) or staged.consumed:
            raise PortableStateError("portable_prepare_import() returned a transaction of another optimizer")
    except Exception as exc:
        error = exc
    session.gate(f"{prefix}prepare", error, context=context)
    assert staged is not None
    return PreparedImport(optimizer, staged, token)


def commit_on_session(session: Session, prepared: Sequence[PreparedImport], *, phase: str) -> None:
    """The freshness vote, then every adapter's commit (in order). Nothing is checked after the vote."""
    error: BaseException | None = None
    try:
        for item in prepared:
            if optimizer_token(item.optimizer) != item.token:
                raise StaleTransactionError("the optimizer changed after the import was staged; nothing was published")
            if item.staged.consumed:
                raise StaleTransactionError("the staged import was already consumed")
    except Exception as exc:
        error = exc
    session.gate(phase, error)
    for item in prepared:
        item.optimizer.portable_commit_import(item.staged)

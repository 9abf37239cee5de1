"""``export_portable_state``: a collective, read-only snapshot of any portable adapter."""

from __future__ import annotations

from typing import Any

from gefen_contracts import ContractTypeError
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.protocols import Composite, PortableAdapter
from gefen_contracts.torch_support import ProcessGroupBinding

from .assembly import assemble_catalog
from .collectives import share_values
from .errors import PortableLimitError, PortableStateError
from .fragments import PortableFragment
from .freshness import live_storages, optimizer_token
from .local_export import LocalExport, build_local_export, check_layout
from .protocol import Session
from .runtime import context_digest, open_session, require_adapter
from .state import PortableState

__all__ = ["export_on_session", "export_portable_state"]


def export_portable_state(
    optimizer: Any,
    *,
    checkpoint_process_group: ProcessGroupBinding,
    transaction_id: str,
    limits: PortableStateLimits,
) -> PortableState:
    """Export the optimizer's state as a topology-neutral :class:`PortableState`.

    Collective over ``checkpoint_process_group`` (every member calls it; a one-member
    binding runs no collective). The optimizer must implement
    :class:`~gefen_contracts.protocols.PortableAdapter` and currently support ``portable_state``.
    Every member returns a state with the same catalog and its own share of the fragments
    (no dense data moves between members). Nothing is mutated. A failure on any member
    makes every member raise the same :class:`~gefen_portable.PortableCollectiveError`
    (a one-member binding raises the original error). ``transaction_id`` must be equal on
    every member; ``limits`` bound every record and collective round before allocation.
    """
    if isinstance(optimizer, Composite) and not isinstance(optimizer, PortableAdapter):
        raise ContractTypeError(
            f"{type(optimizer).__name__} is a composite optimizer; use export_portable_composite_state"
        )
    session = open_session(checkpoint_process_group, "export", transaction_id, limits, optimizer)
    return export_on_session(optimizer, session, prefix="")


def export_on_session(optimizer: Any, session: Session, *, prefix: str) -> PortableState:
    """The export protocol on an open session (composites run one per child, phases prefixed)."""
    local: LocalExport | None = None
    error: BaseException | None = None
    context = None
    try:
        require_adapter(optimizer)
        layout = optimizer.portable_layout()
        check_layout(layout, session.binding)
        context = context_digest("export", layout.implementation)
        live = live_storages(optimizer)
        before = optimizer_token(optimizer)
        exported = optimizer.portable_export()
        if optimizer_token(optimizer) != before:
            raise PortableStateError("the optimizer changed while portable_export() ran (it must not mutate anything)")
        local = build_local_export(layout, exported, session.binding, live)
        local_bytes = sum(t.numel() * t.element_size() for f in local.fragments.values() for t in f.fields.values())
        if local_bytes > session.limits.max_fragment_tensor_bytes:
            raise PortableLimitError(
                "max_fragment_tensor_bytes", f"this member's fragment fields hold {local_bytes} bytes"
            )
    except Exception as exc:
        error = exc
    session.gate(f"{prefix}prepare", error, context=context)
    assert local is not None
    contributions = share_values(session, f"{prefix}catalog", local.contribution, None)
    state = None
    catalog_digest = None
    try:
        assembly = assemble_catalog(contributions, local.header, session.binding.identity)
        catalog = assembly.catalog
        if catalog.total_fragment_bytes > session.limits.max_collective_tensor_bytes:
            raise PortableLimitError(
                "max_collective_tensor_bytes", f"the state's fragment fields hold {catalog.total_fragment_bytes} bytes"
            )
        kept = []
        for key, holder in assembly.holders.items():
            if holder != session.coordinate:
                continue
            fqn, index = key
            candidate = local.fragments[fqn]
            record = catalog.fragments[fqn][index]
            if (candidate.extent, candidate.block_period, candidate.digest) != (
                record.extent,
                record.block_period,
                record.digest,
            ):
                raise PortableStateError(f"this member was assigned fragment {index} of {fqn!r} but holds another")
            kept.append(
                PortableFragment(fqn, index, record.extent, record.block_period, candidate.fields, record.digest)
            )
        state = PortableState(catalog, kept)
        catalog_digest = catalog.digest
    except Exception as exc:
        error = exc
    session.gate(f"{prefix}finalize", error, context=catalog_digest)
    assert state is not None
    return state

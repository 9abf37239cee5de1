"""What every portable entry point checks about the optimizer and the binding it was given."""

from __future__ import annotations

from typing import Any

from gefen_contracts import FEATURE_PORTABLE_STATE, ContractTypeError, NotSupportedError
from gefen_contracts.digest import descriptor_digest
from gefen_contracts.enums import CheckpointTransport
from gefen_contracts.exchange import PortableLayout
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.protocols import CollectiveScoped, ContractProvider, PortableAdapter
from gefen_contracts.torch_support import ProcessGroupBinding, tensor_digest

from .errors import PortableStateError
from .protocol import Session

__all__ = ["check_transitions", "context_digest", "manifest_digest", "open_session", "require_adapter"]

_CONTEXT_FORMAT = "gefen.portable_runtime_context"


def open_session(binding: object, operation: str, transaction_id: object, limits: object, optimizer: Any) -> Session:
    """A :class:`Session` over ``binding``.

    If ``binding`` is not a binding at all, the failure is still reported collectively when
    the optimizer exposes its own collective scope (:class:`~gefen_contracts.protocols.CollectiveScoped`),
    so the other members raise instead of waiting; otherwise it is raised here and the other
    members fail at their first collective when the process group's timeout expires.
    """
    if isinstance(binding, ProcessGroupBinding):
        return Session(binding, operation, transaction_id, limits)
    problem = ContractTypeError(
        f"checkpoint_process_group must be a CheckpointProcessGroupBinding, got {type(binding).__name__}"
    )
    scope = None
    if isinstance(optimizer, CollectiveScoped):
        try:
            scope = optimizer.collective_scope()
        except Exception:
            scope = None
    if not isinstance(scope, ProcessGroupBinding):
        raise problem
    session = Session(scope, operation, transaction_id, limits)
    session.setup_error = problem
    return session


def require_adapter(optimizer: Any) -> None:
    """The optimizer implements :class:`~gefen_contracts.protocols.PortableAdapter` and its contract
    currently supports the ``portable_state`` feature (``NotSupportedError`` with its reasons)."""
    if not isinstance(optimizer, PortableAdapter):
        raise ContractTypeError(f"{type(optimizer).__name__} does not implement the PortableAdapter Protocol")
    if not isinstance(optimizer, ContractProvider):
        raise ContractTypeError(f"{type(optimizer).__name__} publishes no optimizer contract")
    optimizer.optimizer_contract().require(FEATURE_PORTABLE_STATE)


def context_digest(operation: str, implementation: str, **extra: object) -> str:
    """The digest every member must share at a gate (the operation's runtime context)."""
    return tensor_digest(
        {
            "format": _CONTEXT_FORMAT,
            "format_version": 1,
            "operation": operation,
            "implementation": implementation,
            **extra,
        }
    )


def check_transitions(optimizer: Any, source: ShardingManifest, layout: PortableLayout) -> None:
    """The target's contract must declare every layout change an import performs.

    A parameter whose source shards equal its target shards needs its layout in the
    ``CANONICAL_GLOBAL`` entry's ``same_topology``; any other change needs a declared
    transition from the source layout to the target layout.
    """
    contract = optimizer.optimizer_contract()
    entries = [e for e in contract.capabilities.checkpoints if e.transport is CheckpointTransport.CANONICAL_GLOBAL]
    if not entries:
        raise NotSupportedError(FEATURE_PORTABLE_STATE, ("the contract has no canonical_global checkpoint entry",))
    for fqn in layout.manifest.fqns:
        before = source.for_parameter(fqn)
        after = layout.manifest.for_parameter(fqn)
        if not before:
            continue
        src, dst = before[0].layout, after[0].layout
        if before == after:
            if not any(dst in e.same_topology for e in entries):
                raise NotSupportedError(
                    FEATURE_PORTABLE_STATE, (f"{fqn!r}: canonical_global does not declare layout {dst.value}",)
                )
        elif not any(e.allows_transition(src, dst) for e in entries):
            raise NotSupportedError(
                FEATURE_PORTABLE_STATE,
                (f"{fqn!r}: canonical_global declares no transition {src.value} -> {dst.value}",),
            )


def manifest_digest(manifest: ShardingManifest) -> str:
    if type(manifest) is not ShardingManifest:
        raise PortableStateError("expected a ShardingManifest")
    return descriptor_digest(manifest)

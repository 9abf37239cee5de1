"""What every member of a portable checkpoint must agree on before any I/O.

A storage plugin is identified by its exact class (``__module__`` and ``__qualname__``) and
its ``checkpoint_id`` (``os.fspath``, made absolute for the filesystem reader and writer).
The preflight gate of :func:`~gefen_dcp.save_portable_dcp` and
:func:`~gefen_dcp.load_portable_dcp` votes on the local checks, then makes every member
agree on ``(direction, namespace, storage identity, transaction id, limits)``; a member that
differs makes every member raise :class:`~gefen_dcp.StorageMismatchError` before anything is
written, read or changed.
"""

from __future__ import annotations

import os
from typing import Any

from gefen_contracts import ContractError, ContractTypeError
from gefen_contracts.codec import to_primitive
from gefen_contracts.digest import canonical_digest
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import ProcessGroupBinding, agree_digest, failure_vote
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemWriter as _StockWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .errors import StorageMismatchError
from .portable_format import check_namespace

__all__ = ["preflight", "require_binding", "storage_identity"]


def require_binding(binding: object) -> ProcessGroupBinding:
    if not isinstance(binding, ProcessGroupBinding):
        raise ContractTypeError(
            f"checkpoint_process_group must be a CheckpointProcessGroupBinding, got {type(binding).__name__}"
        )
    return binding


def storage_identity(storage: object, kind: type) -> dict[str, str]:
    """``{"module", "qualname", "checkpoint_id"}`` of a storage writer or reader."""
    if not isinstance(storage, kind):
        raise ContractTypeError(
            f"expected a torch.distributed.checkpoint {kind.__name__}, got {type(storage).__name__}"
        )
    checkpoint_id: Any = getattr(storage, "checkpoint_id", None)
    try:
        location = os.fspath(checkpoint_id)
    except TypeError:
        raise ContractTypeError(
            f"{type(storage).__name__} has no str or path-like checkpoint_id, so its identity cannot be agreed on"
        ) from None
    if isinstance(location, bytes):
        location = os.fsdecode(location)
    if not location or "\x00" in location:
        raise ContractError(f"{type(storage).__name__}.checkpoint_id must be a non-empty path without NUL")
    if isinstance(storage, (_StockWriter, FileSystemReader)):
        location = os.path.abspath(location)
    kind_of = type(storage)
    return {"module": kind_of.__module__, "qualname": kind_of.__qualname__, "checkpoint_id": location}


def preflight(
    binding: ProcessGroupBinding,
    *,
    direction: str,
    namespace: object,
    storage: object,
    transaction_id: object,
    limits: object,
) -> None:
    """Local checks, one failure vote, then agreement on the context (see the module docstring)."""
    error: BaseException | None = None
    digest = ""
    try:
        if type(limits) is not PortableStateLimits:
            raise ContractTypeError(f"limits must be a PortableStateLimits, got {type(limits).__name__}")
        check_namespace(namespace, limits)
        if type(transaction_id) is not str or not transaction_id or transaction_id != transaction_id.strip():
            raise ContractTypeError("transaction_id must be a non-empty str without outer whitespace")
        identity = storage_identity(storage, StorageWriter if direction == "save" else StorageReader)
        binding.validate_runtime()
        digest = canonical_digest(
            {
                "direction": direction,
                "namespace": namespace,
                "storage": identity,
                "transaction_id": transaction_id,
                "limits": to_primitive(limits),
            }
        )
    except Exception as exc:
        error = exc
    failure_vote(binding, f"gefen_dcp.portable_{direction}.preflight", error)
    try:
        agree_digest(binding, digest, what="the portable checkpoint's namespace, storage, transaction and limits")
    except ContractError as exc:
        raise StorageMismatchError(str(exc)) from None

"""Specific exception types of the convention.

Every error raised by a descriptor constructor or a Protocol implementation is one of
these (or a built-in subclass they derive from), so callers can catch precisely what
went wrong. Each message says which field or argument was wrong and how.
"""

from __future__ import annotations

__all__ = [
    "CodecError",
    "CollectiveFailureError",
    "ContractError",
    "ContractTypeError",
    "KernelUnavailableError",
    "LayoutTamperedError",
    "NotSupportedError",
    "StaleTransactionError",
    "StateValidationError",
]


class ContractError(ValueError):
    """A descriptor or request has a value that breaks a rule of the convention."""


class ContractTypeError(TypeError):
    """A descriptor or request has a value of the wrong (exact) type."""


class CodecError(ContractError):
    """A primitive record cannot be decoded into a descriptor (wrong keys, types or values)."""


class StateValidationError(ContractError):
    """Optimizer state (a state dict or a document) failed validation; nothing was changed."""


class NotSupportedError(RuntimeError):
    """A capability was used that the optimizer's contract declares unsupported.

    ``feature`` names the capability and ``reasons`` repeats the contract's reasons, so an
    adapter can explain what is missing. Raising it never changes the optimizer.
    """

    def __init__(self, feature: str, reasons: tuple[str, ...] | list[str] = ()) -> None:
        self.feature = feature
        self.reasons = tuple(reasons)
        why = "; ".join(self.reasons) if self.reasons else "no reason given"
        super().__init__(f"{feature!r} is not supported by this optimizer: {why}")


class StaleTransactionError(RuntimeError):
    """A prepared (staged) transaction cannot be committed: it was made by another
    optimizer, was already consumed, or the optimizer changed since it was prepared."""


class LayoutTamperedError(RuntimeError):
    """The sealed parameter layout was changed outside ``post_sharding``."""


class CollectiveFailureError(RuntimeError):
    """A failure on one member of a process group, propagated to every member by a vote.

    ``phase`` names the protocol phase; ``local`` is True on the member where the error
    happened (its message carries the original error) and False elsewhere.
    """

    def __init__(self, message: str, *, phase: str, local: bool) -> None:
        self.phase = phase
        self.local = local
        super().__init__(message)


class KernelUnavailableError(RuntimeError):
    """``fused=True`` was requested but no kernel is registered for an op on the tensors' device."""

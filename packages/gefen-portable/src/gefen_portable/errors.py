"""Specific exception types of gefen-portable.

Everything a document, catalog, fragment or wire payload can get wrong is a
:class:`PortableStateError` (a :class:`~gefen_contracts.StateValidationError`, hence a
``ValueError``), so a caller can catch "this state was refused" in one place. A failure on
one member of a process group surfaces on every member as the same
:class:`PortableCollectiveError` (a :class:`~gefen_contracts.CollectiveFailureError`).
"""

from __future__ import annotations

from gefen_contracts import CollectiveFailureError, StateValidationError

__all__ = [
    "PortableCollectiveError",
    "PortableIntegrityError",
    "PortableLimitError",
    "PortableStateError",
    "WireFormatError",
]


class PortableStateError(StateValidationError):
    """A portable document, catalog, fragment or adapter record is malformed or inconsistent.

    Raising it never changes an optimizer. The message names the record and field.
    """


class PortableIntegrityError(PortableStateError):
    """A digest did not match: the bytes were corrupted, truncated or substituted."""


class PortableLimitError(PortableStateError):
    """A :class:`~gefen_contracts.limits.PortableStateLimits` bound was exceeded.

    ``limit`` is the name of the field that was exceeded; the check always runs before the
    memory it protects is allocated.
    """

    def __init__(self, limit: str, message: str) -> None:
        self.limit = limit
        super().__init__(f"{message} (limit {limit})")


class WireFormatError(PortableStateError):
    """Wire bytes are malformed or not in canonical form (one value has exactly one encoding)."""


class PortableCollectiveError(CollectiveFailureError):
    """A portable protocol phase failed on at least one member; every member raises this.

    The message is identical on every member and lists each failing member with its error.
    ``failures`` holds ``(member, error text)`` pairs in coordinate order; ``local`` is True
    where this member itself failed (its original exception is the ``__cause__``).
    """

    def __init__(self, message: str, *, phase: str, local: bool, failures: tuple[tuple[str, str], ...]) -> None:
        self.failures = failures
        super().__init__(message, phase=phase, local=local)

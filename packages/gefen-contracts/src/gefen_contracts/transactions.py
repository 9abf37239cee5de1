"""Single-use prepared transactions: the token every two-phase Protocol hands back.

A prepare/stage phase validates everything on a shadow and returns a
:class:`StagedTransaction`. Committing it checks, before any mutation, that it belongs to
this optimizer, is of the expected kind, was not consumed and that the optimizer's
freshness token did not change since preparation; only then is it marked consumed and its
payload published by swaps that cannot raise.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable

from .errors import ContractTypeError, StaleTransactionError

__all__ = ["StagedTransaction"]


class StagedTransaction:
    """Opaque, single-use result of a prepare phase, bound to one optimizer."""

    __slots__ = ("__weakref__", "_consumed", "_kind", "_owner", "_payload", "_token")

    def __init__(self, owner: object, *, kind: str, token: Hashable, payload: object) -> None:
        if type(kind) is not str or not kind:
            raise ContractTypeError("StagedTransaction.kind must be a non-empty str")
        try:
            self._owner: weakref.ref[object] | None = weakref.ref(owner)
        except TypeError:
            raise ContractTypeError(f"{type(owner).__name__} cannot own a StagedTransaction (no weakref)") from None
        self._kind = kind
        self._token = token
        self._payload = payload
        self._consumed = False

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def consumed(self) -> bool:
        return self._consumed

    def belongs_to(self, owner: object) -> bool:
        return self._owner is not None and self._owner() is owner

    def claim(self, owner: object, *, kind: str, current_token: Hashable) -> object:
        """Validate and consume; return the payload. Raises before consuming on any mismatch."""
        if type(self) is not StagedTransaction:
            raise ContractTypeError("not a StagedTransaction")
        if not self.belongs_to(owner):
            raise StaleTransactionError("this prepared transaction was created by another optimizer")
        if self._kind != kind:
            raise StaleTransactionError(f"expected a {kind!r} transaction, got {self._kind!r}")
        if self._consumed:
            raise StaleTransactionError("this prepared transaction was already consumed")
        if current_token != self._token:
            raise StaleTransactionError("the optimizer changed after this transaction was prepared; prepare it again")
        self._consumed = True
        payload, self._payload = self._payload, None
        return payload

    def __repr__(self) -> str:
        state = "consumed" if self._consumed else "pending"
        return f"<StagedTransaction {self._kind} {state}>"


def require_transaction(value: object) -> StagedTransaction:
    """Return ``value`` if it is a :class:`StagedTransaction` (``ContractTypeError`` otherwise)."""
    if type(value) is not StagedTransaction:
        raise ContractTypeError(f"expected a StagedTransaction, got {type(value).__name__}")
    return value


__all__.append("require_transaction")

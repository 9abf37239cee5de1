"""A generic registry of named kernel ops, filled by providers found through entry points.

An op id is ``"<namespace>.<name>/<signature version>"`` (for example
``"gefen.block_step/1"``). The package that owns an op (gefen-core for ``gefen.*``) defines
its signature and ships a reference implementation; a provider package implements some
op ids and says, per call, whether it supports the given arguments. Providers register
through the entry-point group ``gefen.kernels``; each entry point names a zero-argument
callable returning a :class:`KernelProvider` (or a provider object). A provider that fails
to load is recorded with its error instead of breaking import.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .errors import ContractError, ContractTypeError, KernelUnavailableError

__all__ = [
    "KERNEL_ENTRY_POINT_GROUP",
    "KernelProvider",
    "KernelRegistry",
    "ProviderLoadFailure",
    "default_kernel_registry",
    "parse_op_id",
]

KERNEL_ENTRY_POINT_GROUP = "gefen.kernels"
_OP_RE = re.compile(r"^([a-z0-9_]+(?:\.[a-z0-9_]+)+)/([1-9][0-9]*)$")


def parse_op_id(op_id: str) -> tuple[str, int]:
    """Split ``"ns.name/3"`` into ``("ns.name", 3)`` (``ContractError`` when malformed)."""
    if type(op_id) is not str:
        raise ContractTypeError(f"an op id must be a str, got {type(op_id).__name__}")
    match = _OP_RE.match(op_id)
    if match is None:
        raise ContractError(f"op id {op_id!r} must look like 'namespace.name/VERSION'")
    return match.group(1), int(match.group(2))


@runtime_checkable
class KernelProvider(Protocol):
    """A set of fast implementations of named ops.

    ``name`` identifies the provider in messages. ``op_ids()`` lists the op ids it
    implements. ``supports(op_id, *args, **kwargs)`` answers cheaply, without side effects,
    whether it can run those arguments (device, dtypes, contiguity...). ``implementation(op_id)``
    returns the callable, whose signature is the op owner's. A provider may also define
    ``explain(op_id, *args, **kwargs) -> str | None`` (why it declines, ``None`` when it
    supports them): :meth:`KernelRegistry.require` quotes it in its error.
    """

    @property
    def name(self) -> str: ...

    def op_ids(self) -> frozenset[str]: ...

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool: ...

    def implementation(self, op_id: str) -> Callable[..., Any]: ...


@dataclass(frozen=True, slots=True)
class ProviderLoadFailure:
    """An entry point that could not be loaded, with the reason."""

    entry_point: str
    error: str


class KernelRegistry:
    """Providers in priority order; looks up the first one that supports a call."""

    def __init__(self, providers: Iterable[KernelProvider] = ()) -> None:
        self._providers: list[KernelProvider] = []
        self._failures: list[ProviderLoadFailure] = []
        self._lock = threading.Lock()
        for provider in providers:
            self.register(provider)

    def register(self, provider: KernelProvider) -> None:
        """Add ``provider`` after the existing ones (its op ids are validated)."""
        if not isinstance(provider, KernelProvider):
            raise ContractTypeError(f"{type(provider).__name__} does not implement KernelProvider")
        for op_id in provider.op_ids():
            parse_op_id(op_id)
        with self._lock:
            if any(p is provider for p in self._providers):
                return
            self._providers.append(provider)

    def record_failure(self, failure: ProviderLoadFailure) -> None:
        with self._lock:
            self._failures.append(failure)

    @property
    def providers(self) -> tuple[KernelProvider, ...]:
        return tuple(self._providers)

    @property
    def failures(self) -> tuple[ProviderLoadFailure, ...]:
        return tuple(self._failures)

    def lookup(self, op_id: str, *args: Any, **kwargs: Any) -> Callable[..., Any] | None:
        """The first provider implementation that supports these arguments, else ``None``."""
        parse_op_id(op_id)
        for provider in self._providers:
            if op_id in provider.op_ids() and provider.supports(op_id, *args, **kwargs):
                return provider.implementation(op_id)
        return None

    def require(self, op_id: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """Like :meth:`lookup` but raise :class:`KernelUnavailableError` explaining why."""
        found = self.lookup(op_id, *args, **kwargs)
        if found is not None:
            return found
        offering = [p for p in self._providers if op_id in p.op_ids()]
        if offering:
            why = f"providers {[p.name for p in offering]} implement {op_id} but do not support these tensors"
            reasons = [f"{p.name}: {_explanation(p, op_id, args, kwargs)}" for p in offering]
            why += " (" + "; ".join(reasons) + ")"
        else:
            why = f"no registered provider implements {op_id}"
        if self._failures:
            why += "; providers that failed to load: " + "; ".join(
                f"{f.entry_point}: {f.error}" for f in self._failures
            )
        raise KernelUnavailableError(f"fused=True needs a kernel for {op_id}: {why}")


def _explanation(provider: KernelProvider, op_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The provider's own reason, from its optional ``explain(op_id, *args, **kwargs)``."""
    explain = getattr(provider, "explain", None)
    if not callable(explain):
        return "no reason given (the provider has no explain())"
    try:
        reason = explain(op_id, *args, **kwargs)
    except Exception as exc:
        return f"explain() raised {type(exc).__name__}: {exc}"
    return str(reason) if reason else "no reason given"


_DEFAULT: KernelRegistry | None = None
_DEFAULT_LOCK = threading.Lock()


def default_kernel_registry(*, reload: bool = False) -> KernelRegistry:
    """The process-wide registry, filled once from the ``gefen.kernels`` entry points."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or reload:
            _DEFAULT = _discover()
        return _DEFAULT


def _discover() -> KernelRegistry:
    from importlib.metadata import entry_points

    registry = KernelRegistry()
    for entry in sorted(entry_points(group=KERNEL_ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            target = entry.load()
            provider = target() if callable(target) and not isinstance(target, KernelProvider) else target
            registry.register(provider)
        except Exception as exc:  # a broken provider must not break the optimizer
            registry.record_failure(
                ProviderLoadFailure(f"{entry.name} = {entry.value}", f"{type(exc).__name__}: {exc}")
            )
    return registry

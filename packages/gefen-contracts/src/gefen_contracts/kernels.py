"""Kernel plugins: packages that register fast implementations of another package's torch ops.

An op owner (gefen-core for the ``gefen`` namespace) declares each op once with
``torch.library``: its schema, a reference implementation registered for
``CompositeExplicitAutograd`` (so every device has one) and a fake implementation for
tracing. A kernel package registers device implementations (``CPU``, ``CUDA``, ...) of the
same ops through ``torch.library`` too, and torch's dispatcher prefers them to the
reference. The owner finds kernel packages through the entry-point group ``gefen.kernels``:
each entry point names a zero-argument callable that registers what it can and returns a
mapping ``{device_type: reason}`` for the device types it knows but could not serve (empty
when it served them all), so the owner can say why a kernel is missing.

This module runs those callables once per process and keeps what they said. It imports only
the standard library; whether a kernel is registered is torch's to answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "KERNEL_ENTRY_POINT_GROUP",
    "KernelPluginReport",
    "kernel_unavailable_reasons",
    "load_kernel_plugins",
    "run_kernel_plugins",
]

KERNEL_ENTRY_POINT_GROUP = "gefen.kernels"


@dataclass(frozen=True, slots=True)
class KernelPluginReport:
    """What one kernel plugin said: the device types it could not serve and why, or the
    error that kept it from registering anything."""

    entry_point: str
    unavailable: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None

    def reason(self, device_type: str) -> str | None:
        """Why this plugin has no kernels for ``device_type`` (``None``: no reason recorded)."""
        return self.error if self.error is not None else self.unavailable.get(device_type)


def run_kernel_plugins(plugins: Iterable[tuple[str, Callable[[], object]]]) -> tuple[KernelPluginReport, ...]:
    """Call each ``(name, register)`` plugin; a plugin that raises or returns anything but a
    ``{str: str}`` mapping is reported with its error instead of breaking the caller."""
    reports = []
    for name, register in plugins:
        try:
            said = register()
        except Exception as exc:  # a broken plugin must not break the optimizer
            reports.append(KernelPluginReport(name, error=f"{type(exc).__name__}: {exc}"))
            continue
        if not isinstance(said, Mapping) or not all(type(k) is str and type(v) is str for k, v in said.items()):
            reports.append(
                KernelPluginReport(name, error=f"returned {type(said).__name__}, not a {{device_type: reason}} mapping")
            )
            continue
        reports.append(KernelPluginReport(name, dict(said)))
    return tuple(reports)


_REPORTS: tuple[KernelPluginReport, ...] | None = None
_LOCK = threading.Lock()


def load_kernel_plugins(*, reload: bool = False) -> tuple[KernelPluginReport, ...]:
    """Run every ``gefen.kernels`` entry point once per process (again with ``reload``)."""
    global _REPORTS
    with _LOCK:
        if _REPORTS is None or reload:
            from importlib.metadata import entry_points

            found = sorted(entry_points(group=KERNEL_ENTRY_POINT_GROUP), key=lambda e: e.name)
            _REPORTS = run_kernel_plugins((f"{e.name} = {e.value}", _loader(e)) for e in found)
        return _REPORTS


def _loader(entry: object) -> Callable[[], object]:
    def register() -> object:
        return entry.load()()  # type: ignore[attr-defined]

    return register


def kernel_unavailable_reasons(device_type: str) -> list[str]:
    """What the loaded plugins said about ``device_type``, one ``"plugin: reason"`` each."""
    reports = load_kernel_plugins()
    if not reports:
        return [f"no package registers kernels through the {KERNEL_ENTRY_POINT_GROUP!r} entry points"]
    return [f"{r.entry_point}: {r.reason(device_type) or 'registers none for this device'}" for r in reports]

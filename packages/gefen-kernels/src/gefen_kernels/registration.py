"""Registers this package's kernels as ``torch.library`` implementations of gefen-core's ops.

:func:`register` is the ``gefen.kernels`` entry point (:mod:`gefen_contracts.kernels`).
It registers the compiled C kernels (:mod:`gefen_kernels.cpu_ops`) for ``CPU`` when the CPU
library builds or loads from its cache, and the Triton kernels
(:mod:`gefen_kernels.triton_ops`) for ``CUDA`` when CUDA and Triton are present. It returns
``{device_type: reason}`` for the device types it could not serve. Called again, it first
withdraws what it registered, so a changed environment (a compiler removed, a cache reset)
is seen by the next load of the plugins.

The ops are gefen-core's (``gefen::<name>.v<N>``, :data:`gefen_kernels.signatures.GEFEN_OPS`);
this package never imports gefen-core. A kernel registered here checks its arguments before
it touches memory (:class:`~gefen_kernels.KernelArgumentError`).
"""

from __future__ import annotations

import threading
from types import ModuleType

import torch

from .signatures import GEFEN_OPS

__all__ = ["register", "registered_devices"]

_LOCK = threading.Lock()
_LIBRARIES: list[torch.library.Library] = []
_DEVICES: list[str] = []


def _cpu_backend() -> tuple[ModuleType | None, str | None]:
    from .cpu_build import cpu_kernel_status

    status = cpu_kernel_status()
    if not status.available:
        return None, f"the CPU kernel is unavailable: {status.reason}"
    from . import cpu_ops

    return cpu_ops, None


def _cuda_backend() -> tuple[ModuleType | None, str | None]:
    from .triton_support import triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason is not None:
        return None, reason
    from . import triton_ops

    return triton_ops, None


def register() -> dict[str, str]:
    """Register every kernel that can run here; return why the others cannot (by device type)."""
    with _LOCK:
        for library in _LIBRARIES:
            library._destroy()  # type: ignore[no-untyped-call]
        _LIBRARIES.clear()
        _DEVICES.clear()
        unavailable: dict[str, str] = {}
        for device, key, backend in (("cpu", "CPU", _cpu_backend), ("cuda", "CUDA", _cuda_backend)):
            module, reason = backend()
            if module is None:
                unavailable[device] = reason or "unavailable"
                continue
            library = torch.library.Library("gefen", "IMPL")  # type: ignore[no-untyped-call]
            for op in sorted(GEFEN_OPS):
                local = op.split("::")[1]
                library.impl(local, getattr(module, local.split(".")[0]), key)  # type: ignore[no-untyped-call]
            _LIBRARIES.append(library)
            _DEVICES.append(device)
        return unavailable


def registered_devices() -> tuple[str, ...]:
    """The device types whose kernels the last :func:`register` registered."""
    return tuple(_DEVICES)

"""Registers this package's kernels as ``torch.library`` implementations of gefen-core's ops.

:func:`register` is the ``gefen.kernels`` entry point (:mod:`gefen_contracts.kernels`).
It registers the compiled C kernels (:mod:`gefen_kernels.cpu_ops`) for ``CPU`` when the CPU
library builds or loads from its cache, and the Triton kernels
(:mod:`gefen_kernels.triton_ops`) for ``CUDA`` when CUDA and Triton are present. It returns
``{device_type: reason}`` for the device types it could not serve. Called again, it first
withdraws what it registered, so a changed environment (a compiler removed, a cache reset)
is seen by the next load of the plugins.

A Triton kernel launches on the *current* CUDA device, and torch's dispatcher sets no device
guard for a kernel registered from Python (its generated CUDA kernels get one). So each CUDA
kernel runs with its first tensor's device made current (:func:`on_its_device`); without it,
a model on ``cuda:1`` stepped while ``cuda:0`` is current launched on the wrong device.

The ops are gefen-core's (``gefen::<name>.v<N>``, :data:`gefen_kernels.signatures.GEFEN_OPS`);
this package never imports gefen-core. A kernel registered here checks its arguments before
it touches memory (:class:`~gefen_kernels.KernelArgumentError`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import torch

from .signatures import GEFEN_OPS, HOST_OPS

__all__ = ["device_guard", "on_its_device", "register", "registered_devices"]

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


def device_guard(device: torch.device) -> AbstractContextManager[Any]:
    """``device`` made current while the context is open when it is a CUDA device; nothing
    otherwise (the CPU, and the Triton interpreter's CPU tensors)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_its_device(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` run under :func:`device_guard` of its first tensor: the first argument, or
    the first entry of a list of tensors (an empty list has nothing to launch)."""

    @functools.wraps(kernel)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        if isinstance(first, list):
            first = first[0] if first else None
        if not isinstance(first, torch.Tensor):
            return kernel(*args, **kwargs)
        with device_guard(first.device):
            return kernel(*args, **kwargs)

    return guarded


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
            for op in sorted(GEFEN_OPS - HOST_OPS if key == "CUDA" else GEFEN_OPS):
                local = op.split("::")[1]
                kernel = getattr(module, local.split(".")[0])
                if key == "CUDA":
                    kernel = on_its_device(kernel)
                library.impl(local, kernel, key)  # type: ignore[no-untyped-call]
            _LIBRARIES.append(library)
            _DEVICES.append(device)
        return unavailable


def registered_devices() -> tuple[str, ...]:
    """The device types whose kernels the last :func:`register` registered."""
    return tuple(_DEVICES)

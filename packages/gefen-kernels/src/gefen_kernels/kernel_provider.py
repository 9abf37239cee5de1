"""The kernel provider registered under the ``gefen.kernels`` entry point.

:class:`GefenKernelProvider` implements gefen-core's named ops on two backends, chosen per
call by the device of the tensors: the compiled C kernel for CPU tensors
(:mod:`gefen_kernels.cpu_ops`) and Triton kernels for CUDA tensors
(:mod:`gefen_kernels.triton_ops`). ``supports`` answers from tensor metadata only; the
first CPU query builds (or loads from the cache) the CPU library, and the first CUDA query
imports Triton. ``explain`` says why a call is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import arguments
from .signatures import (
    BLOCK_STEP,
    FACTORED_MOMENTS,
    FACTORED_STATS,
    FACTORED_STEP,
    GEFEN_OPS,
    HISTOGRAM,
    MUON_MOMENTUM,
    STOCHASTIC_UNIFORM,
)

__all__ = ["GefenKernelProvider", "provider"]

_CHECKS: dict[str, Callable[..., str | None]] = {
    BLOCK_STEP: arguments.check_block_step,
    FACTORED_STEP: arguments.check_factored_step,
    FACTORED_STATS: arguments.check_factored_stats,
    FACTORED_MOMENTS: arguments.check_factored_moments,
    HISTOGRAM: arguments.check_histogram,
    STOCHASTIC_UNIFORM: arguments.check_stochastic_uniform,
    MUON_MOMENTUM: arguments.check_muon_momentum,
}
#: Which positional argument decides the device.
_DEVICE_ARG = {
    BLOCK_STEP: 0,
    FACTORED_STEP: 0,
    FACTORED_STATS: 0,
    FACTORED_MOMENTS: 0,
    HISTOGRAM: 0,
    STOCHASTIC_UNIFORM: 1,
    MUON_MOMENTUM: 0,
}
_FUNCTION_NAMES = {
    BLOCK_STEP: "block_step",
    FACTORED_STEP: "factored_step",
    FACTORED_STATS: "factored_stats",
    FACTORED_MOMENTS: "factored_moments",
    HISTOGRAM: "histogram",
    STOCHASTIC_UNIFORM: "stochastic_uniform",
    MUON_MOMENTUM: "muon_momentum",
}


def _cpu_backend() -> tuple[Any, str | None]:
    from .cpu_build import cpu_kernel_status

    status = cpu_kernel_status()
    if not status.available:
        return None, f"the CPU kernel is unavailable: {status.reason}"
    from . import cpu_ops

    return cpu_ops, None


def _cuda_backend() -> tuple[Any, str | None]:
    from .triton_support import triton_unavailable_reason

    reason = triton_unavailable_reason()
    if reason is not None:
        return None, reason
    from . import triton_ops

    return triton_ops, None


class GefenKernelProvider:
    """Fast implementations of Gefen's ops: C on CPU, Triton on CUDA (see the module docs)."""

    __slots__ = ("_backends", "_implementations")

    def __init__(self) -> None:
        self._backends: dict[str, tuple[Any, str | None]] = {}
        self._implementations: dict[str, Callable[..., Any]] = {}

    @property
    def name(self) -> str:
        return "gefen-kernels"

    def op_ids(self) -> frozenset[str]:
        return GEFEN_OPS

    def _backend(self, device: torch.device) -> tuple[Any, str | None]:
        found = self._backends.get(device.type)
        if found is None:
            if device.type == "cpu":
                found = _cpu_backend()
            elif device.type == "cuda":
                found = _cuda_backend()
            else:
                found = (None, f"no gefen-kernels backend for {device.type} tensors")
            self._backends[device.type] = found
        return found

    def explain(self, op_id: str, *args: Any, **kwargs: Any) -> str | None:
        """``None`` when this provider runs the call, else why not (metadata only; no device sync)."""
        check = _CHECKS.get(op_id)
        if check is None:
            return f"gefen-kernels does not implement {op_id}"
        reason = check(*args, **kwargs)
        if reason is not None:
            return reason
        device = args[_DEVICE_ARG[op_id]].device
        return self._backend(device)[1]

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
        return self.explain(op_id, *args, **kwargs) is None

    def implementation(self, op_id: str) -> Callable[..., Any]:
        """The op's callable; it runs on the backend of its tensors' device."""
        found = self._implementations.get(op_id)
        if found is not None:
            return found
        if op_id not in _CHECKS:
            raise KeyError(f"gefen-kernels does not implement {op_id}")
        function_name = _FUNCTION_NAMES[op_id]
        device_arg = _DEVICE_ARG[op_id]

        def run(*args: Any, **kwargs: Any) -> Any:
            backend, reason = self._backend(args[device_arg].device)
            if backend is None:
                raise arguments.KernelArgumentError(f"{op_id}: {reason}")
            return getattr(backend, function_name)(*args, **kwargs)

        run.__name__ = function_name
        run.__qualname__ = f"GefenKernelProvider.{function_name}"
        self._implementations[op_id] = run
        return run


_PROVIDER: GefenKernelProvider | None = None


def provider() -> GefenKernelProvider:
    """The process-wide provider (the ``gefen.kernels`` entry point; cheap: builds nothing)."""
    global _PROVIDER
    if _PROVIDER is None:
        _PROVIDER = GefenKernelProvider()
    return _PROVIDER

"""Fast implementations of gefen-core's named kernel ops (Triton on GPU, a compiled kernel on CPU).

``provider()`` is the ``gefen.kernels`` entry point; Gefen finds it through
``gefen_contracts.default_kernel_registry()``. ``cpu_kernel_status()`` says whether the CPU
kernel was built (or why not) and how long the build took.
"""

from __future__ import annotations

from ._version import __version__
from .arguments import KernelArgumentError
from .cpu_build import CpuKernelCacheWarning, CpuKernelStatus, CpuKernelUnavailableWarning, cpu_kernel_status
from .kernel_provider import GefenKernelProvider, provider

__all__ = [
    "CpuKernelStatus",
    "CpuKernelCacheWarning",
    "CpuKernelUnavailableWarning",
    "GefenKernelProvider",
    "KernelArgumentError",
    "__version__",
    "cpu_kernel_status",
    "provider",
]

"""Fast implementations of gefen-core's named kernel ops (Triton on GPU, a compiled kernel on CPU).

:func:`gefen_kernels.registration.register` is the ``gefen.kernels`` entry point: it registers
the kernels as ``torch.library`` implementations of gefen-core's ops (``CPU`` and ``CUDA``). ``cpu_kernel_status()`` says whether the CPU
kernel was built (or why not) and how long the build took.
"""

from __future__ import annotations

from ._version import __version__
from .arguments import KernelArgumentError
from .cpu_build import CpuKernelCacheWarning, CpuKernelStatus, CpuKernelUnavailableWarning, cpu_kernel_status
from .registration import register, registered_devices

__all__ = [
    "CpuKernelStatus",
    "CpuKernelCacheWarning",
    "CpuKernelUnavailableWarning",
    "KernelArgumentError",
    "__version__",
    "cpu_kernel_status",
    "register",
    "registered_devices",
]

"""Where a benchmark ran: machine facts and library versions for the report header."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

__all__ = ["DEFAULT_LIBRARIES", "VECTOR_FLAGS", "library_versions", "machine_info"]

#: Distributions whose versions every report records (``None`` when not installed).
DEFAULT_LIBRARIES = (
    "gefen",
    "gefen-contracts",
    "gefen-core",
    "gefen-kernels",
    "torch",
    "numpy",
    "torchao",
)


def _total_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The CPU features that decide the kernels' speed (two CPUs of one model name may differ).
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "asimd", "sve")


def _cpu_vector_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in VECTOR_FLAGS if flag in present]
    except OSError:
        pass
    return []


def machine_info() -> dict[str, Any]:
    """CPU (model and vector features), memory, OS, Python and (when torch is importable)
    thread count and accelerator."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_vector_flags": _cpu_vector_flags(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _total_memory_bytes(),
    }
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of the meta-package
        return info
    info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        info["accelerator"] = f"cuda:{torch.cuda.get_device_name(0)}"
    else:
        info["accelerator"] = "cpu"
    return info


def library_versions(names: tuple[str, ...] = DEFAULT_LIBRARIES) -> dict[str, Any]:
    """Installed version of each distribution in ``names`` (``None`` if not installed)."""
    versions: dict[str, Any] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions

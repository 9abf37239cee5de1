"""Whether the Triton backend can run here (CUDA and an importable Triton)."""

from __future__ import annotations

import os

import torch

__all__ = ["interpreting", "triton_unavailable_reason"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_unavailable_reason() -> str | None:
    """``None`` when Triton kernels can run on CUDA tensors, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc}); install gefen-kernels[triton]"
    return None

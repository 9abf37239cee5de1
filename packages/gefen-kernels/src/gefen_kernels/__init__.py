"""Fast implementations of gefen-core's named kernel ops (Triton on GPU, a compiled kernel on CPU)."""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]

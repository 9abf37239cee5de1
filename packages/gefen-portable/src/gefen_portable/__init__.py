"""Optimizer-agnostic, topology-neutral portable optimizer state."""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]

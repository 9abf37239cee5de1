"""Gefen and GefenMuon: the ~1 byte/param quantized optimizers (reference implementation)."""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]

"""A composite optimizer over two contracted children, and ContractedAdamW."""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]

"""gefen: memory-efficient optimizers for PyTorch and the convention that makes them shardable.

The meta-package wires the workspace packages together and re-exports their public API.
The convention's vocabulary is available as ``gefen.contracts`` (``gefen_contracts``).
"""

from __future__ import annotations

import gefen_contracts as contracts

from ._version import __version__

__all__ = ["__version__", "contracts"]

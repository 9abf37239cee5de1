"""PyTorch Distributed Checkpoint persistence and FSDP2 N->M resharding for contracted optimizers."""

from __future__ import annotations

from ._version import __version__

__all__ = ["__version__"]

"""gefen-dcp: PyTorch Distributed Checkpoint persistence for optimizers that keep the Gefen
convention.

* :class:`GefenDCPState` saves any :class:`gefen_contracts.DenseShardCodec` optimizer beside
  its FSDP2 model in one ``dcp.save`` / ``dcp.load`` and reshards it N -> M;
  :class:`GefenSavePlanner` keeps the save memory-bounded, :class:`GefenLoadPlanner` loads
  and verifies it, and :class:`GefenFileSystemWriter` streams, survives crashes and makes
  ``dcp.async_save`` hold the state at the call.
"""

from __future__ import annotations

from ._version import __version__
from .digest_table import DIGEST_TABLE_FORMAT, DIGEST_TABLE_FORMAT_VERSION
from .envelope import DENSE_SHARD_FORMAT, DENSE_SHARD_FORMAT_VERSION
from .errors import (
    CheckpointIntegrityError,
    CheckpointLayoutError,
    DenseFieldError,
    DenseShardCheckpointError,
    EnvelopeFormatError,
    PlannerRequiredError,
)
from .field_source import DenseFieldRows, DenseFieldSource, DenseShardSnapshot
from .planners import GefenLoadPlanner, GefenSavePlanner
from .state import GefenDCPState
from .writer import GefenFileSystemWriter

__all__ = [
    "DENSE_SHARD_FORMAT",
    "DENSE_SHARD_FORMAT_VERSION",
    "DIGEST_TABLE_FORMAT",
    "DIGEST_TABLE_FORMAT_VERSION",
    "CheckpointIntegrityError",
    "CheckpointLayoutError",
    "DenseFieldError",
    "DenseFieldRows",
    "DenseFieldSource",
    "DenseShardCheckpointError",
    "DenseShardSnapshot",
    "EnvelopeFormatError",
    "GefenDCPState",
    "GefenFileSystemWriter",
    "GefenLoadPlanner",
    "GefenSavePlanner",
    "PlannerRequiredError",
    "__version__",
]

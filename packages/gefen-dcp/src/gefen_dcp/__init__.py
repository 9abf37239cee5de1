"""gefen-dcp: PyTorch Distributed Checkpoint persistence for optimizers that keep the Gefen
convention.

* :func:`save_portable_dcp` / :func:`load_portable_dcp` (and :func:`async_save_portable_dcp`)
  persist any :class:`gefen_contracts.protocols.PortableAdapter` optimizer's portable state
  rank-sharded: each member writes its own fragments with chunk digests under one catalog
  root digest, and reads back only the fragments its target layout needs.

* :class:`GefenDCPState` saves any :class:`gefen_contracts.protocols.ParameterShapedState` optimizer's
  own compact state beside its FSDP2 model in one ``dcp.save`` / ``dcp.load`` and reshards
  it N -> M bit for bit; :class:`GefenSavePlanner` digests every chunk it writes,
  :class:`GefenLoadPlanner` loads and verifies it into a fresh optimizer, and
  :class:`GefenFileSystemWriter` streams, survives crashes and makes ``dcp.async_save``
  hold the state at the call; :class:`GefenFileSystemReader` reads ``.metadata`` without
  executing it, in bounded memory.
"""

from __future__ import annotations

from ._version import __version__
from .digest_table import DIGEST_TABLE_FORMAT, DIGEST_TABLE_FORMAT_VERSION
from .envelope import DCP_STATE_FORMAT, DCP_STATE_FORMAT_VERSION
from .errors import (
    CheckpointIntegrityError,
    CheckpointLayoutError,
    EnvelopeFormatError,
    GefenCheckpointError,
    MetadataFormatError,
    PlannerRequiredError,
    StateTensorError,
    StorageMismatchError,
)
from .metadata_reader import DEFAULT_MAX_METADATA_BYTES, GefenFileSystemReader, read_dcp_metadata
from .planners import GefenLoadPlanner, GefenSavePlanner
from .portable_format import (
    CHUNK_TABLE_FORMAT,
    CHUNK_TABLE_FORMAT_VERSION,
    PORTABLE_DCP_FORMAT,
    PORTABLE_DCP_FORMAT_VERSION,
)
from .portable_load import load_portable_dcp
from .portable_save import async_save_portable_dcp, save_portable_dcp
from .skeleton import parameter_index
from .state import GefenDCPState
from .writer import GefenFileSystemWriter

__all__ = [
    "CHUNK_TABLE_FORMAT",
    "CHUNK_TABLE_FORMAT_VERSION",
    "DCP_STATE_FORMAT",
    "DEFAULT_MAX_METADATA_BYTES",
    "DCP_STATE_FORMAT_VERSION",
    "DIGEST_TABLE_FORMAT",
    "DIGEST_TABLE_FORMAT_VERSION",
    "PORTABLE_DCP_FORMAT",
    "PORTABLE_DCP_FORMAT_VERSION",
    "CheckpointIntegrityError",
    "CheckpointLayoutError",
    "EnvelopeFormatError",
    "GefenCheckpointError",
    "GefenDCPState",
    "GefenFileSystemReader",
    "GefenFileSystemWriter",
    "GefenLoadPlanner",
    "GefenSavePlanner",
    "MetadataFormatError",
    "PlannerRequiredError",
    "StateTensorError",
    "StorageMismatchError",
    "__version__",
    "async_save_portable_dcp",
    "load_portable_dcp",
    "parameter_index",
    "read_dcp_metadata",
    "save_portable_dcp",
]

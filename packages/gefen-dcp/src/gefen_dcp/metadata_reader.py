"""Reading a DCP checkpoint's ``.metadata`` without executing it, in bounded memory.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain :mod:`pickle`:
a crafted file runs code, and one flipped bit in a memo index makes the C unpickler grow
its memo array by gigabytes before it fails. :func:`read_dcp_metadata` reads it in three
gates, each of which raises :class:`~gefen_dcp.MetadataFormatError` before anything is
built:

1. **size**: the file is at most ``max_bytes`` long (read once, never streamed, so every
   length in the pickle is bounded by the file);
2. **shape**: one pass of :func:`pickletools.genops` over the bytes checks that every
   opcode's argument is present, that memo writes are sequential (``PUT n`` only for
   ``n <= len(memo)``) and memo reads name an existing entry, so the memo holds at most one
   entry per opcode;
3. **classes**: the unpickler resolves only DCP's metadata classes, ``torch.Size``, torch
   dtypes and layouts, the enum DCP uses for memory formats and :mod:`pathlib` paths; any
   other global (``os.system``, ``builtins.eval``, ...) is refused by name.

:class:`GefenFileSystemReader` is ``FileSystemReader`` with that ``read_metadata``; pass it
as ``storage_reader`` to ``dcp.load`` (and :func:`~gefen_dcp.load_portable_dcp`).
``gefen inspect`` reads metadata the same way.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import pickletools
from typing import IO, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import MetadataFormatError

__all__ = ["BUFFERED_ITEM_BYTES", "DEFAULT_MAX_METADATA_BYTES", "GefenFileSystemReader", "read_dcp_metadata"]

#: The largest ``.metadata`` read by default: about a million stored chunks.
DEFAULT_MAX_METADATA_BYTES = 256 * 1024 * 1024
#: Data items up to this size are read into memory whole before torch unpickles them
#: (:class:`GefenFileSystemReader`); larger ones are read through torch's file view.
BUFFERED_ITEM_BYTES = 1 << 20

_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "ChunkStorageMetadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in _METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    # Maps a layout's name ("torch.strided") to the layout; unknown names raise KeyError.
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{
        ("pathlib", name): getattr(pathlib, name)
        for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
    },
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
_MEMO_WRITES = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_READS = frozenset({"GET", "BINGET", "LONG_BINGET"})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise MetadataFormatError(
                f".metadata names {module}.{name}, which is not one of DCP's metadata classes; refused unread"
            )
        return found


def _check_shape(data: bytes, where: str) -> None:
    memo = 0
    try:
        for opcode, argument, position in pickletools.genops(data):
            name = opcode.name
            if name == "MEMOIZE":
                memo += 1
            elif name in _MEMO_WRITES:
                if not isinstance(argument, int) or not 0 <= argument <= memo:
                    raise MetadataFormatError(f"{where}: memo write {argument!r} at byte {position} skips entries")
                memo = max(memo, argument + 1)
            elif name in _MEMO_READS and (not isinstance(argument, int) or not 0 <= argument < memo):
                raise MetadataFormatError(f"{where}: memo read {argument!r} at byte {position} names no entry")
    except MetadataFormatError:
        raise
    except Exception as error:  # pickletools raises ValueError on truncated or unknown opcodes
        raise MetadataFormatError(f"{where} is not a well-formed pickle: {error}") from None


def read_dcp_metadata(
    source: str | os.PathLike[str] | bytes, *, max_bytes: int = DEFAULT_MAX_METADATA_BYTES
) -> Metadata:
    """DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` from a ``.metadata``
    file, a checkpoint folder (its ``.metadata``, as ``GefenFileSystemReader`` takes it) or the
    file's bytes, read through the three gates of the module docstring.

    Raises :class:`~gefen_dcp.MetadataFormatError` for a file over ``max_bytes``, a
    malformed pickle, a class outside the allow-list, or a result that is not ``Metadata``.
    """
    if type(max_bytes) is not int or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    if isinstance(source, bytes):
        where = ".metadata"
        if len(source) > max_bytes:
            raise MetadataFormatError(f"{where} holds {len(source)} bytes, over the {max_bytes}-byte limit")
        data = source
    else:
        where = os.fspath(source)
        if os.path.isdir(where):
            where = os.path.join(where, ".metadata")
        with open(where, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size > max_bytes:
                raise MetadataFormatError(f"{where} holds {size} bytes, over the {max_bytes}-byte limit")
            data = stream.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise MetadataFormatError(f"{where} grew past the {max_bytes}-byte limit while it was read")
    _check_shape(data, where)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except MetadataFormatError:
        raise
    except Exception as error:
        raise MetadataFormatError(f"{where} could not be unpickled as DCP metadata: {error!r}") from None
    if type(metadata) is not Metadata:
        raise MetadataFormatError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class GefenFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` executes nothing and is bounded in memory.

    Everything else is torch's reader (data files are read with ``weights_only=True``
    there), except that an item of at most :data:`BUFFERED_ITEM_BYTES` is read into memory
    in one call before torch unpickles it: through torch's file view each of its few hundred
    small reads is a Python call, about 0.2 ms an item, which on a state of a few hundred small
    items was about a sixth of the load. ``max_metadata_bytes`` bounds the ``.metadata`` file (and
    so the memory its unpickling takes).
    """

    def __init__(self, path: str | os.PathLike[str], *, max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES) -> None:
        super().__init__(path)
        self.max_metadata_bytes = max_metadata_bytes

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        if sinfo.length > BUFFERED_ITEM_BYTES:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        return io.BytesIO(file.read(sinfo.length))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = read_dcp_metadata(os.fspath(path), max_bytes=self.max_metadata_bytes)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

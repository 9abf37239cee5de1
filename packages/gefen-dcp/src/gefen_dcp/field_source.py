"""Where dense field values come from while a checkpoint is written.

A :class:`gefen_contracts.DenseShardCodec` produces a dense fp32 field of one local shard
on demand (``materialize_dense_field``). Two optional Protocols of gefen-contracts, found
structurally, let gefen-dcp keep its memory bounds for optimizers whose dense form is much larger than their compact state:

* :class:`DenseFieldRows` ``materialize_dense_field_rows(fqn, field, start, stop)`` returns
  rows ``[start, stop)`` of the local shard (the first dimension), so one huge embedding
  is written chunk by chunk instead of materialised whole;
* :class:`DenseShardSnapshot` ``dense_shard_snapshot()`` returns a frozen
  :class:`DenseFieldSource` (typically a copy of the compact state), which is what an
  asynchronous save keeps while training continues. Without it, the snapshot holds every
  dense field (4 bytes per element per field).

:class:`FieldReader` validates what a source returns (exact tensor, fp32, the requested
shape, finite) and hands back owned, contiguous CPU tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from gefen_contracts import DenseFieldRows, DenseShardSnapshot

from .errors import DenseFieldError
from .geometry import RowChunk

__all__ = [
    "DenseFieldRows",
    "DenseFieldSource",
    "DenseShardSnapshot",
    "DenseSnapshotSource",
    "FieldReader",
]


@runtime_checkable
class DenseFieldSource(Protocol):
    """Produces a fresh fp32 tensor shaped like ``fqn``'s local shard for ``field``."""

    def materialize_dense_field(self, fqn: str, field: str) -> Any: ...


class DenseSnapshotSource:
    """A frozen source holding dense CPU fields (the fallback snapshot)."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Mapping[tuple[str, str], torch.Tensor]) -> None:
        self._fields = dict(fields)

    def materialize_dense_field(self, fqn: str, field: str) -> torch.Tensor:
        return self._fields[(fqn, field)]

    def materialize_dense_field_rows(self, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
        return self._fields[(fqn, field)][start:stop]


def _owned_cpu(value: object, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if type(value) is not torch.Tensor:
        raise DenseFieldError(f"{where} must be a plain torch.Tensor, got {type(value).__name__}")
    tensor: torch.Tensor = value
    if tensor.dtype is not torch.float32:
        raise DenseFieldError(f"{where} must be float32, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise DenseFieldError(f"{where} must have shape {shape}, got {tuple(tensor.shape)}")
    if tensor.layout is not torch.strided or tensor.is_meta:
        raise DenseFieldError(f"{where} must be a materialised strided tensor")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.contiguous()
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # a view would make the writer serialise its whole storage
    if not _all_finite(tensor):
        raise DenseFieldError(f"{where} holds non-finite values")
    return tensor


#: Elements per ``isfinite`` call, so the check's scratch stays at 64 KiB whatever the chunk size
#: (one call over a whole chunk allocates a quarter of the chunk plus the reduction's buffers).
_FINITE_SLICE = 1 << 16


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, checked slice by slice (bounded scratch)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + _FINITE_SLICE]).all()) for i in range(0, flat.numel(), _FINITE_SLICE))


class FieldReader:
    """Reads validated row chunks of dense fields from one source.

    With a :class:`DenseFieldRows` source only the chunk's rows are materialised.
    Otherwise the whole field is materialised once and kept until a different field is
    read (chunks of one field are written consecutively), so the transient is one field.
    Thread-safe: materialisation is serialised, which also bounds live chunks when DCP
    writes with several threads.
    """

    def __init__(self, source: DenseFieldSource, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.source = source
        self._shapes = dict(shapes)
        self._rows = isinstance(source, DenseFieldRows)
        self._lock = threading.Lock()
        self._cached: tuple[tuple[str, str], torch.Tensor] | None = None

    def whole(self, fqn: str, field: str) -> torch.Tensor:
        """The whole local field as an owned CPU fp32 tensor."""
        with self._lock:
            value = self.source.materialize_dense_field(fqn, field)
            return _owned_cpu(value, self._shapes[fqn], f"materialize_dense_field({fqn!r}, {field!r})")

    def chunk(self, fqn: str, field: str, chunk: RowChunk) -> torch.Tensor:
        """Rows ``chunk.start:chunk.stop`` of the local field (the whole field for 0-d)."""
        shape = self._shapes[fqn]
        if not shape:
            return self.whole(fqn, field)
        with self._lock:
            if self._rows:
                value = self.source.materialize_dense_field_rows(fqn, field, chunk.start, chunk.stop)  # type: ignore[attr-defined]
                where = f"materialize_dense_field_rows({fqn!r}, {field!r}, {chunk.start}, {chunk.stop})"
                return _owned_cpu(value, (chunk.stop - chunk.start, *shape[1:]), where)
            key = (fqn, field)
            if self._cached is None or self._cached[0] != key:
                self._cached = None  # drop the previous field before materialising the next
                value = self.source.materialize_dense_field(fqn, field)
                self._cached = (key, _owned_cpu(value, shape, f"materialize_dense_field({fqn!r}, {field!r})"))
            return self._cached[1][chunk.start : chunk.stop].clone()  # tight storage for the writer

    def release(self) -> None:
        """Drop the cached field (call when a write is done)."""
        with self._lock:
            self._cached = None

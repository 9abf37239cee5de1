"""The save side of one ``GefenDCPState.state_dict()`` result.

A :class:`SaveSession` holds the agreed envelope, the optimizer's parameters in torch's
state-dict numbering (and which of them it keeps whole state for, ``held_whole``: what a load
onto this optimizer reads whole), its state tensors (by key,
as the optimizer holds them: DTensors placed like their parameters, or plain tensors),
each tensor's local chunk, and the chunk digests computed while the writer consumes the
chunks. DCP plans the tensors with its own machinery; :class:`~gefen_dcp.GefenSavePlanner`
hands every chunk it writes to :meth:`SaveSession.record` on its way to the writer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import dtensor_from_local

from .digest_table import ChunkKey, ChunkRecord, DigestTable, chunk_digest, encode_digest_table
from .envelope import DcpStateEnvelope, encode_envelope
from .errors import CheckpointLayoutError, StateTensorError
from .geometry import is_dtensor, local_tensor, shard_geometry

__all__ = ["SaveSession", "frozen_copy"]


def frozen_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An owned CPU copy of a state tensor, a DTensor kept a DTensor on the same mesh."""
    if is_dtensor(tensor):
        # contiguous, as dtensor_from_local's global strides say
        local = tensor.to_local().detach().to("cpu", copy=True, memory_format=torch.contiguous_format)  # type: ignore[attr-defined]
        return dtensor_from_local(local, tensor.device_mesh, tensor.placements, tensor.shape)  # type: ignore[attr-defined]
    return tensor.detach().to("cpu", copy=True)


class SaveSession:
    """Planning and writing state for one DCP state dict (see the module docstring)."""

    def __init__(
        self,
        *,
        envelope: DcpStateEnvelope,
        tensors: dict[str, torch.Tensor],
        parameters: tuple[Any, ...],
        writer: int,
        limits: PortableStateLimits,
        frozen: bool = False,
        held_whole: frozenset[int] = frozenset(),
    ) -> None:
        self.envelope = envelope
        self.held_whole = held_whole
        self.envelope_bytes = encode_envelope(envelope, limits=limits)
        self.tensors = tensors
        self.parameters = parameters
        self.writer = writer
        self.limits = limits
        self.frozen = frozen
        self._chunks: dict[ChunkKey, tuple[int, ...]] = {}
        for key, tensor in sorted(tensors.items()):
            geometry = shard_geometry(tensor, where=f"state tensor {key!r}")
            self._chunks[(key, geometry.offsets)] = geometry.sizes
        if len(self._chunks) > limits.max_tensors:
            raise CheckpointLayoutError(f"the optimizer state has more than max_tensors={limits.max_tensors} tensors")
        self._lock = threading.Lock()
        self._digests: dict[ChunkKey, str] = {}
        self._written: frozenset[ChunkKey] = frozenset()
        self._bound = False
        self._snapshot: SaveSession | None = None
        self._snapshot_lock = threading.Lock()

    # -- planning --------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self._bound

    def bind(self) -> None:
        """Called by :class:`~gefen_dcp.GefenSavePlanner` before DCP plans this session."""
        self._bound = True

    def mark_written(self, keys: Iterable[ChunkKey]) -> None:
        """The chunks this rank writes after DCP's de-duplication (known when the plan is final)."""
        written = frozenset(keys)
        unknown = sorted(written - set(self._chunks))
        if unknown:
            raise CheckpointLayoutError(f"DCP planned writes of chunks this rank does not hold: {unknown[:3]}")
        self._written = written

    def _table(self, *, digests: dict[ChunkKey, str]) -> DigestTable:
        records = tuple(
            ChunkRecord(key[0], key[1], sizes, key in self._written, digests.get(key, "0" * 64))
            for key, sizes in sorted(self._chunks.items())
        )
        return DigestTable(self.writer, self.envelope.save_id, records)

    def table_nbytes(self) -> int:
        """The digest table's planned size (independent of which chunks end up written)."""
        return len(encode_digest_table(self._table(digests={}), limits=self.limits))

    # -- writing ---------------------------------------------------------------------

    def record(self, key: str, offsets: tuple[int, ...], chunk: torch.Tensor) -> torch.Tensor:
        """Digest one chunk on its way to the writer; returns it on the CPU (a copy only if it was elsewhere)."""
        if (key, offsets) not in self._chunks:
            raise CheckpointLayoutError(f"no local chunk of {key!r} at offsets {offsets}")
        data = chunk.detach()
        if data.device.type != "cpu":
            data = data.to("cpu")
        digest = chunk_digest(data)
        with self._lock:
            previous = self._digests.setdefault((key, offsets), digest)
        if previous != digest:
            raise StateTensorError(
                f"state tensor {key!r} at {offsets} changed while it was being saved; do not step during a "
                f"synchronous save (dcp.async_save with GefenFileSystemWriter saves a snapshot taken at the call)"
            )
        return data

    def table_bytes(self) -> bytes:
        """The digest table, digesting written chunks the writer has not resolved yet (a
        writer that does not write the table last, such as DCP's stock one)."""
        with self._lock:
            missing = sorted(self._written - set(self._digests))
        for key, offsets in missing:
            self.record(key, offsets, local_tensor(self.tensors[key]))
        with self._lock:
            digests = dict(self._digests)
        data = encode_digest_table(self._table(digests=digests), limits=self.limits)
        if len(data) != self.table_nbytes():  # pragma: no cover - fixed-width encoding
            raise AssertionError("digest table size changed between planning and writing")
        return data

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self) -> SaveSession:
        """A session over owned CPU copies of the state tensors, taken once per session.

        Repeated calls (several entries of one state dict being copied) share it.
        """
        if self.frozen:
            return self
        with self._snapshot_lock:
            if self._snapshot is None:
                self._snapshot = SaveSession(
                    envelope=self.envelope,
                    tensors={key: frozen_copy(tensor) for key, tensor in self.tensors.items()},
                    parameters=self.parameters,
                    writer=self.writer,
                    limits=self.limits,
                    frozen=True,
                    held_whole=self.held_whole,
                )
            return self._snapshot

    def placement_of(self, key: str) -> str:
        return self.envelope.tensors[key].placement

    def tensor_tree(self) -> dict[str, dict[str, Any]]:
        """``{placement: {key: tensor}}``, what DCP plans and writes."""
        tree: dict[str, dict[str, Any]] = {}
        for key, tensor in sorted(self.tensors.items()):
            tree.setdefault(self.placement_of(key), {})[key] = tensor
        return tree

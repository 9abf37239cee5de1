"""``save_portable_dcp`` and ``async_save_portable_dcp``: rank-sharded portable checkpoints.

Every member exports its share of the optimizer's portable state
(:func:`gefen_portable.export_portable_state`: the agreed catalog plus the fragments this
member was assigned; no dense data moves between members) and writes, through one DCP save:

==========================================  ==================================================
DCP key (namespace ``ns``)                  content
==========================================  ==================================================
``ns.envelope``                             ``gefen.portable_dcp`` v1 (identical everywhere)
``ns.catalog.wire``                         the catalog record's wire metadata (``uint8``)
``ns.catalog.tensors.tNNNNNN``              the catalog's payload tensors, in wire order
``ns.writers.writer_NNNNN``                 this member's chunk table (``gefen.portable_dcp_chunks``)
``ns.fragments.<fqn>.<index>.<field>``      a fragment's field (any wire dtype: Gefen's
                                            uint8 codes, fp32 block scales), flattened to
                                            1-D, as ``SHARD`` chunks of at most
                                            ``chunk_bytes``
==========================================  ==================================================

So each member writes only its own fragments, and holds at most its local dense state plus
one chunk being serialised (with :class:`~gefen_dcp.GefenFileSystemWriter`).
"""

from __future__ import annotations

from typing import Any

import torch
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.protocols import Composite, PortableAdapter
from gefen_contracts.torch_support import ProcessGroupBinding, failure_vote
from gefen_portable import PortableState, encode_wire, export_portable_composite_state, export_portable_state
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter

from .digest_table import chunk_digest
from .portable_format import (
    ChunkTable,
    CompositeEnvelope,
    FragmentChunk,
    PortableEnvelope,
    encode_chunk_table,
    encode_composite_envelope,
    encode_portable_envelope,
    field_name,
)
from .standins import writer_key
from .storage_identity import preflight, require_binding

__all__ = ["async_save_portable_dcp", "save_portable_dcp"]


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ChunkedField:
    """One fragment field (a flat tensor this member owns) written as 1-D ``SHARD`` chunks.

    Deep copies return the object itself: it holds an exported snapshot nobody mutates, so
    DCP's async staging need not copy it again.
    """

    __slots__ = ("chunks", "flat")

    def __init__(self, flat: torch.Tensor, chunks: tuple[tuple[int, int], ...]) -> None:
        self.flat = flat
        self.chunks = chunks

    def __create_write_items__(self, key: str, obj: object) -> list[WriteItem]:
        size = torch.Size([self.flat.numel()])
        return [
            WriteItem(
                index=MetadataIndex(key, torch.Size([start])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([start]), sizes=torch.Size([length])),
                    properties=TensorProperties(dtype=self.flat.dtype),
                    size=size,
                ),
            )
            for start, length in self.chunks
        ]

    def resolve(self, item: WriteItem) -> torch.Tensor:
        start = int((item.index.offset or (0,))[0])
        for first, length in self.chunks:
            if first == start:
                return self.flat[first : first + length]
        raise KeyError(f"no chunk of {item.index.fqn} starts at {start}")

    def __deepcopy__(self, memo: dict[int, Any]) -> ChunkedField:
        return self


class _PortableSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` that writes :class:`ChunkedField` entries chunk by chunk."""

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        self._chunked = {k: v for k, v in self.state_dict.items() if isinstance(v, ChunkedField)}

    def resolve_data(self, write_item: WriteItem) -> Any:
        chunked = self._chunked.get(write_item.index.fqn)
        return super().resolve_data(write_item) if chunked is None else chunked.resolve(write_item)


def _chunk_ranges(numel: int, chunk_elements: int) -> tuple[tuple[int, int], ...]:
    if numel == 0:
        return ((0, 0),)
    return tuple((start, min(chunk_elements, numel - start)) for start in range(0, numel, chunk_elements))


def build_state_dict(
    state: PortableState, binding: ProcessGroupBinding, *, namespace: str, limits: PortableStateLimits
) -> dict[str, Any]:
    """This member's DCP state dict for ``state`` (see the module docstring)."""
    catalog = state.catalog_record()
    payload = encode_wire(catalog, limits=limits.collective())
    fragments: dict[str, dict[str, dict[str, ChunkedField]]] = {}
    records = []
    for fragment in state.fragments:
        for name, tensor in sorted(fragment.fields.items()):
            # the rule a load applies: a dotted field would flatten to another fragment's DCP key
            field_name(name, f"{fragment.fqn!r} fragment {fragment.index} field")
            flat = tensor.detach().reshape(-1)
            ranges = _chunk_ranges(flat.numel(), max(1, limits.chunk_bytes // flat.element_size()))
            for start, length in ranges:
                records.append(
                    FragmentChunk(
                        fragment.fqn, fragment.index, name, start, length, chunk_digest(flat[start : start + length])
                    )
                )
            fragments.setdefault(fragment.fqn, {}).setdefault(str(fragment.index), {})[name] = ChunkedField(
                flat, ranges
            )
    writer = binding.coordinate
    envelope = PortableEnvelope(
        namespace, state.catalog_digest, payload.digest, len(payload.tensors), binding.member_count, limits.chunk_bytes
    )
    table = ChunkTable(state.catalog_digest, writer, tuple(records))
    return {
        "envelope": _bytes_tensor(encode_portable_envelope(envelope, limits=limits)),
        "catalog": {
            "wire": _bytes_tensor(payload.metadata),
            "tensors": {f"t{index:06d}": tensor for index, tensor in enumerate(payload.tensors)},
        },
        "writers": {writer_key(writer): _bytes_tensor(encode_chunk_table(table, limits=limits))},
        "fragments": fragments,
    }


def _export(
    optimizer: Any,
    binding: ProcessGroupBinding,
    storage_writer: object,
    transaction_id: str,
    limits: PortableStateLimits,
    namespace: str,
) -> dict[str, Any]:
    preflight(
        binding,
        direction="save",
        namespace=namespace,
        storage=storage_writer,
        transaction_id=transaction_id,
        limits=limits,
    )
    error: BaseException | None = None
    local: dict[str, Any] = {}
    if is_composite(optimizer):
        composite = export_portable_composite_state(
            optimizer, checkpoint_process_group=binding, transaction_id=transaction_id, limits=limits
        )
        try:
            children = composite.children
            envelope = CompositeEnvelope(
                namespace,
                composite.implementation,
                composite.roles,
                tuple(sorted(composite.routing.items())),
                tuple((role, children[role].catalog_digest) for role in composite.roles),
                composite.digest,
            )
            local = {
                "composite": _bytes_tensor(encode_composite_envelope(envelope, limits=limits)),
                "roles": {
                    role: build_state_dict(children[role], binding, namespace=namespace, limits=limits)
                    for role in composite.roles
                },
            }
        except Exception as exc:
            error = exc
    else:
        state = export_portable_state(
            optimizer, checkpoint_process_group=binding, transaction_id=transaction_id, limits=limits
        )
        try:
            local = build_state_dict(state, binding, namespace=namespace, limits=limits)
        except Exception as exc:
            error = exc
    failure_vote(binding, "gefen_dcp.portable_save.encode", error)
    return {namespace: local}


def is_composite(optimizer: object) -> bool:
    """A composite optimizer whose children (not itself) are portable adapters."""
    return isinstance(optimizer, Composite) and not isinstance(optimizer, PortableAdapter)


def _dcp_group(binding: ProcessGroupBinding) -> dict[str, Any]:
    if binding.communicates:
        return {"process_group": binding.process_group}
    return {"no_dist": True}


def save_portable_dcp(
    optimizer: Any,
    *,
    checkpoint_process_group: ProcessGroupBinding,
    storage_writer: StorageWriter,
    transaction_id: str,
    limits: PortableStateLimits,
    namespace: str = "optimizer",
) -> Metadata:
    """Save ``optimizer``'s portable state rank-sharded with DCP; returns DCP's ``Metadata``.

    Collective over ``checkpoint_process_group`` (a
    :class:`~gefen_contracts.torch_support.CheckpointProcessGroupBinding` matching the
    optimizer's layout; a one-member binding runs DCP in single-process mode). A
    :class:`gefen_contracts.protocols.Composite` of portable children is saved child by child
    (:func:`gefen_portable.export_portable_composite_state`) under ``ns.roles.<role>`` with a
    composite envelope at ``ns.composite``. Every member
    first agrees on the namespace, storage class and location, transaction and limits
    (:class:`~gefen_dcp.StorageMismatchError` on every member otherwise, before any I/O), then
    exports (:func:`gefen_portable.export_portable_state`) and writes only its own fragments.
    The optimizer is never changed. With :class:`~gefen_dcp.GefenFileSystemWriter` the
    previous checkpoint at the same location survives a failure at any point.
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    binding = require_binding(checkpoint_process_group)
    state_dict = _export(optimizer, binding, storage_writer, transaction_id, limits, namespace)
    metadata: Metadata = save(
        state_dict, storage_writer=storage_writer, planner=_PortableSavePlanner(), **_dcp_group(binding)
    )
    return metadata


def async_save_portable_dcp(
    optimizer: Any,
    *,
    checkpoint_process_group: ProcessGroupBinding,
    storage_writer: StorageWriter,
    transaction_id: str,
    limits: PortableStateLimits,
    namespace: str = "optimizer",
    async_process_group: Any = None,
) -> Any:
    """Like :func:`save_portable_dcp`, but DCP writes in the background; returns DCP's future.

    The export (a private copy of the state) happens in the call, so the checkpoint holds the
    state at the call whatever training does next. Under a communicating binding,
    ``async_process_group`` must be a separate process group over the same ranks in the same
    order (``torch.distributed.new_group``), so the background write's collectives never
    interleave with training's. Wait on the result (``.result()``) to surface failures.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import async_save

    binding = require_binding(checkpoint_process_group)
    options: dict[str, Any] = {"no_dist": True}
    if binding.communicates:
        if async_process_group is None or async_process_group is binding.process_group:
            raise ValueError("async_save_portable_dcp needs a separate async_process_group over the same ranks")
        if dist.get_world_size(async_process_group) != binding.member_count or (
            dist.get_rank(async_process_group) != binding.coordinate
        ):
            raise ValueError("async_process_group must hold the binding's ranks in the binding's order")
        options = {"process_group": async_process_group}
    state_dict = _export(optimizer, binding, storage_writer, transaction_id, limits, namespace)
    return async_save(state_dict, storage_writer=storage_writer, planner=_PortableSavePlanner(), **options)

"""Projection: from catalog fragments to the records an adapter stages for its own slots.

For every target slot (in ``portable_layout().slots`` order) the adapter receives a
:class:`~gefen_contracts.exchange.PortableSlotState` with the document's options, variant and
counters and:

* a *payload piece* (see :func:`~gefen_portable.extents.carries_payload`): every field as
  a fresh CPU tensor of its dtype shaped like the piece, filled from every fragment that
  overlaps the piece (by flat runs, so any source layout maps onto any target layout; a
  block field is expanded per element over the fragment first, so each target element
  holds the value of the source run it came from), and a fresh copy of every replica
  field. When the piece is exactly one fragment (the same elements in the same order: an
  import onto the layout that exported), its block fields arrive as exported instead, with
  the fragment's ``block_period``: nothing is expanded, and the adapter can keep the
  source's blocks as they are (``gefen_contracts.torch_support.as_imported`` expands them);
* an empty flattened slice or empty region: zero-element fields and a copy of every
  replica field;
* a non-owner piece of a whole-parameter-owner layout: no fields.

Buffers are allocated once per target piece; fragments are copied in as they arrive and
dropped, so the peak is the target's own fields plus one fragment in flight (block fields
expanded). Every element of every buffer must be written exactly once (checked by count).
"""

from __future__ import annotations

import math

import torch
from gefen_contracts.exchange import PortableLayout, PortableSlotState
from gefen_contracts.identity import LogicalSlice, ShardIdentity
from gefen_contracts.torch_support import expand_blocks

from .catalog import Catalog
from .errors import PortableLimitError, PortableStateError
from .extents import Extent, carries_payload, copy_overlap, covers_parameter, extent_runs, overlaps, piece_shape
from .fragments import PortableFragment
from .records import ParameterRecord
from .tensors import DTYPE_CODES

__all__ = ["Projection", "check_target", "needed_fragments"]


def _target_extent(shard: ShardIdentity) -> Extent:
    # a covering piece maps as the full flat slice whatever its layout, as fragment_extent stores it
    return LogicalSlice(0, shard.parameter.numel) if covers_parameter(shard) else shard.extent


def check_target(catalog: Catalog, layout: PortableLayout) -> None:
    """Refuse a document exported by another implementation or for other parameters."""
    if catalog.implementation != layout.implementation:
        raise PortableStateError(
            f"the document was exported by {catalog.implementation!r}, the target is {layout.implementation!r}"
        )
    source, target = set(catalog.parameters), set(layout.manifest.fqns)
    if source != target:
        raise PortableStateError(
            f"the document's parameters differ from the target's (missing {sorted(target - source)}, "
            f"unexpected {sorted(source - target)})"
        )
    for fqn in sorted(target):
        if catalog.parameters[fqn].identity != layout.manifest.for_parameter(fqn)[0].parameter:
            raise PortableStateError(f"the document's identity of {fqn!r} differs from the target's (global shape)")


def needed_fragments(catalog: Catalog, layout: PortableLayout) -> frozenset[tuple[str, int]]:
    """The fragments ``(fqn, index)`` that overlap this member's payload pieces of ``layout``
    (:func:`check_target` first: extents are only comparable on equal shapes).

    A rank-sharded load reads exactly these (and nothing else) before importing.
    """
    check_target(catalog, layout)
    needed = set()
    for slot in layout.slots:
        shard = slot.shard
        record = catalog.parameters.get(slot.fqn)
        if record is None or not carries_payload(shard) or not record.fields:
            continue
        extent = _target_extent(shard)
        for index, frag in enumerate(catalog.fragments[slot.fqn]):
            if overlaps(frag.extent, extent, shard.parameter.global_shape):
                needed.add((slot.fqn, index))
    return frozenset(needed)


class Projection:
    """Target buffers for one member's slots, filled fragment by fragment."""

    def __init__(self, catalog: Catalog, layout: PortableLayout, *, max_bytes: int) -> None:
        self.catalog = catalog
        self.layout = layout
        self._buffers: dict[str, dict[str, torch.Tensor]] = {}
        self._extents: dict[str, Extent] = {}
        self._written: dict[str, int] = {}
        #: pieces that are exactly one fragment: their block fields pass through unexpanded
        self._blocks: dict[str, tuple[int, dict[str, torch.Tensor]] | None] = {}
        self.needed = needed_fragments(catalog, layout)
        planned = 0
        targets = []
        for slot in layout.slots:
            shard = slot.shard
            record = catalog.parameters.get(slot.fqn)
            if record is None:
                raise PortableStateError(f"the document has no parameter {slot.fqn!r}")
            if not carries_payload(shard) or not record.fields:
                continue
            shape = piece_shape(shard)
            assert shape is not None
            planned += math.prod(shape) * sum(DTYPE_CODES[spec.dtype].itemsize for spec in record.fields.values())
            targets.append((slot.fqn, shape, record))
            self._extents[slot.fqn] = _target_extent(shard)
        # block fields counted expanded (an upper bound); refused before the loop below allocates anything
        if planned > max_bytes:
            raise PortableLimitError(
                "max_fragment_tensor_bytes", f"this member's target pieces need {planned} bytes of fields"
            )
        for fqn, shape, record in targets:
            # one fragment in the same element order: its blocks can be handed over as-is, so no expanded buffers
            whole = any(spec.blocked for spec in record.fields.values()) and self._one_fragment(fqn)
            self._buffers[fqn] = _empty_fields(record, shape, blocked=not whole)
            self._written[fqn] = 0
            if whole:
                self._blocks[fqn] = None  # filled by the one fragment

    def _one_fragment(self, fqn: str) -> bool:
        """Whether the target piece of ``fqn`` is exactly one needed fragment's elements, in order."""
        shape = self.catalog.parameters[fqn].identity.global_shape
        needed = [index for name, index in self.needed if name == fqn]
        if len(needed) != 1:
            return False
        runs = extent_runs(self.catalog.fragments[fqn][needed[0]].extent, shape)
        target = extent_runs(self._extents[fqn], shape)
        # flat coverage only: the shapes may differ (slice vs region), but block runs follow flat order
        return [run[:2] for run in runs] == [run[:2] for run in target]

    def accept(self, fragment: PortableFragment) -> None:
        """Copy a verified fragment's overlap into the target buffers that need it."""
        fqn = fragment.fqn
        buffers = self._buffers.get(fqn)
        if buffers is None or fragment.key not in self.needed:
            return
        record = self.catalog.parameters[fqn]
        piece = self.catalog.fragment_shape(fqn, fragment.index)
        for name, target in buffers.items():
            source = fragment.fields[name]
            if record.fields[name].blocked:
                # expand over the fragment's own piece: its block runs start at the fragment's first element
                source = expand_blocks(source, fragment.block_period, piece)
            copied = copy_overlap(source, fragment.extent, target, self._extents[fqn], record.identity.global_shape)
            # fragments tile disjointly, so the total reaches the buffer size only if every element was hit
            self._written[fqn] += copied
        if fqn in self._blocks:
            # clone: a locally held fragment belongs to the caller's PortableState; slot states must be fresh
            blocked = {name: fragment.fields[name].clone() for name, spec in record.fields.items() if spec.blocked}
            self._blocks[fqn] = (fragment.block_period, blocked)

    def slot_states(self) -> tuple[PortableSlotState, ...]:
        """The projected records, in slot order (raises if a buffer was not filled exactly)."""
        states = []
        for slot in self.layout.slots:
            record = self.catalog.parameters[slot.fqn]
            shard = slot.shard
            elements: dict[str, object] = {}
            replicas: dict[str, object] = {}
            blocks: dict[str, object] = {}
            period = 0
            if slot.fqn in self._buffers:
                buffers = self._buffers[slot.fqn]
                expected = sum(t.numel() for t in buffers.values())
                # () means no pass-through for this piece; None means its one fragment never arrived
                passed = self._blocks.get(slot.fqn, ())
                if self._written[slot.fqn] != expected or passed is None:
                    raise PortableStateError(
                        f"the fragments delivered for {slot.fqn!r} filled {self._written[slot.fqn]} of {expected} elements"
                    )
                elements = dict(buffers)
                if passed:
                    period, blocks = passed[0], dict(passed[1])
            elif piece_shape(shard) is not None:
                shape = piece_shape(shard)
                assert shape is not None
                elements = dict(_empty_fields(record, shape))
            if piece_shape(shard) is not None:
                replicas = {name: value.clone() for name, value in record.replica_fields.items()}
            states.append(
                PortableSlotState(
                    slot,
                    record.options,
                    record.variant,
                    record.counters,
                    element_fields=elements,
                    replica_fields=replicas,
                    block_fields=blocks,
                    block_period=period,
                )
            )
        return tuple(states)


def _empty_fields(record: ParameterRecord, shape: tuple[int, ...], *, blocked: bool = True) -> dict[str, torch.Tensor]:
    """One uninitialised per-element buffer per field of ``record`` (block fields expanded;
    without ``blocked``, none for the block fields)."""
    fields = record.fields.items()
    return {name: torch.empty(shape, dtype=spec.dtype) for name, spec in fields if blocked or not spec.blocked}

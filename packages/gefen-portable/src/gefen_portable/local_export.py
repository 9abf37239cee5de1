"""One member's side of an export: check what the adapter returned, digest it, describe it.

The adapter's :class:`~gefen_contracts.exchange.PortableExport` is checked against its own
:class:`~gefen_contracts.exchange.PortableLayout` and the checkpoint binding (implementation,
manifest, slot order, shard membership, field shapes, dtypes and finiteness). Each *payload
piece* (see :func:`~gefen_portable.extents.carries_payload`) becomes a candidate fragment
with its digest. What travels to the other members is a small *contribution*: per slot the
position, native name, options, variant, counters, field specs, the fragment's extent,
block period and digest and the replica fields' digest; replica tensors travel only from the lowest-coordinate
payload piece of each parameter. No dense element data moves between members during an export.
Pieces without payload (empty slices, non-owners) are validated but not described: their
variant, counters and fields are not part of the document.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from gefen_contracts.codec import to_primitive
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.torch_support import ProcessGroupBinding, block_count, tensor_digest

from .errors import PortableStateError
from .extents import Extent, carries_payload, fragment_extent, fragment_shape, piece_shape
from .fragments import fragment_digest
from .records import FieldSpec, StateHeader
from .tensors import DTYPE_CODES, check_finite, is_tight_cpu, owned_cpu_copy
from .values import check_name, plain_common, plain_primitive

__all__ = ["LocalExport", "LocalFragment", "build_local_export", "check_layout", "header_digest", "replica_sender"]


@dataclass(frozen=True, slots=True, eq=False)
class LocalFragment:
    """A candidate fragment of this member: its extent, block period, tight CPU fields and digest."""

    fqn: str
    extent: Extent
    block_period: int
    fields: Mapping[str, torch.Tensor]
    digest: str


@dataclass(frozen=True, slots=True, eq=False)
class LocalExport:
    """This member's validated export: the header, candidate fragments and the contribution."""

    header: StateHeader
    fragments: Mapping[str, LocalFragment]
    contribution: dict[str, object]


def header_digest(header: StateHeader) -> str:
    """Digest of what every member must hold identically (implementation, policy, common, manifest)."""
    return tensor_digest(header.to_record())


def local_shards(manifest: ShardingManifest, binding: ProcessGroupBinding) -> tuple[ShardIdentity, ...]:
    """The manifest shards this member holds (ungrouped shards belong to a one-member binding)."""
    return tuple(s for s in manifest.shards if s.local_member == binding.local_member or s.process_group is None)


def check_layout(layout: PortableLayout, binding: ProcessGroupBinding) -> None:
    """The adapter's layout must be a layout of the binding's group, with one slot per local shard."""
    if type(layout) is not PortableLayout:
        raise PortableStateError(f"portable_layout() must return a PortableLayout, got {type(layout).__name__}")
    for shard in layout.manifest.shards:
        if shard.process_group is None:
            if binding.member_count != 1:
                raise PortableStateError(
                    f"parameter {shard.fqn!r} is ungrouped, which only a one-member checkpoint group can export"
                )
        elif shard.process_group != binding.identity:
            raise PortableStateError(
                f"parameter {shard.fqn!r} is sharded over process group {shard.process_group.semantic_name!r}, "
                f"not the checkpoint group {binding.identity.semantic_name!r}"
            )
    expected = set(local_shards(layout.manifest, binding))
    present = {slot.shard for slot in layout.slots}
    if present != expected:
        missing = sorted(s.fqn for s in expected - present)
        extra = sorted(s.fqn for s in present - expected)
        raise PortableStateError(
            f"portable_layout() slots must be exactly this member's manifest shards (missing {missing}, unexpected {extra})"
        )


def replica_sender(manifest: ShardingManifest, fqn: str) -> str | None:
    """The member that sends a parameter's replica tensors: its lowest-coordinate payload piece."""
    payload = [s for s in manifest.for_parameter(fqn) if carries_payload(s)]
    payload.sort(key=lambda s: s.member_index)
    return payload[0].local_member if payload else None


def _element(
    value: object,
    shape: tuple[int, ...],
    where: str,
    live: frozenset[int] = frozenset(),
    *,
    fp32: bool = False,
) -> torch.Tensor:
    if type(value) is not torch.Tensor:
        raise PortableStateError(f"{where} must be exactly torch.Tensor, got {type(value).__name__}")
    if value.layout is not torch.strided or value.is_meta or value.dtype not in DTYPE_CODES:
        raise PortableStateError(f"{where} must be a materialized strided tensor of a wire dtype, got {value.dtype}")
    if fp32 and value.dtype is not torch.float32:
        raise PortableStateError(f"{where} must be float32, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise PortableStateError(f"{where} must have shape {shape}, got {tuple(value.shape)}")
    aliased = value.untyped_storage().data_ptr() in live
    tight = value.detach() if (is_tight_cpu(value) and not aliased) else owned_cpu_copy(value)
    check_finite(tight, where)
    return tight


def _replica(value: object, where: str, live: frozenset[int]) -> torch.Tensor:
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    return _element(value, shape, where, live, fp32=True)


def build_local_export(
    layout: PortableLayout,
    export: PortableExport,
    binding: ProcessGroupBinding,
    live: frozenset[int] = frozenset(),
) -> LocalExport:
    """Validate ``export`` against ``layout`` and build this member's contribution and fragments.

    ``live`` holds the storage addresses of the optimizer's live tensors: an exported tensor
    that shares one (an adapter that forgot to copy) is copied, so later training cannot
    change the export.
    """
    if type(export) is not PortableExport:
        raise PortableStateError(f"portable_export() must return a PortableExport, got {type(export).__name__}")
    if export.implementation != layout.implementation:
        raise PortableStateError(
            f"portable_export() implementation {export.implementation!r} differs from the layout's "
            f"{layout.implementation!r}"
        )
    if export.manifest != layout.manifest:
        raise PortableStateError("portable_export() manifest differs from portable_layout()'s manifest")
    if len(export.slots) != len(layout.slots) or any(
        s.layout != expected for s, expected in zip(export.slots, layout.slots)
    ):
        raise PortableStateError("portable_export() slots must match portable_layout().slots one to one, in order")
    policy = plain_primitive(export.policy, "policy")
    assert isinstance(policy, dict)
    header = StateHeader(layout.implementation, policy, plain_common(export.common, "common"), layout.manifest)
    fragments: dict[str, LocalFragment] = {}
    slots: list[dict[str, object]] = []
    for slot in export.slots:
        shard = slot.layout.shard
        fqn = shard.fqn
        where = f"portable_export() slot {fqn!r}"
        entry: dict[str, object] = {
            "fqn": fqn,
            "position": list(slot.layout.position),
            "compatibility_name": slot.layout.compatibility_name,
            "options": plain_primitive(slot.options, f"{where} options"),
            "payload": carries_payload(shard),
        }
        if not carries_payload(shard):
            _check_empty_piece(shard, slot, where)
            entry.update(
                variant=None,
                counters=None,
                fields=None,
                fragment=None,
                replica_digest=None,
                replica_fields=None,
            )
            slots.append(entry)
            continue
        shape = piece_shape(shard)
        assert shape is not None
        extent = fragment_extent(shard)
        target_shape = fragment_shape(extent, shard.parameter)
        # only a covering piece changes shape (to the global one): equal content gets one extent, shape and digest
        fields = {
            name: _element(slot.element_fields[name], shape, f"{where} element field {name!r}", live).reshape(
                target_shape
            )
            for name in slot.element_fields
        }
        blocks = (block_count(math.prod(shape), slot.block_period),) if slot.block_fields else ()
        fields.update(
            (name, _element(value, blocks, f"{where} block field {name!r}", live))
            for name, value in slot.block_fields.items()
        )
        fields = {check_name(name, f"{where} field name"): fields[name] for name in sorted(fields)}
        specs = {name: FieldSpec(t.dtype, name in slot.block_fields).to_record() for name, t in fields.items()}
        replica = {
            check_name(name, f"{where} replica field name"): _replica(value, f"{where} replica field {name!r}", live)
            for name, value in sorted(slot.replica_fields.items())
        }
        fragment = None
        if fields:
            digest = fragment_digest(fqn, extent, slot.block_period, fields)
            fragments[fqn] = LocalFragment(fqn, extent, slot.block_period, fields, digest)
            nbytes = sum(t.numel() * t.element_size() for t in fields.values())
            fragment = {
                "extent": to_primitive(extent),
                "block_period": slot.block_period,
                "digest": digest,
                "nbytes": nbytes,
            }
        sends_replica = replica_sender(layout.manifest, fqn) == shard.local_member
        entry.update(
            variant=slot.variant,
            counters=dict(slot.counters),
            fields=specs,
            fragment=fragment,
            replica_digest=tensor_digest(replica),
            replica_fields=replica if sends_replica else None,
        )
        slots.append(entry)
    contribution: dict[str, object] = {
        "member": binding.local_member,
        "implementation": layout.implementation,
        "header_digest": header_digest(header),
        "slots": slots,
    }
    return LocalExport(header, fragments, contribution)


def _check_empty_piece(shard: ShardIdentity, slot: PortableSlotState, where: str) -> None:
    shape = piece_shape(shard)
    if shape is None and (slot.element_fields or slot.block_fields or slot.replica_fields):
        raise PortableStateError(f"{where} is a non-owner piece but returned fields")
    for name, value in slot.element_fields.items():
        assert shape is not None
        _element(value, shape, f"{where} element field {name!r}")
    for name, value in slot.block_fields.items():
        _element(value, (0,), f"{where} block field {name!r}")
    for name, value in slot.replica_fields.items():
        _replica(value, f"{where} replica field {name!r}", frozenset())

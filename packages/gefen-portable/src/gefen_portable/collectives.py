"""Moving bytes between members: every member's value to all, and fragments to who needs them.

Only fixed-size tensor collectives on the binding's group are used (``all_gather`` inside
gates, ``broadcast`` and point-to-point ``send``/``recv`` for payload bytes), never object
collectives. Tensors travel on the binding's collective device in ``limits.chunk_bytes``
slices; CPU tensors are received straight into their destination.

:func:`share_values` (every member's small value to every member) runs, in order: an
*announce* gate with each member's metadata size, tensor count, tensor bytes and metadata
digest (all per-member and aggregate limits are checked on the gathered sizes before
anything moves); one metadata broadcast per member, parsed with the limits before any
tensor exists; a *metadata* gate; allocation; an *allocate* gate; the tensor broadcasts;
digest-verified reconstruction; a *verify* gate.

:func:`fetch_fragments` moves only what a member needs: after a gate that agreed on the
catalog digest, one ``all_gather`` of each member's held/needed bitmap gives every member
the same transfer schedule (fragment order, then receiver coordinate; the sender is one of
the holders, rotated to spread the load); the transfers then run as ``send``/``recv``
pairs in schedule order, which cannot deadlock because every pair is the earliest
unfinished transfer of both its members. Each received fragment is digest-verified and
handed to a sink before the next transfer, so a member holds at most one fetched fragment
at a time. A *fetch* gate follows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import torch
from gefen_contracts.limits import PortableStateLimits

from .catalog import Catalog
from .errors import PortableIntegrityError
from .fragments import PortableFragment, verify_fragment
from .protocol import Header, Session
from .wire import WireLayout, encode_wire, parse_wire, reconstruct_wire

__all__ = ["FragmentKey", "share_values", "fetch_fragments"]

FragmentKey = tuple[str, int]


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _broadcast(session: Session, data: torch.Tensor, source: int, chunk_bytes: int) -> None:
    import torch.distributed as dist

    device = session.binding.collective_device
    group = session.binding.process_group
    src = session.global_rank(source)
    for start in range(0, data.numel(), chunk_bytes):
        piece = data[start : start + chunk_bytes]
        if device.type == "cpu":
            dist.broadcast(piece, src=src, group=group)
        else:
            staged = piece.to(device) if session.coordinate == source else torch.empty_like(piece, device=device)
            dist.broadcast(staged, src=src, group=group)
            if session.coordinate != source:
                piece.copy_(staged.cpu())


def _send(session: Session, data: torch.Tensor, target: int, chunk_bytes: int) -> None:
    import torch.distributed as dist

    device = session.binding.collective_device
    dst = session.global_rank(target)
    for start in range(0, data.numel(), chunk_bytes):
        piece = data[start : start + chunk_bytes]
        dist.send(piece if device.type == "cpu" else piece.to(device), dst=dst, group=session.binding.process_group)


def _recv(session: Session, data: torch.Tensor, source: int, chunk_bytes: int) -> None:
    import torch.distributed as dist

    device = session.binding.collective_device
    src = session.global_rank(source)
    for start in range(0, data.numel(), chunk_bytes):
        piece = data[start : start + chunk_bytes]
        if device.type == "cpu":
            dist.recv(piece, src=src, group=session.binding.process_group)
        else:
            staged = torch.empty_like(piece, device=device)
            dist.recv(staged, src=src, group=session.binding.process_group)
            piece.copy_(staged.cpu())


def _check_announced(session: Session, phase: str, headers: Sequence[Header], limits: PortableStateLimits) -> None:
    total_meta = total_bytes = 0
    for header in headers:
        where = f"coordinate {header.coordinate}"
        if header.metadata_bytes > limits.max_metadata_bytes:
            session.fail(phase, f"{where} announces {header.metadata_bytes} metadata bytes (limit max_metadata_bytes)")
        if header.tensor_count > limits.max_tensors:
            session.fail(phase, f"{where} announces {header.tensor_count} tensors (limit max_tensors)")
        if header.tensor_bytes > limits.max_fragment_tensor_bytes:
            session.fail(
                phase, f"{where} announces {header.tensor_bytes} tensor bytes (limit max_fragment_tensor_bytes)"
            )
        total_meta += header.metadata_bytes
        total_bytes += header.tensor_bytes
    if total_meta > limits.max_collective_metadata_bytes:
        session.fail(
            phase, f"members announce {total_meta} metadata bytes in all (limit max_collective_metadata_bytes)"
        )
    if total_bytes > limits.max_collective_tensor_bytes:
        session.fail(phase, f"members announce {total_bytes} tensor bytes in all (limit max_collective_tensor_bytes)")


def _allocate(
    layouts: Sequence[WireLayout | None], own: int, own_tensors: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Receive buffers for every member's tensors (the member's own tensors are sent as they are)."""
    received: list[list[torch.Tensor]] = []
    for source, announced in enumerate(layouts):
        if source == own:
            received.append(own_tensors)
        else:
            assert announced is not None
            received.append([torch.empty(spec.shape, dtype=spec.dtype) for spec in announced.specs])
    return received


def share_values(session: Session, phase: str, value: object, error: BaseException | None) -> list[object]:
    """Give every member every member's ``value`` (in coordinate order), verified and bounded.

    ``error`` is a local failure that happened while preparing ``value``; it is reported at
    the announce gate. Returns the list of values; a member's own entry is its ``value``.
    """
    limits = session.limits
    payload = None
    if error is None:
        try:
            payload = encode_wire(value, limits=limits)
        except Exception as exc:
            error = exc
    sizes = (0, 0, 0) if payload is None else (len(payload.metadata), len(payload.tensors), payload.tensor_bytes)
    digest = None if payload is None else payload.digest
    headers = session.gate(f"{phase}.announce", error, sizes=sizes, payload_digest=digest)
    if not session.communicates:
        return [value]
    _check_announced(session, f"{phase}.announce", headers, limits)
    assert payload is not None
    layouts: list[WireLayout | None] = []
    error = None
    for source, header in enumerate(headers):
        buffer = torch.empty(header.metadata_bytes, dtype=torch.uint8)
        if source == session.coordinate:
            buffer.copy_(torch.frombuffer(bytearray(payload.metadata), dtype=torch.uint8))
        _broadcast(session, buffer, source, limits.chunk_bytes)
        # after a parse error keep joining every broadcast (the peers are in it) but stop parsing
        if source == session.coordinate or error is not None:
            layouts.append(None)
            continue
        try:
            layout: WireLayout = parse_wire(bytes(buffer.numpy().tobytes()), limits=limits)
            if layout.digest != header.payload_digest:
                raise PortableIntegrityError(f"metadata from coordinate {source} differs from its announced digest")
            if len(layout.specs) != header.tensor_count or layout.tensor_bytes != header.tensor_bytes:
                raise PortableIntegrityError(f"metadata from coordinate {source} differs from its announced sizes")
            layouts.append(layout)
        except Exception as exc:
            error = exc
            layouts.append(None)
    session.gate(f"{phase}.metadata", error)
    received: list[list[torch.Tensor]] = []
    try:
        received = _allocate(layouts, session.coordinate, list(payload.tensors))
    except Exception as exc:
        error = exc
    session.gate(f"{phase}.allocate", error)
    for source, tensors in enumerate(received):
        for tensor in tensors:
            if tensor.numel():
                _broadcast(session, _byte_view(tensor), source, limits.chunk_bytes)
    values: list[object] = []
    for source, (parsed, tensors) in enumerate(zip(layouts, received)):
        if source == session.coordinate:
            values.append(value)
            continue
        try:
            assert parsed is not None
            values.append(reconstruct_wire(parsed, tensors, copy=False, expected_digest=headers[source].payload_digest))
        except Exception as exc:
            error = error or exc
            values.append(None)
    session.gate(f"{phase}.verify", error)
    return values


def fetch_fragments(
    session: Session,
    phase: str,
    catalog: Catalog,
    held: Mapping[FragmentKey, PortableFragment],
    needed: AbstractSet[FragmentKey],
    sink: Callable[[PortableFragment], None],
    error: BaseException | None = None,
) -> None:
    """Deliver every needed fragment to ``sink``: local ones directly, others over the group.

    Must follow a gate whose context was ``catalog.digest`` (so every member shares the
    catalog). Every fragment handed to ``sink`` has been verified against the catalog.
    ``error`` is an earlier local failure; it and any local error here are reported at the
    closing gate (the member still takes part in every transfer so its peers are not left
    waiting). The schedule is identical everywhere, so
    every member raises the same error when a fragment is held by no member or a member's
    share exceeds the limits.
    """
    limits = session.limits
    keys = catalog.fragment_keys()
    for key in keys:
        fragment = held.get(key)
        if key in needed and fragment is not None and error is None:
            try:
                verify_fragment(fragment, catalog)
                sink(fragment)
            except Exception as exc:
                error = exc
    if not session.communicates:
        missing = [key for key in keys if key in needed and key not in held]
        if error is None and missing:
            error = PortableIntegrityError(f"fragments {missing[:4]} are needed but not held by this member")
        session.gate(f"{phase}.fetch", error, context=catalog.digest)
        return
    bitmap = torch.zeros(2 * len(keys), dtype=torch.uint8)
    for index, key in enumerate(keys):
        # interleaved per fragment: even bytes held, odd bytes needed (_schedule slices them apart)
        bitmap[2 * index] = int(key in held)
        bitmap[2 * index + 1] = int(key in needed)
    maps = _all_gather_bitmaps(session, bitmap)
    schedule = _schedule(session, f"{phase}.plan", catalog, keys, maps, limits)
    for index, source, target in schedule:
        key = keys[index]
        specs = catalog.fragment_tensors(*key)
        if session.coordinate == source:
            fragment = held[key]
            for name, (shape, dtype) in specs.items():
                tensor = fragment.fields.get(name)
                if tensor is None or tuple(tensor.shape) != shape or tensor.dtype is not dtype:
                    tensor = torch.zeros(shape, dtype=dtype)  # keep the peer in step; it rejects the digest
                _send(session, _byte_view(tensor.contiguous()), target, limits.chunk_bytes)
        elif session.coordinate == target:
            fields = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
            for tensor in fields.values():
                if tensor.numel():
                    _recv(session, _byte_view(tensor), source, limits.chunk_bytes)
            if error is None:
                try:
                    record = catalog.fragments[key[0]][key[1]]
                    fetched = PortableFragment(
                        key[0], key[1], record.extent, record.block_period, fields, record.digest
                    )
                    verify_fragment(fetched, catalog)
                    sink(fetched)
                except Exception as exc:
                    error = exc
    session.gate(f"{phase}.fetch", error, context=catalog.digest)


def _all_gather_bitmaps(session: Session, bitmap: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    device = session.binding.collective_device
    local = bitmap.to(device)
    gathered = [torch.empty_like(local) for _ in range(session.member_count)]
    dist.all_gather(gathered, local, group=session.binding.process_group)
    return [g.cpu() for g in gathered]


def _schedule(
    session: Session,
    phase: str,
    catalog: Catalog,
    keys: Sequence[FragmentKey],
    maps: Sequence[torch.Tensor],
    limits: PortableStateLimits,
) -> list[tuple[int, int, int]]:
    held = [m[0::2].tolist() for m in maps]
    needed = [m[1::2].tolist() for m in maps]
    schedule: list[tuple[int, int, int]] = []
    for index, key in enumerate(keys):
        holders = [c for c in range(len(maps)) if held[c][index]]
        nbytes = catalog.fragments[key[0]][key[1]].nbytes
        if nbytes > limits.max_fragment_tensor_bytes:
            session.fail(
                phase, f"fragment {key[1]} of {key[0]!r} holds {nbytes} bytes (limit max_fragment_tensor_bytes)"
            )
        for target in range(len(maps)):
            if not needed[target][index] or held[target][index]:
                continue
            if not holders:
                session.fail(
                    phase, f"fragment {key[1]} of {key[0]!r} is needed by coordinate {target} but no member holds it"
                )
            # rotate over the holders by receiver and fragment to spread the sends
            source = holders[(target + index) % len(holders)]
            schedule.append((index, source, target))
    return schedule

"""Moving matrices between a distributed-mode owner and the ranks that hold its rows.

Buckets (:func:`owner_buckets`): the active items are queued per owner, and bucket ``j``
takes the ``j``-th item of every owner's queue, so a bucket never gives one rank two
matrices (the reference grouped by active position, which unbalances owners when gradients
come and go). Within a bucket:

* :func:`gather_to_owners`: one ``all_to_all_single`` per gradient dtype sends each rank's
  local rows of every item to that item's owner, which receives them in rank order, that is,
  already laid out as the full matrix; a rank receives only the matrix it owns (a
  ``1/world`` of the traffic of an all-gather).
* :func:`scatter_from_owners`: one bf16 ``all_to_all_single`` sends every rank its rows of
  each owner's update (the "broadcast" of the reference, without sending the rows a rank
  does not hold).

:func:`consolidate_states` makes distributed-mode state complete on every rank for
``state_dict()``: one ``all_reduce`` of a metadata table, then one ``broadcast`` per owner of
its packed state bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .muon_distributed import MuonScope, shard_rows
from .muon_state import NORMUON_STEP, NORMUON_V
from .param_state import INDICES, MAGNITUDE, STEP, period_of

__all__ = ["BucketItem", "consolidate_states", "gather_to_owners", "owner_buckets", "scatter_from_owners"]


@dataclass(frozen=True, slots=True)
class BucketItem:
    """One matrix of a bucket: its owner (group rank), global shape and gradient dtype."""

    owner: int
    shape: tuple[int, int]
    dtype: torch.dtype


def owner_buckets(owners: Sequence[int], world: int) -> list[list[int]]:
    """Indices into ``owners`` grouped so bucket ``j`` holds each owner's ``j``-th item (owner order)."""
    queues: list[list[int]] = [[] for _ in range(world)]
    for index, owner in enumerate(owners):
        queues[owner].append(index)
    depth = max((len(q) for q in queues), default=0)
    return [[q[j] for q in queues if j < len(q)] for j in range(depth)]


def _rows(scope: MuonScope, shape: tuple[int, int], rank: int) -> tuple[int, int]:
    return shard_rows(shape[0], scope.world, rank)


def gather_to_owners(
    scope: MuonScope, items: Sequence[BucketItem], local_rows: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Full matrices for the items this rank owns (``None`` for the others); one bucket."""
    import torch.distributed as dist

    result: list[torch.Tensor | None] = [None] * len(items)
    for dtype in sorted({item.dtype for item in items}, key=str):
        by_owner = {item.owner: index for index, item in enumerate(items) if item.dtype == dtype}
        send_sizes, pieces = [], []
        for dest in range(scope.world):
            index = by_owner.get(dest)
            piece = local_rows[index].reshape(-1) if index is not None else None
            send_sizes.append(0 if piece is None else piece.numel())
            if piece is not None:
                pieces.append(piece)
        mine = by_owner.get(scope.rank)
        receive_sizes = [0] * scope.world
        if mine is not None:
            shape = items[mine].shape
            receive_sizes = [_rows(scope, shape, src)[1] * shape[1] for src in range(scope.world)]
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=scope.device)
        receive = torch.empty(sum(receive_sizes), dtype=dtype, device=scope.device)
        dist.all_to_all_single(receive, send, receive_sizes, send_sizes, group=scope.group)
        if mine is not None:
            result[mine] = receive.view(items[mine].shape)
    return result


def scatter_from_owners(
    scope: MuonScope, items: Sequence[BucketItem], updates: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """This rank's rows of every item's bf16 update (owners pass their full update, others ``None``)."""
    import torch.distributed as dist

    mine = next((index for index, item in enumerate(items) if item.owner == scope.rank), None)
    send_sizes, pieces = [0] * scope.world, []
    if mine is not None:
        update = updates[mine]
        assert update is not None
        shape = items[mine].shape
        for dest in range(scope.world):
            start, length = _rows(scope, shape, dest)
            pieces.append(update[start : start + length].reshape(-1))
            send_sizes[dest] = length * shape[1]
    by_owner = {item.owner: index for index, item in enumerate(items)}
    receive_sizes = []
    for src in range(scope.world):
        index = by_owner.get(src)
        receive_sizes.append(
            0 if index is None else _rows(scope, items[index].shape, scope.rank)[1] * items[index].shape[1]
        )
    send = torch.cat(pieces).to(torch.bfloat16) if pieces else torch.empty(0, dtype=torch.bfloat16, device=scope.device)
    receive = torch.empty(sum(receive_sizes), dtype=torch.bfloat16, device=scope.device)
    dist.all_to_all_single(receive, send, receive_sizes, send_sizes, group=scope.group)
    slices: list[torch.Tensor] = [torch.empty(0)] * len(items)
    offset = 0
    for src in range(scope.world):
        index = by_owner.get(src)
        if index is None:
            continue
        rows = _rows(scope, items[index].shape, scope.rank)[1]
        cols = items[index].shape[1]
        slices[index] = receive[offset : offset + rows * cols].view(rows, cols)
        offset += rows * cols
    return slices


_META = 5  # initialized, period, step, normuon present, normuon_step


def consolidate_states(
    scope: MuonScope,
    owners: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    states: Sequence[dict[str, Any] | None],
) -> list[dict[str, Any] | None]:
    """Every distributed item's state on every rank (``states``: this rank's own, ``None`` elsewhere).

    The result holds the owner's live state for owned items and fresh tensors for the others.
    """
    import torch.distributed as dist

    meta = torch.zeros(len(owners), _META, dtype=torch.int64, device=scope.device)
    for index, (owner, state) in enumerate(zip(owners, states)):
        if owner == scope.rank and state:
            normuon = NORMUON_V in state
            meta[index] = torch.tensor(
                [1, period_of(state), int(state[STEP]), int(normuon), int(state[NORMUON_STEP]) if normuon else 0]
            )
    dist.all_reduce(meta, op=dist.ReduceOp.SUM, group=scope.group)
    table = meta.tolist()
    result: list[dict[str, Any] | None] = [states[i] if owners[i] == scope.rank else None for i in range(len(owners))]
    for owner in range(scope.world):
        layout = [
            (index, _fields(row, shapes[index])) for index, row in enumerate(table) if owners[index] == owner and row[0]
        ]
        total = sum(_nbytes(dtype, shape) for _, fields in layout for _, dtype, shape in fields)
        if not total:
            continue
        if owner == scope.rank:
            pieces: list[torch.Tensor] = []
            for index, fields in layout:
                own = states[index]
                assert own is not None
                pieces.extend(own[key].reshape(-1).view(torch.uint8) for key, _, _ in fields)
            buffer = torch.cat(pieces).to(scope.device)
        else:
            buffer = torch.empty(total, dtype=torch.uint8, device=scope.device)
        dist.broadcast(buffer, src=scope.global_rank(owner), group=scope.group)
        if owner != scope.rank:
            offset = 0
            for index, fields in layout:
                row = table[index]
                received: dict[str, Any] = {STEP: row[2]}
                for key, dtype, shape in fields:
                    nbytes = _nbytes(dtype, shape)
                    received[key] = buffer[offset : offset + nbytes].clone().view(dtype).view(shape)
                    offset += nbytes
                if row[3]:
                    received[NORMUON_STEP] = row[4]
                result[index] = received
    return result


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()


def _fields(row: list[int], shape: tuple[int, int]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    rows, cols = shape
    period = row[1]
    blocks = rows * cols // period
    fields: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
        (INDICES, torch.uint8, (blocks, period)),
        (MAGNITUDE, torch.float32, (blocks, 1)),
    ]
    if row[3]:
        fields.append((NORMUON_V, torch.float32, (rows, 1)))
    return fields

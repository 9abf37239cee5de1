"""Vote and agreement primitives over a binding, and a collective call counter.

Discipline: before any branch that depends on local state, every member votes, so a
failure on one member makes every member raise the same
:class:`~gefen_contracts.errors.CollectiveFailureError` instead of leaving peers waiting
in a collective.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import CollectiveFailureError, ContractError
from .bindings import ProcessGroupBinding

__all__ = ["CollectiveCounter", "agree", "agree_digest", "failure_vote", "failure_vote_on_group"]


def failure_vote(binding: ProcessGroupBinding | None, phase: str, error: BaseException | None) -> None:
    """Vote on whether ``phase`` failed anywhere; raise on every member if it did.

    With no binding or a one-member scope the local error is re-raised unchanged (no
    collective). Otherwise one ``all_reduce(MAX)`` of an int32 flag runs on the binding's
    group and device. The failing member's message carries its error; the others say the
    phase failed on another member.
    """
    if binding is None or not binding.communicates:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=binding.collective_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=binding.process_group)
    if int(flag.item()) == 0:
        return
    if error is not None:
        raise CollectiveFailureError(
            f"{phase} failed on local member {binding.local_member!r}: {type(error).__name__}: {error}",
            phase=phase,
            local=True,
        ) from error
    raise CollectiveFailureError(f"{phase} failed on another process-group member", phase=phase, local=False)


def failure_vote_on_group(
    process_group: Any,
    device: torch.device | str,
    phase: str,
    error: BaseException | None,
    *,
    member: str,
) -> None:
    """:func:`failure_vote` over a raw process group (for example a DTensor mesh's group).

    ``member`` names this process in the failing member's message. ``process_group=None``
    means the default world; with a world of one (or no distributed run) the local error is
    re-raised unchanged.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) <= 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=torch.device(device))
    # every member votes, failed or not: skipping the call on a failure would hang the others
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
    if int(flag.item()) == 0:
        return
    if error is not None:
        raise CollectiveFailureError(
            f"{phase} failed on local member {member!r}: {type(error).__name__}: {error}", phase=phase, local=True
        ) from error
    raise CollectiveFailureError(f"{phase} failed on another process-group member", phase=phase, local=False)


def agree(binding: ProcessGroupBinding | None, values: Sequence[int], *, what: str) -> None:
    """Require every member to hold the same int64 ``values`` (one ``all_gather``).

    Raises ``ContractError`` on every member (each sees the same gathered data) naming
    ``what`` and the first disagreeing member.
    """
    if binding is None or not binding.communicates:
        return
    import torch.distributed as dist

    local = torch.tensor(list(values), dtype=torch.int64, device=binding.collective_device)
    gathered = [torch.empty_like(local) for _ in range(binding.member_count)]
    # gather, not a reduce: every member sees the same data, so every member raises the same error
    dist.all_gather(gathered, local, group=binding.process_group)
    first = gathered[0]
    for index, other in enumerate(gathered[1:], start=1):
        if not torch.equal(first, other):
            member = binding.identity.ordered_members[index]
            raise ContractError(f"process-group members disagree on {what} (member {member!r} differs from member 0)")


def agree_digest(binding: ProcessGroupBinding | None, hexdigest: str, *, what: str) -> None:
    """Require every member to hold the same SHA-256 ``hexdigest`` (as four int64)."""
    raw = bytes.fromhex(hexdigest)
    if len(raw) != 32:
        raise ContractError("agree_digest needs a SHA-256 hex digest")
    # signed: int64 tensors cannot hold the upper half of an unsigned 64-bit word
    values = [int.from_bytes(raw[i : i + 8], "big", signed=True) for i in range(0, 32, 8)]
    agree(binding, values, what=what)


_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)


class CollectiveCounter:
    """Counts calls to ``torch.distributed`` collectives while active (a test instrument).

    Use :meth:`patched` as a context manager; ``calls`` maps function name to count and
    ``total`` sums them. Wrapping is by module attribute, so code calling
    ``torch.distributed.<fn>`` (or ``dist.<fn>``) is counted.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    @contextmanager
    def patched(self) -> Iterator[CollectiveCounter]:
        import torch.distributed as dist

        originals: dict[str, Any] = {}
        for name in _COUNTED:
            original = getattr(dist, name, None)
            if original is None:
                continue
            originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return counted

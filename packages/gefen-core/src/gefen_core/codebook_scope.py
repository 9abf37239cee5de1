"""The learned-codebook process-group scope: phases and the collective rounds of its protocol.

With a :class:`~gefen_contracts.torch_support.CodebookProcessGroupBinding` installed by
``post_sharding(..., scope=binding)``, every member of the scope learns the same codebook
from one histogram in which each logical parameter counts once, and every operation that
could branch on local state is agreed first. This module holds what ``Gefen`` and
``GefenMuon`` share: the phase names, the operation header and the
small collectives that carry a failure flag. :mod:`gefen_core.scoped_learning` learns over
the scope and :mod:`gefen_core.scoped_step` drives ``step()``, ``initialize_collective_state()``
and ``refresh_collective_state()``.

**The header** (one ``all_gather`` of :data:`HEADER_SIZE` int64 per operation, before any
rank-dependent branch) carries the protocol version, the operation, this member's local
failure (the code of the first failed phase: entry checks, closure, gradient preflight, AMP
read), the global step, a SHA-256 of the codebook, a fingerprint of the scope, manifest and
optimizer policy (fixed at ``post_sharding``), a digest of which shared parameters have
gradients, the gradient scaler's ``found_inf`` / ``grad_scale`` and two "needs learning"
bits. Every member sees every row, so all of them take the same decision: raise the same
:class:`~gefen_contracts.CollectiveFailureError` when some member failed, the same
:class:`~gefen_core.errors.ShardAgreementError` on any disagreement, skip the step together
on an agreed overflow, and learn together when some member needs it.

**Collective budget** (host-synchronising collectives of the protocol, multi-member scopes):

=========================================  ==================================================
operation                                  collectives
=========================================  ==================================================
steady ``step()`` (no closure)             1: the header
steady ``step(closure)``                   2: an entry vote before the closure, the header
learning ``step()`` (a first non-zero      header, a non-zero vote, one gradient gather per
gradient, the codebook, a due refresh)     bucket of starting flattened parameters, the
                                           histogram (when a codebook is learned), the commit
``initialize_collective_state()``          header; when no codebook exists: non-zero vote,
                                           gathers, histogram, commit
``refresh_collective_state()``             header, histogram, commit
=========================================  ==================================================

Every collective after the header carries the accumulated failure flag of the sender, so a
member that fails in a later phase (period selection, histogram and solve, re-quantisation,
commit staging) joins the next collective with its flag set and every member raises there;
nothing is published before the commit vote. One-member scopes run no collective and
re-raise local errors unchanged.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gefen_contracts import CollectiveFailureError
from gefen_contracts.torch_support import ProcessGroupBinding

from .errors import ShardAgreementError

__all__ = [
    "AMP_PHASE",
    "CLOSURE_PHASE",
    "COMMIT_PHASE",
    "ENTRY_PHASE",
    "HEADER_SIZE",
    "HISTOGRAM_PHASE",
    "INITIALIZE_PREAMBLE_PHASE",
    "NEEDS_GRAD",
    "NEEDS_NONZERO",
    "NEEDS_START",
    "OP_INITIALIZE",
    "OP_REFRESH",
    "OP_STEP",
    "PERIOD_PHASE",
    "PHASES",
    "PREFLIGHT_PHASE",
    "REFRESH_PREAMBLE_PHASE",
    "REQUANTIZE_PHASE",
    "STEADY_STEP_BUDGET",
    "AmpReading",
    "Failure",
    "HeaderAgreement",
    "codebook_digest",
    "commit_agreement",
    "digest_words",
    "entry_vote",
    "share_header",
    "read_amp",
    "reduce_with_failure",
]

ENTRY_PHASE = "entry checks"
CLOSURE_PHASE = "closure"
PREFLIGHT_PHASE = "gradient preflight"
AMP_PHASE = "AMP agreement"
PERIOD_PHASE = "period selection"
HISTOGRAM_PHASE = "histogram and solve"
REQUANTIZE_PHASE = "re-quantisation"
REFRESH_PREAMBLE_PHASE = "refresh preamble"
INITIALIZE_PREAMBLE_PHASE = "initialize preamble"
COMMIT_PHASE = "commit"

#: Every phase a local failure is voted in, in protocol order (index + 1 is its header code).
PHASES: tuple[str, ...] = (
    ENTRY_PHASE,
    CLOSURE_PHASE,
    PREFLIGHT_PHASE,
    AMP_PHASE,
    PERIOD_PHASE,
    HISTOGRAM_PHASE,
    REQUANTIZE_PHASE,
    REFRESH_PREAMBLE_PHASE,
    INITIALIZE_PREAMBLE_PHASE,
    COMMIT_PHASE,
)

#: The most host-synchronising collectives a steady-state scoped ``step()`` runs.
STEADY_STEP_BUDGET = 2

OP_STEP, OP_INITIALIZE, OP_REFRESH = 1, 2, 3
_OPERATIONS = {OP_STEP: "step", OP_INITIALIZE: "initialize", OP_REFRESH: "refresh"}

#: Header "needs" bits: a stateless parameter with a locally non-zero gradient; (asked only
#: while no codebook exists) any locally non-zero gradient; any gradient at all.
NEEDS_START, NEEDS_NONZERO, NEEDS_GRAD = 1, 2, 4

_MAGIC = 0x4746_5331  # "GFS1": the header layout below, version 1
_MAGIC_AT, _OP_AT, _FAIL_AT, _STEP_AT = 0, 1, 2, 3
_CODEBOOK_AT = slice(4, 8)
_STATIC_AT = slice(8, 12)
_PRESENCE_AT = slice(12, 14)
_AMP_FLAGS_AT, _FOUND_INF_AT, _SCALE_AT, _NEEDS_AT = 14, 15, 16, 17
HEADER_SIZE = 18

# -- local records ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Failure:
    """A local error and the phase it happened in (carried to the next collective round)."""

    phase: str
    error: BaseException

    @property
    def code(self) -> int:
        return PHASES.index(self.phase) + 1


@dataclass(frozen=True, slots=True)
class AmpReading:
    """The gradient scaler's protocol as this member sees it (all zero without a scaler)."""

    found_inf_present: bool = False
    overflow: bool = False
    scale: float | None = None

    @property
    def inverse(self) -> float | None:
        """``fl32(1 / scale)``, what unscaling multiplies gradients by (``None`` without a scale)."""
        if self.scale is None:
            return None
        return float(torch.tensor(1.0 / self.scale, dtype=torch.float32))

    def words(self) -> list[int]:
        flags = int(self.found_inf_present) | (int(self.scale is not None) << 1)
        bits = struct.unpack("<q", struct.pack("<d", 0.0 if self.scale is None else self.scale))[0]
        return [flags, int(self.overflow), bits]


def read_amp(optimizer: object) -> AmpReading:
    """Read ``found_inf`` / ``grad_scale`` set by ``torch.amp.GradScaler`` (no scaler: nothing)."""
    found = getattr(optimizer, "found_inf", None)
    scale = getattr(optimizer, "grad_scale", None)
    overflow = found is not None and float(found.sum().item()) > 0.0
    value: float | None = None
    if scale is not None:
        value = float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)
        if not math.isfinite(value) or value <= 0:
            raise RuntimeError(f"GradScaler passed a non-finite or non-positive scale {value}")
    return AmpReading(found is not None, overflow, value)


def digest_words(data: bytes, words: int = 4) -> list[int]:
    """The first ``words`` signed big-endian int64 of SHA-256(``data``)."""
    raw = hashlib.sha256(data).digest()
    return [int.from_bytes(raw[i * 8 : i * 8 + 8], "big", signed=True) for i in range(words)]


def codebook_digest(codebook: torch.Tensor | None) -> list[int]:
    """Four int64 of SHA-256 over the codebook's bytes (zeros when there is none)."""
    if codebook is None:
        return [0, 0, 0, 0]
    return digest_words(codebook.detach().cpu().contiguous().numpy().tobytes())


# -- raising the same error everywhere ------------------------------------------------------------


def _raise(binding: ProcessGroupBinding, who: str, local: Failure | None, remote: str | None) -> None:
    if local is not None:
        label = f"{who}: {local.phase}"
        raise CollectiveFailureError(
            f"{label} failed on local member {binding.local_member!r}: {type(local.error).__name__}: {local.error}",
            phase=label,
            local=True,
        ) from local.error
    label = f"{who}: {remote}"
    raise CollectiveFailureError(f"{label} failed on another process-group member", phase=label, local=False)


def _local_only(failure: Failure | None) -> None:
    if failure is not None:
        raise failure.error


def entry_vote(binding: ProcessGroupBinding | None, failure: Failure | None, who: str) -> None:
    """One ``all_reduce(MAX)`` before a closure runs, so no member runs it after a peer failed."""
    if binding is None or not binding.communicates:
        _local_only(failure)
        return
    import torch.distributed as dist

    flag = torch.tensor([0 if failure is None else failure.code], dtype=torch.int64, device=binding.collective_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=binding.process_group)
    code = int(flag.item())
    if code:
        _raise(binding, who, failure, PHASES[code - 1])


# -- the header -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeaderAgreement:
    """What every member agreed in the header round (identical on every member)."""

    codebook_present: bool
    overflow: bool
    needs: int
    scale: float | None

    def any_needs(self, bit: int) -> bool:
        return bool(self.needs & bit)


def share_header(
    binding: ProcessGroupBinding | None,
    *,
    operation: int,
    failure: Failure | None,
    global_step: int,
    codebook: torch.Tensor | None,
    static: Sequence[int],
    presence: bytes,
    amp: AmpReading,
    needs: int,
    who: str,
) -> HeaderAgreement:
    """Share the operation header (one ``all_gather``) and check every member's row.

    Raises :class:`~gefen_contracts.CollectiveFailureError` on every member when a member
    reports a local failure, and :class:`~gefen_core.errors.ShardAgreementError` when the
    members disagree on the operation, scope, manifest, policy, global step, codebook,
    gradient presence or gradient scaler state. Without a communicating scope the local
    failure is re-raised unchanged and the local values are the agreement.
    """
    values = [0] * HEADER_SIZE
    values[_MAGIC_AT], values[_OP_AT] = _MAGIC, operation
    values[_FAIL_AT] = 0 if failure is None else failure.code
    values[_STEP_AT] = global_step
    values[_CODEBOOK_AT] = codebook_digest(codebook)
    values[_STATIC_AT] = list(static)
    values[_PRESENCE_AT] = digest_words(presence, 2)
    values[_AMP_FLAGS_AT], values[_FOUND_INF_AT], values[_SCALE_AT] = amp.words()
    values[_NEEDS_AT] = needs
    if binding is None or not binding.communicates:
        _local_only(failure)
        return HeaderAgreement(codebook is not None, amp.overflow, needs, amp.scale)
    import torch.distributed as dist

    local = torch.tensor(values, dtype=torch.int64, device=binding.collective_device)
    gathered = [torch.empty_like(local) for _ in range(binding.member_count)]
    dist.all_gather(gathered, local, group=binding.process_group)
    rows = [row.tolist() for row in gathered]
    failed = [row[_FAIL_AT] for row in rows if row[_FAIL_AT]]
    if any(row[_MAGIC_AT] != _MAGIC for row in rows):
        raise ShardAgreementError(
            f"{who}: a member of scope {binding.identity.semantic_name!r} runs another version of the scope protocol"
        )
    if failed:
        _raise(binding, who, failure, PHASES[failed[0] - 1] if 0 < failed[0] <= len(PHASES) else "a phase")
    _check_rows(binding, rows, who)
    needs_all = 0
    for row in rows:
        needs_all |= row[_NEEDS_AT]
    first = rows[0]
    return HeaderAgreement(first[_CODEBOOK_AT] != [0, 0, 0, 0], bool(first[_FOUND_INF_AT]), needs_all, amp.scale)


def _differs(rows: list[list[int]], where: int | slice) -> int | None:
    """The first member whose ``where`` differs from member 0's, or ``None``."""
    for index, row in enumerate(rows[1:], start=1):
        if row[where] != rows[0][where]:
            return index
    return None


def _check_rows(binding: ProcessGroupBinding, rows: list[list[int]], who: str) -> None:
    members = binding.identity.ordered_members
    checks: list[tuple[int | slice, str]] = [
        (_OP_AT, "run different operations (every member must call the same method: step, initialize or refresh)"),
        (
            _STATIC_AT,
            "hold different scopes, manifests or optimizer policies (every member must finalize with the same "
            "manifest, scope, deterministic policy, refresh schedule and stochastic rounding)",
        ),
        (_STEP_AT, "are at different global steps (a checkpoint was loaded on some members only?)"),
        (_CODEBOOK_AT, "hold different codebooks (the old codebook differs; load the same checkpoint everywhere)"),
        (
            _PRESENCE_AT,
            "attach gradients to different parameters (every member must give a gradient, possibly empty, to the "
            "same replicated and flattened parameters)",
        ),
        (
            slice(_AMP_FLAGS_AT, _SCALE_AT + 1),
            "see different gradient-scaler states (found_inf or grad_scale); use a group-aware gradient scaler "
            "(torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler) so every member takes the same "
            "overflow decision",
        ),
    ]
    for where, what in checks:
        index = _differs(rows, where)
        if index is not None:
            names = _OPERATIONS.get(rows[0][_OP_AT], "?"), _OPERATIONS.get(rows[index][_OP_AT], "?")
            detail = f" ({names[0]} vs {names[1]})" if where == _OP_AT else ""
            raise ShardAgreementError(
                f"{who}: the members of scope {binding.identity.semantic_name!r} {what}: member {members[index]!r} "
                f"differs from member {members[0]!r}{detail}"
            )


# -- collectives after the header ------------------------------------------------------------------


def reduce_with_failure(
    binding: ProcessGroupBinding | None,
    values: torch.Tensor,
    *,
    maximum: bool,
    failure: Failure | None,
    phase: str,
    who: str,
) -> torch.Tensor:
    """``all_reduce`` (SUM, or MAX with ``maximum``) of an int64 vector plus a failure slot.

    Returns the reduced vector (on the CPU). A failure anywhere (this member's ``failure``
    included) raises on every member; a failing member contributes zeros.
    """
    if binding is None or not binding.communicates:
        _local_only(failure)
        return values
    import torch.distributed as dist

    payload = torch.zeros(values.numel() + 1, dtype=torch.int64)
    if failure is None:
        payload[:-1] = values.reshape(-1)
    else:
        payload[-1] = 1
    payload = payload.to(binding.collective_device)
    dist.all_reduce(payload, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM, group=binding.process_group)
    reduced = payload.cpu()
    if int(reduced[-1]):
        _raise(binding, who, failure, phase)
    return reduced[:-1].clone()


def commit_agreement(
    binding: ProcessGroupBinding | None,
    *,
    failure: Failure | None,
    agreed: Sequence[int],
    what: str,
    who: str,
) -> None:
    """The last collective before publication: one ``all_gather`` of ``[failure code, agreed...]``.

    Every member raises if any member failed since the previous collective round (the failing member
    with its own error and phase), or if ``agreed`` (digests of the new codebook and of the
    periods every member chose for shared parameters) differs between members.
    """
    if binding is None or not binding.communicates:
        _local_only(failure)
        return
    import torch.distributed as dist

    row = [0 if failure is None else failure.code, *agreed]
    local = torch.tensor(row, dtype=torch.int64, device=binding.collective_device)
    gathered = [torch.empty_like(local) for _ in range(binding.member_count)]
    dist.all_gather(gathered, local, group=binding.process_group)
    rows = [item.tolist() for item in gathered]
    codes = [r[0] for r in rows if r[0]]
    if codes:
        _raise(binding, who, failure, PHASES[codes[0] - 1] if 0 < codes[0] <= len(PHASES) else "a phase")
    index = _differs([r[1:] for r in rows], slice(0, None))
    if index is not None:
        members = binding.identity.ordered_members
        raise ShardAgreementError(
            f"{who}: the members of scope {binding.identity.semantic_name!r} disagree on {what}: member "
            f"{members[index]!r} differs from member {members[0]!r}; nothing was changed"
        )

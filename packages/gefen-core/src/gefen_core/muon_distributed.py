"""GefenMuon under FSDP2 / DTensor: execution modes, owners, the collective scope, votes and
the per-step agreement.

**Modes.** A parameter that is not a row-sharded DTensor (a plain tensor, a ``Replicate()``
DTensor, or a ``Shard(0)`` DTensor on a one-member mesh) always takes the ``"local"`` path:
the whole matrix is on this process. A ``Shard(0)`` DTensor on a mesh of two or more members
takes its group's ``sharded_mode``:

* ``"exact"``: every rank all-gathers the full gradient and computes the whole update
  redundantly, with full-matrix state on every rank; each rank writes its rows. On
  identical hardware this is bit-identical to one process on the same full gradients.
* ``"approx"``: each rank runs Muon on its local rows only (rank-local state, no
  collectives); cheaper, and not equal to one process.
* ``"distributed"``: the matrix's **owner** (its stable index among the optimizer's
  distributed parameters, counting those without gradients, modulo the world size) receives
  the full gradient, computes the update and sends every rank its rows; full-matrix state
  lives on the owner only. Equal to ``"exact"`` bit for bit; the Newton-Schulz work is spread
  over the ranks.

**Scope.** The row-sharded ``"exact"`` / ``"distributed"`` parameters of one optimizer must
share one device mesh (one process group); that group is the *scope* over which failures are
voted and the step is agreed. ``"approx"`` and local parameters need no collective.

**Votes.** Before each collective a local failure is voted with
:func:`gefen_contracts.torch_support.failure_vote_on_group`, so every member raises a
:class:`~gefen_contracts.CollectiveFailureError` (the failing member's message carries its
error; the others say the phase failed on another member) instead of waiting forever.

**Agreement** (:func:`agree_step`, one ``all_gather`` of a small int64 header per step): the
members compare a digest of the ordered ``(name, shape, dtype)`` list of the scope's
parameters and of the codebook (exact and distributed updates need the same one), a digest
of which of them have gradients, and the gradient scaler's state
(``found_inf`` / ``grad_scale`` presence and values). Any difference raises the same
:class:`~gefen_core.errors.ShardAgreementError` on every member; a gradient-presence
difference costs one more ``all_reduce`` to name the parameters and how many ranks have them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .distributed import is_row_sharded, shard_rows
from .errors import ParameterError, ShardAgreementError

__all__ = [
    "APPROX",
    "DISTRIBUTED",
    "EXACT",
    "LOCAL",
    "AmpAgreement",
    "MuonScope",
    "ScopeEntry",
    "agree_step",
    "build_scope",
    "execution_mode",
    "shard_rows",
    "vote",
]

LOCAL, EXACT, APPROX, DISTRIBUTED = "local", "exact", "approx", "distributed"
_PHASE_PREFIX = "GefenMuon "


def execution_mode(param: torch.Tensor, sharded_mode: str) -> str:
    """``"local"``, or the group's mode for a row-sharded DTensor on a mesh of two or more."""
    if not is_row_sharded(param) or int(param.device_mesh.size()) < 2:  # type: ignore[attr-defined]
        return LOCAL
    return sharded_mode


@dataclass(frozen=True, slots=True)
class MuonScope:
    """The process group of the optimizer's exact/distributed DTensors, and this rank's place in it."""

    group: Any
    device: torch.device
    world: int
    rank: int
    global_ranks: tuple[int, ...]

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]


def build_scope(params: Sequence[tuple[torch.Tensor, str]], where: Sequence[str]) -> MuonScope | None:
    """The scope of ``(parameter, mode)`` pairs (``None`` when no exact/distributed DTensor).

    Raises :class:`ParameterError` when those parameters live on different meshes.
    """
    import torch.distributed as dist

    scope: MuonScope | None = None
    for (param, mode), label in zip(params, where):
        if mode in (LOCAL, APPROX):  # an unknown (corrupted) mode counts: its error must be voted
            continue
        mesh = param.device_mesh  # type: ignore[attr-defined]
        group = mesh.get_group()
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
        coordinate = int(mesh.get_local_rank())
        if dist.get_rank(group) != coordinate:
            raise ParameterError(f"{label}: the mesh's coordinate order differs from its process group's rank order")
        if scope is None:
            device = torch.device(mesh.device_type)
            if device.type == "cuda":
                device = torch.device("cuda", torch.cuda.current_device())
            scope = MuonScope(group, device, len(ranks), coordinate, ranks)
        elif ranks != scope.global_ranks:
            raise ParameterError(
                f"{label}: every exact/distributed DTensor of a GefenMuon must live on one device mesh "
                f"(found ranks {list(ranks)} and {list(scope.global_ranks)})"
            )
    return scope


def vote(scope: MuonScope | None, phase: str, error: BaseException | None) -> None:
    """Raise on every member of ``scope`` if ``phase`` failed on any (re-raise locally without a scope)."""
    if scope is None:
        if error is not None:
            raise error
        return
    import torch.distributed as dist
    from gefen_contracts.torch_support import failure_vote_on_group

    failure_vote_on_group(scope.group, scope.device, _PHASE_PREFIX + phase, error, member=f"rank {dist.get_rank()}")


@dataclass(frozen=True, slots=True)
class ScopeEntry:
    """One exact/distributed DTensor of the scope, as every member must see it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    has_grad: bool


@dataclass(frozen=True, slots=True)
class AmpAgreement:
    """What the members agreed about the gradient scaler: skip the step (overflow) or not."""

    skip: bool


def _digest(parts: Sequence[str]) -> list[int]:
    raw = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return [int.from_bytes(raw[i : i + 8], "big", signed=True) for i in (0, 8)]


def _amp_fields(optimizer: object) -> list[int]:
    present = hasattr(optimizer, "found_inf")
    found = getattr(optimizer, "found_inf", None)
    overflow = int(found is not None and float(found.sum().item()) > 0.0)
    scale = getattr(optimizer, "grad_scale", None)
    value = 0.0 if scale is None else float(scale.item() if isinstance(scale, torch.Tensor) else scale)
    bits = struct.unpack("<q", struct.pack("<d", value))[0]
    return [int(present), overflow, int(scale is not None), bits]


def _local_amp(optimizer: object) -> AmpAgreement:
    found = getattr(optimizer, "found_inf", None)
    return AmpAgreement(found is not None and float(found.sum().item()) > 0.0)


def agree_step(
    scope: MuonScope | None, entries: Sequence[ScopeEntry], optimizer: object, codebook: torch.Tensor | None
) -> AmpAgreement:
    """Check that every member takes the same step (module docstring); return the AMP decision."""
    if scope is None:
        return _local_amp(optimizer)
    import torch.distributed as dist

    learned = "none" if codebook is None else hashlib.sha256(codebook.detach().cpu().numpy().tobytes()).hexdigest()
    structure = _digest([f"{e.name}|{tuple(e.shape)}|{e.dtype}" for e in entries] + [learned])
    presence = _digest(["1" if e.has_grad else "0" for e in entries])
    header = torch.tensor(
        [len(entries), *structure, *presence, *_amp_fields(optimizer)], dtype=torch.int64, device=scope.device
    )
    gathered = [torch.empty_like(header) for _ in range(scope.world)]
    dist.all_gather(gathered, header, group=scope.group)
    rows = [g.tolist() for g in gathered]
    if any(row[:3] != rows[0][:3] for row in rows):
        raise ShardAgreementError(
            "GefenMuon: the ranks of the mesh hold different sharded parameters (names, registration order, "
            "shapes or dtypes differ) or different codebooks (a checkpoint loaded on some ranks only?); every rank "
            "must build the optimizer over the same parameters in the same order and load the same state"
        )
    if any(row[3:5] != rows[0][3:5] for row in rows):
        bits = torch.tensor([int(e.has_grad) for e in entries], dtype=torch.int64, device=scope.device)
        dist.all_reduce(bits, op=dist.ReduceOp.SUM, group=scope.group)
        counts = bits.tolist()
        uneven = [f"{e.name!r} ({c}/{scope.world} mesh ranks have gradients)" for e, c in zip(entries, counts)]
        uneven = [text for text, c in zip(uneven, counts) if 0 < c < scope.world]
        raise ShardAgreementError(
            "GefenMuon: gradient presence differs across the mesh for " + ", ".join(uneven) + "; every rank must "
            "step the same sharded parameters"
        )
    names = ("found_inf presence (the AMP protocol)", "found_inf", "grad_scale presence", "grad_scale")
    for offset, what in enumerate(names):
        column = 5 + offset
        if any(row[column] != rows[0][column] for row in rows):
            raise ShardAgreementError(
                f"GefenMuon: the gradient scaler's {what} differs across the mesh; use a group-aware gradient "
                "scaler (torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler) so every rank sees the same "
                "overflow decision"
            )
    return AmpAgreement(bool(rows[0][6]))

"""Rank functions for tests/test_dcp_hybrid_bound.py (run inside GlooWorld ranks).

Members and the driver model's all-gather are tests/bound_members.py's. Each member's
``GefenMuonHybrid`` (Gefen or ContractedAdamW backup) is either a single-process hybrid over
the driver itself (one member) or one finalized with ``post_sharding`` onto this member's
pieces under a codebook scope: the backup's embedding and head as flattened slices, its bias
replicated, the Muon matrices whole-parameter owners or replicated.

A case trains the 2-member layout, saves it with ``save_portable_dcp`` (each member writes
its own fragments), then continues four runs from the same checkpointed parameters: the
source itself (uninterrupted), a twin of the source layout loaded with ``load_portable_dcp``
(must be bit-exact), the target layout loaded with ``load_portable_dcp`` (resumed) and the
target layout without the optimizer state (dropped).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from bound_members import BoundMember, Spec, even_cuts, process_group
from bound_members import checkpoint_binding as _binding
from gefen import GefenMuonHybrid
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing.gloo_members import share
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_dcp import GefenFileSystemWriter, load_portable_dcp, save_portable_dcp
from torch.distributed.checkpoint import FileSystemReader

LIMITS = PortableStateLimits(chunk_bytes=2048)  # several chunks per fragment field
BEFORE = 6
AFTER = 20
_PREFIX = "tests.hdcp"


class Net(torch.nn.Module):
    """Backup: an embedding (2048 elements), a head and a bias; Muon: three hidden matrices.

    Two-member cuts of the flattened backup tensors fall on block boundaries; near-even cuts
    in three do not (the Gefen backup re-blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(64, 32) * 0.5)
        self.a = torch.nn.Parameter(torch.randn(32, 48) * 0.2)
        self.b = torch.nn.Parameter(torch.randn(48, 48) * 0.2)
        self.c = torch.nn.Parameter(torch.randn(48, 32) * 0.2)
        self.lm_head = torch.nn.Parameter(torch.randn(16, 32) * 0.2)
        self.bias = torch.nn.Parameter(torch.zeros(16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        hidden = torch.tanh(torch.tanh(torch.tanh(hidden @ self.a) @ self.b) @ self.c)
        return hidden @ self.lm_head.T + self.bias

    def loss(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(300 + step)
        tokens = torch.randint(0, 64, (8, 5), generator=generator)
        target = torch.randn(8, 16, generator=generator)
        return torch.nn.functional.mse_loss(self(tokens), target)


def driver() -> Net:
    torch.manual_seed(0)
    return Net()


def hybrid(named: Any, backup: str) -> GefenMuonHybrid:
    # Block-shared v for the Gefen backup's matrices: a flattened matrix keeps block v, so with
    # the default factored v a move onto one process converts the representation (not exact);
    # the exact cases of this module are about blocks surviving the move.
    extra = {"backup_kwargs": {"factored_v_2d": False}} if backup == "gefen" else {}
    return GefenMuonHybrid(named, lr=1e-2, weight_decay=0.01, backup_optimizer=backup, fused=False, **extra)


# -- layouts -----------------------------------------------------------------------------------------


def layout(members: int) -> Spec:
    """The backup's embedding and head flattened, its bias replicated; Muon's matrices owned
    (two members: ``a`` by 0, ``b`` by 1, ``c`` replicated; three: ``a`` replicated, ``b`` by 2,
    ``c`` by 1)."""
    backup: Spec = {
        "embed": ("flat", even_cuts(64 * 32, members)),
        "lm_head": ("flat", even_cuts(16 * 32, members)),
        "bias": ("repl", None),
    }
    if members == 2:
        return {**backup, "a": ("owner", 0), "b": ("owner", 1), "c": ("repl", None)}
    return {**backup, "a": ("repl", None), "b": ("owner", 2), "c": ("owner", 1)}


def checkpoint_binding(rank: int, size: int) -> CheckpointProcessGroupBinding:
    return _binding(_PREFIX, rank, size)


class Member(BoundMember):
    """One member's hybrid over the driver: single-process (``size == 1``) or bound."""

    def __init__(self, backup: str, model: Net, rank: int, size: int) -> None:
        super().__init__(
            model,
            model.loss,
            lambda named: hybrid(named, backup),
            prefix=_PREFIX,
            rank=rank,
            size=size,
            spec=None if size == 1 else layout(size),
        )

    def load(self, rank: int, path: str, transaction: str) -> None:
        load_portable_dcp(
            self.optimizer,
            checkpoint_process_group=checkpoint_binding(rank, self.size),
            storage_reader=FileSystemReader(path),
            transaction_id=transaction,
            limits=LIMITS,
        )


def _at(values: dict[str, torch.Tensor]) -> Net:
    model = driver()
    model.load_state_dict(values)
    return model


def save_and_reshard(rank: int, world: int, backup: str, target_size: int, path: str) -> dict[str, Any]:
    """The case of the module docstring: 2 members -> ``target_size`` members through DCP."""
    process_group(2)
    in_source, in_target = rank < 2, rank < target_size
    model = driver()
    source = Member(backup, model, rank, 2) if in_source else None
    if source is not None:
        source.train(0, BEFORE)
        save_portable_dcp(
            source.optimizer,
            checkpoint_process_group=checkpoint_binding(rank, 2),
            storage_writer=GefenFileSystemWriter(path),
            transaction_id="save",
            limits=LIMITS,
        )
    checkpoint = share({n: p.detach().clone() for n, p in model.named_parameters()})
    dist.barrier()
    outcome: dict[str, Any] = {}
    if source is not None:
        twin = Member(backup, _at(checkpoint), rank, 2)
        twin.load(rank, path, "same-layout")
        outcome["uninterrupted"] = source.train(BEFORE, AFTER)
        outcome["twin"] = twin.train(BEFORE, AFTER)
        outcome["twin_bit_exact"] = twin.bits() == source.bits()
    if in_target:
        resumed = Member(backup, _at(checkpoint), rank, target_size)
        resumed.load(rank, path, "reshard")
        outcome["resumed"] = resumed.train(BEFORE, AFTER)
        dropped = Member(backup, _at(checkpoint), rank, target_size)
        outcome["dropped"] = dropped.train(BEFORE, AFTER)
    dist.barrier()
    return outcome

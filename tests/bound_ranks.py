"""Rank functions for tests/test_bound_resharding.py (run inside GlooWorld ranks).

Members, layouts and the driver model's all-gather are tests/bound_members.py's: a
single-process ``Gefen``/``GefenMuon`` over the driver (size 1) or one finalized with
``post_sharding`` onto this member's pieces under a codebook scope.

A case trains the source layout, exports its portable state through gefen-portable, then
continues four runs from the same checkpointed parameters: the source itself (uninterrupted),
a twin of the source layout that imported the state (bit-exact), the target layout that
imported it (resumed) and the target layout without it (dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from bound_members import BoundMember, Spec, even_cuts, process_group
from bound_members import checkpoint_binding as _binding
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing.gloo_members import share
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_core import Gefen, GefenMuon
from gefen_portable import PortableState, export_portable_state, import_portable_state

LIMITS = PortableStateLimits(chunk_bytes=4096)  # several chunks per field
BEFORE = 6
AFTER = 20
_PREFIX = "tests.bound"


# -- models and data ---------------------------------------------------------------------------------


class Net(torch.nn.Module):
    """Gefen's model: an embedding and a bias (replicated), two 4096-element matrices and a
    4 x 3104 one (flattened). Cuts at 2048 and halves of the wide matrix fall on block
    boundaries for every period; near-even cuts in three do not, and thirds of the wide matrix
    (4139 and 4138 = 2 x 2069 elements) take ragged blocks of 2048."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(16, 32) * 0.5)
        self.up = torch.nn.Parameter(torch.randn(128, 32) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(128, 32) * 0.1)
        self.bias = torch.nn.Parameter(torch.zeros(32))
        self.wide = torch.nn.Parameter(torch.randn(4, 3104) * 0.1)
        self.register_buffer("mix", torch.randn(3104, 32) * 0.01, persistent=False)  # seeded alike everywhere

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed[tokens].mean(dim=1)
        wide = torch.tanh(self.wide).sum(dim=0) @ self.mix
        return torch.tanh(hidden @ self.up.T) @ self.down + self.bias + wide

    @staticmethod
    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, 16, (8, 5), generator=generator)
        target = torch.randn(8, 32, generator=generator)
        return torch.nn.functional.mse_loss(model(tokens), target)


class Matrices(torch.nn.Module):
    """GefenMuon's model: three matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(24, 16) * 0.2)
        self.b = torch.nn.Parameter(torch.randn(16, 24) * 0.2)
        self.c = torch.nn.Parameter(torch.randn(24, 24) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ self.c) @ self.a) @ self.b

    @staticmethod
    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(500 + step)
        x = torch.randn(6, 24, generator=generator)
        target = torch.randn(6, 24, generator=generator)
        return torch.nn.functional.mse_loss(model(x), target)


@dataclass(frozen=True)
class Kind:
    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[Any], Any]


KINDS = {
    "gefen": Kind(Net, lambda named: Gefen(named, lr=1e-2, fused=False, factored_v_2d=False)),
    "muon": Kind(Matrices, lambda named: GefenMuon(named, lr=2e-2, fused=False)),
    # a flattened piece of a matrix is 1-D, but the step forces period 1 by the matrix's rank
    "gefen_forced_1d": Kind(
        Net, lambda named: Gefen(named, lr=1e-2, fused=False, factored_v_2d=False, force_1d_period_one=True)
    ),
}


def driver(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return KINDS[kind].model()


# -- layouts -----------------------------------------------------------------------------------------


def gefen_layout(members: int) -> Spec:
    cuts = even_cuts(4096, members)
    wide = even_cuts(4 * 3104, members)
    return {
        "embed": ("repl", None),
        "up": ("flat", cuts),
        "down": ("flat", cuts),
        "bias": ("repl", None),
        "wide": ("flat", wide),
    }


MUON_LAYOUTS: dict[str, Spec] = {
    "two_owners": {"a": ("owner", 0), "b": ("owner", 1), "c": ("repl", None)},
    "three_owners": {"a": ("repl", None), "b": ("owner", 2), "c": ("owner", 1)},
}


def checkpoint_binding(rank: int, size: int) -> CheckpointProcessGroupBinding:
    return _binding(_PREFIX, rank, size)


def member(kind: str, model: torch.nn.Module, rank: int, size: int, spec: Spec | None) -> BoundMember:
    """One member's ``kind`` optimizer over the driver ``model``."""
    loss = KINDS[kind].model.loss  # type: ignore[attr-defined]
    return BoundMember(
        model, lambda step: loss(model, step), KINDS[kind].optimizer, prefix=_PREFIX, rank=rank, size=size, spec=spec
    )


def _at(kind: str, values: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = driver(kind)
    model.load_state_dict(values)
    return model


def _import(runner: BoundMember, state: Any, rank: int, size: int, transaction: str) -> None:
    import_portable_state(
        runner.optimizer,
        state,
        checkpoint_process_group=checkpoint_binding(rank, size),
        transaction_id=transaction,
        limits=LIMITS,
    )


def reshard(rank: int, world: int, kind: str, source: tuple[int, str], target: tuple[int, str]) -> dict[str, Any]:
    """The case of the module docstring: ``source`` and ``target`` are ``(members, layout name)``
    (``gefen_layout(members)`` for Gefen; a name of :data:`MUON_LAYOUTS` for GefenMuon)."""
    process_group(2)

    def spec(members: int, name: str) -> Spec | None:
        if members == 1:
            return None
        return gefen_layout(members) if kind.startswith("gefen") else MUON_LAYOUTS[name]

    (src_size, src_name), (tgt_size, tgt_name) = source, target
    in_source, in_target = rank < src_size, rank < tgt_size
    model = driver(kind)
    src = member(kind, model, rank, src_size, spec(src_size, src_name)) if in_source else None
    if src is not None:
        src.train(0, BEFORE)
    checkpoint = share({n: p.detach().clone() for n, p in model.named_parameters()})
    state: Any = None
    if src is not None and (src_size > 1 or rank == 0):
        state = export_portable_state(
            src.optimizer, checkpoint_process_group=checkpoint_binding(rank, src_size), transaction_id="export",
            limits=LIMITS,
        )  # fmt: skip
    document = None
    if tgt_size < src_size and src is not None:  # fewer targets: whole documents (no fragment is left behind)
        document = state.materialize(checkpoint_binding(rank, src_size), limits=LIMITS)
    catalog = share(state.catalog_record() if rank == 0 else None)
    if state is None:
        state = PortableState.from_parts(catalog, [], limits=LIMITS)
    outcome: dict[str, Any] = {}
    if in_source:
        twin = member(kind, _at(kind, checkpoint), rank, src_size, spec(src_size, src_name))
        _import(twin, state, rank, src_size, "same-layout")
        assert src is not None
        outcome["uninterrupted"] = src.train(BEFORE, AFTER)
        outcome["twin"] = twin.train(BEFORE, AFTER)
        outcome["twin_bit_exact"] = twin.bits() == src.bits()
    if in_target:
        resumed = member(kind, _at(kind, checkpoint), rank, tgt_size, spec(tgt_size, tgt_name))
        _import(resumed, document if document is not None else state, rank, tgt_size, "reshard")
        outcome["resumed"] = resumed.train(BEFORE, AFTER)
        dropped = member(kind, _at(kind, checkpoint), rank, tgt_size, spec(tgt_size, tgt_name))
        outcome["dropped"] = dropped.train(BEFORE, AFTER)
    dist.barrier()
    return outcome

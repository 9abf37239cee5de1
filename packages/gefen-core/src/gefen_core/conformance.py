"""Conformance-kit factories: ``gefen conformance gefen_core.conformance:factory`` (``Gefen``) and
``gefen conformance gefen_core.conformance:muon_factory`` (``GefenMuon``).

Each factory carries ``conformance_waive``: the claims the kit cannot execute in one process
(DTensor training and checkpoints, world-size changes, torch's DCP state-dict helpers), each
with the test that executes it in this repository. ``gefen conformance
gefen_core.conformance:factory`` also runs the kit's 2-rank scope check
(:mod:`gefen_core.scope_conformance`); ``CHECK_WAIVERS`` lets in-process runs of many
configurations skip it by name. GefenMuon takes only 2-D parameters, so its
factory also carries a model of matrices (``conformance_model_builder``) and its loss.
"""

from __future__ import annotations

import torch

from .gefen import Gefen
from .muon import GefenMuon
from .muon_contract import mode_tag
from .muon_options import SHARDED_MODES

__all__ = [
    "CHECK_WAIVERS",
    "MUON_WAIVERS",
    "WAIVERS",
    "MatrixModel",
    "factory",
    "matrix_loss",
    "matrix_model",
    "muon_factory",
]

_DISTRIBUTED = "executed in two gloo processes by packages/gefen-core/tests/test_core_distributed.py"
_SCOPE_CLAIM = "feature:collective_scope"
_SCOPE = (
    "needs spawned ranks: executed by the kit's scope.collective_protocol check on importable targets (the "
    "packaged factories) and by packages/gefen-core/tests/test_core_scope.py (2 and 3 gloo ranks)"
)

#: Checks an in-process run of many configurations may skip by name: the 2-rank scope check
#: spawns gloo processes; it runs on the packaged factories (``gefen conformance
#: gefen_core.conformance:factory`` / ``:muon_factory``).
CHECK_WAIVERS: dict[str, str] = {
    "scope.collective_protocol": (
        "executed in 2 gloo processes on the packaged factories (tests/test_core_conformance.py and "
        "tests/test_muon_conformance.py, test_the_packaged_factory_passes_through_the_cli_loader), and in 2 and 3 "
        "processes by packages/gefen-core/tests/test_core_scope.py and test_core_scope_three.py"
    ),
    "portable.reshard": (
        "executed in 3 gloo processes on the packaged factories (tests/test_core_conformance.py and "
        "tests/test_muon_conformance.py, test_the_packaged_factory_passes_through_the_cli_loader)"
    ),
}


#: Claim or check name -> why a kit run accepts it as unverified.
WAIVERS: dict[str, str] = {
    _SCOPE_CLAIM: _SCOPE,
    "training:dtensor_1d_default_world": f"FSDP2 training {_DISTRIBUTED} (parity with one process)",
    "checkpoint:native_optimizer:dtensor_1d_default_world": (
        f"per-rank native resume {_DISTRIBUTED}; DCP N -> M resharding by tests/test_fsdp2_dcp_recipe.py"
    ),
    "checkpoint:native_optimizer:dtensor_1d_default_world:atomic": (
        "the staged load is the same code for DTensor parameters (covered by the replicated atomic-load check); "
        "a mis-shaped state tensor is refused by packages/gefen-core/tests/test_core_torch_dcp_recipe.py"
    ),
    "checkpoint:pytorch_rank_local:dtensor_1d_default_world": f"get/set_optimizer_state_dict resume {_DISTRIBUTED}",
}


def factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """Gefen with its defaults (reference path) over the kit's named parameters."""
    return Gefen(named_parameters, lr=1e-2, fused=False)


factory.conformance_waive = WAIVERS  # type: ignore[attr-defined]


_MUON_GLOO = "executed in gloo processes by packages/gefen-core/tests/test_core_muon_distributed.py"
_DTENSOR = "dtensor_1d_default_world"
_TRANSITION = "checkpoint:native_optimizer:transition:dtensor_1d_default_world->{}:world_size_owner_redistribution"

#: Claim name -> why a single-process kit run accepts it as unverified (GefenMuon, every mode).
MUON_WAIVERS: dict[str, str] = {
    _SCOPE_CLAIM: _SCOPE,
    **{
        f"training:{_DTENSOR}[{mode_tag(mode)}]": f"FSDP2 training in sharded_mode={mode!r} is {_MUON_GLOO}"
        for mode in SHARDED_MODES
    },
    f"checkpoint:native_optimizer:{_DTENSOR}": f"same-topology DTensor resume (every mode) is {_MUON_GLOO}",
    f"checkpoint:native_optimizer:{_DTENSOR}:atomic": (
        "the staged load is the same code for DTensor parameters (covered by the replicated atomic-load check); "
        f"the owner-manifest and topology refusals are {_MUON_GLOO}"
    ),
    _TRANSITION.format(_DTENSOR): f"2 -> 3 rank resume is {_MUON_GLOO}",
    _TRANSITION.format("replicated"): f"2 ranks -> one process resume is {_MUON_GLOO}",
}


class MatrixModel(torch.nn.Module):
    """A small model whose trainable parameters are all matrices (an embedding and two projections)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(16, 8) * 0.5)
        self.proj = torch.nn.Linear(8, 12, bias=False)
        self.head = torch.nn.Linear(12, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.proj(self.embed[tokens].mean(dim=1)))
        return self.head(hidden)  # type: ignore[no-any-return]


def matrix_model(seed: int = 0) -> torch.nn.Module:
    """A :class:`MatrixModel`, identical for equal seeds (the global generator is left alone)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return MatrixModel()
    finally:
        torch.random.set_rng_state(state)


def matrix_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    """A deterministic regression loss for ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 16, (6, 5), generator=generator)
    target = torch.randn(6, 4, generator=generator)
    return torch.nn.functional.mse_loss(model(tokens).float(), target)


def muon_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """GefenMuon with its defaults (reference path) over the kit's named matrices."""
    return GefenMuon(named_parameters, lr=1e-2, fused=False)


muon_factory.conformance_waive = MUON_WAIVERS  # type: ignore[attr-defined]
muon_factory.conformance_model_builder = matrix_model  # type: ignore[attr-defined]
muon_factory.conformance_loss = matrix_loss  # type: ignore[attr-defined]

"""Factories for the conformance kit (``gefen conformance gefen_hybrid.conformance:adamw_factory``).

Each factory takes the kit's named parameters and carries ``conformance_waive`` for the
claims no kit check can execute in one process, each with the test that executes it:

* DTensor (FSDP2) training and same-topology native checkpoints: gefen-hybrid's gloo tests
  (``tests/test_hybrid_distributed.py``: bit-identical FSDP2 training against a
  single-process twin, DTensor state-dict round trip and refused corrupted loads).

The portable claims (replicated, flattened and every transition between them) and the
parameter-shaped claims are executed by the checks gefen-portable and gefen-dcp contribute to
the kit (``gefen.conformance`` entry points, in the kit's own gloo ranks) when they are
installed.
"""

from __future__ import annotations

import torch

from .adamw import ContractedAdamW
from .composite import CompositeOptimizer
from .routing import NamedParameter

__all__ = ["DTENSOR_WAIVERS", "adamw_factory", "composite_factory"]

_WHY = "executed by gefen-hybrid's gloo FSDP2 tests; the kit has no in-process DTensor check"
_RECIPE_WHY = (
    "torch's recipe under FSDP2 (2 -> 1 and 2 -> 3 ranks, bit-exact) is executed by tests/test_fsdp2_dcp_recipe.py"
)
#: The DTensor claims of ContractedAdamW that only a multi-process run can execute.
DTENSOR_WAIVERS: dict[str, str] = {
    "training:dtensor_1d_default_world": _WHY,
    "checkpoint:native_optimizer:dtensor_1d_default_world": _WHY,
    "checkpoint:native_optimizer:dtensor_1d_default_world:atomic": _WHY,
    "checkpoint:pytorch_rank_local:dtensor_1d_default_world": _RECIPE_WHY,
}


def adamw_factory(named_parameters: list[NamedParameter]) -> torch.optim.Optimizer:
    """``ContractedAdamW`` as the kit exercises it."""
    return ContractedAdamW(named_parameters, lr=1e-2, weight_decay=0.01)


def composite_factory(named_parameters: list[NamedParameter]) -> torch.optim.Optimizer:
    """A composite routed by the default rules, with ``ContractedAdamW`` in both roles."""
    return CompositeOptimizer.from_factories(
        named_parameters,
        {
            "muon": lambda named: ContractedAdamW(named, lr=2e-2, weight_decay=0.0),
            "backup": lambda named: ContractedAdamW(named, lr=1e-2, weight_decay=0.01),
        },
    )


adamw_factory.conformance_waive = DTENSOR_WAIVERS  # type: ignore[attr-defined]
_FLAT_WHY = (
    "a twin built directly on the 1-D shards would be routed to another role; tests/test_hybrid_composite_identity.py "
    "trains a rebound flattened composite bit-identically to one built on the shards with the same routing"
)
composite_factory.conformance_waive = {  # type: ignore[attr-defined]
    "identity.flattened_training": _FLAT_WHY,
    "training:dtensor_1d_default_world[gefen.role=muon]": _WHY,
    "training:dtensor_1d_default_world[gefen.role=backup]": _WHY,
    "checkpoint:composite_native:dtensor_1d_default_world": _WHY,
    "checkpoint:composite_native:dtensor_1d_default_world:atomic": _WHY,
    "checkpoint:pytorch_rank_local:dtensor_1d_default_world": _RECIPE_WHY,
}

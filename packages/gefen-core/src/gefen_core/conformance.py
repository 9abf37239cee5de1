"""A conformance-kit factory for ``Gefen``: ``gefen conformance gefen_core.conformance:factory``.

The factory carries ``conformance_waive``: the claims the kit cannot execute in one process
(DTensor training and checkpoints, torch's DCP state-dict helpers), each with the test that
executes it in this repository.
"""

from __future__ import annotations

import torch

from .gefen import Gefen

__all__ = ["WAIVERS", "factory"]

_DISTRIBUTED = "executed in two gloo processes by packages/gefen-core/tests/test_core_distributed.py"

#: Claim name -> why it is accepted as unverified by a single-process kit run.
WAIVERS: dict[str, str] = {
    "training:dtensor_1d_default_world": f"FSDP2 training {_DISTRIBUTED} (parity with one process)",
    "checkpoint:native_optimizer:dtensor_1d_default_world": f"rank-local native resume {_DISTRIBUTED}",
    "checkpoint:native_optimizer:dtensor_1d_default_world:atomic": (
        "the staged load is the same code for DTensor parameters (covered by the replicated atomic-load check); "
        f"the foreign-topology refusal is {_DISTRIBUTED}"
    ),
    "checkpoint:pytorch_rank_local:dtensor_1d_default_world": f"get/set_optimizer_state_dict resume {_DISTRIBUTED}",
    "checkpoint:pytorch_rank_local:replicated": (
        "get/set_optimizer_state_dict resume is executed by packages/gefen-core/tests/test_core_checkpoint.py"
    ),
}


def factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """Gefen with its defaults (reference path) over the kit's named parameters."""
    return Gefen(named_parameters, lr=1e-2, fused=False)


factory.conformance_waive = WAIVERS  # type: ignore[attr-defined]

"""Importable optimizer factories for tests/test_conformance_all.py.

The kit's multi-process checks (portable and parameter-shaped resharding) spawn gloo ranks that
rebuild the optimizer from a ``MODULE:FACTORY`` spec, so configurations that no package
ships as a factory live here rather than as lambdas in the test module.
"""

from __future__ import annotations

import torch
from gefen import ContractedAdamW
from gefen_hybrid.conformance import DTENSOR_WAIVERS
from torch import nn


def contracted_adamw_amsgrad_foreach(named_parameters: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """``ContractedAdamW`` with ``amsgrad=True`` (one more state field) and the foreach kernels."""
    return ContractedAdamW(named_parameters, lr=1e-2, amsgrad=True, foreach=True)


#: the same multi-process claims gefen-hybrid's packaged ``adamw_factory`` waives, with the same reasons
contracted_adamw_amsgrad_foreach.conformance_waive = DTENSOR_WAIVERS  # type: ignore[attr-defined]

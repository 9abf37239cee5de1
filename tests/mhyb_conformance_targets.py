"""Importable conformance factories for configurations the packages do not ship a factory for.

The kit's resharding checks spawn ranks that rebuild the optimizer from a ``MODULE:FACTORY``
spec, so a configuration that should get those checks lives here (this folder is on the
spawned ranks' ``sys.path``) rather than inline in ``test_conformance_all.py``.
"""

from __future__ import annotations

import torch
from gefen_hybrid import ContractedAdamW
from gefen_hybrid.conformance import adamw_factory


def adamw_amsgrad_foreach_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """``ContractedAdamW`` with AMSGrad and torch's foreach path (its extra ``max_exp_avg_sq`` slot)."""
    return ContractedAdamW(named_parameters, lr=1e-2, amsgrad=True, foreach=True)


# The same claims as gefen-hybrid's packaged ContractedAdamW factory, so the same waivers apply.
adamw_amsgrad_foreach_factory.conformance_waive = dict(adamw_factory.conformance_waive)  # type: ignore[attr-defined]

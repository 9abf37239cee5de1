"""Conformance-kit factories for ``GefenMuonHybrid``.

``gefen conformance gefen.integrations.conformance:hybrid_factory`` (Gefen backup) and
``...:hybrid_adamw_factory`` (``ContractedAdamW`` backup). Each factory routes the kit's
named parameters by name and shape (the kit's model has an embedding, a matrix with a bias,
a norm and a head, so both children are present) and carries ``conformance_waive`` for the
claims a single-process kit run cannot execute, each naming the test that executes it.
"""

from __future__ import annotations

import torch

from ..hybrid import GefenMuonHybrid

__all__ = ["HYBRID_WAIVERS", "hybrid_adamw_factory", "hybrid_factory"]

_FSDP2 = "executed on 2 gloo ranks under FSDP2 by tests/test_integration_distributed.py"
_MUON_MODES = (
    "the Muon child's other sharded modes are executed by packages/gefen-core/tests/test_core_muon_distributed.py"
)

#: Claim name -> why a single-process kit run accepts it as unverified (every sharded mode).
HYBRID_WAIVERS: dict[str, str] = {
    "training:dtensor_1d_default_world[gefen.muon.sharded_mode=exact,gefen.role=muon]": (
        f"FSDP2 training of the hybrid's Muon half is {_FSDP2}"
    ),
    **{
        f"training:dtensor_1d_default_world[gefen.muon.sharded_mode={mode},gefen.role=muon]": (
            f"{_MUON_MODES}; the hybrid's FSDP2 wiring (exact mode) is {_FSDP2}"
        )
        for mode in ("approx", "distributed")
    },
    "training:dtensor_1d_default_world[gefen.role=backup]": f"FSDP2 training of the hybrid's backup half is {_FSDP2}",
    "identity.flattened_training": (
        "the kit's check binds every parameter as a flattened shard, but the hybrid's Muon half binds complete "
        "matrices only (its contract claims flattened training for the backup role alone); Gefen's flattened "
        "binding is executed by packages/gefen-core/tests/test_core_identity.py and a composite's per-role "
        "flattened binding by packages/gefen-hybrid/tests/test_hybrid_composite_identity.py"
    ),
    "checkpoint:composite_native:dtensor_1d_default_world": f"same-topology DTensor resume of the hybrid is {_FSDP2}",
    "checkpoint:canonical_global:transition:replicated->replicated:placement_reshard": (
        "each child's move from a post_sharding-bound layout onto one process is executed by "
        "tests/test_bound_resharding.py (Gefen and GefenMuon, 2 gloo members -> 1 process, bit-exact), and the "
        "composite wrapper's import across member counts by tests/test_adamw_composite_resharding.py"
    ),
    "checkpoint:composite_native:dtensor_1d_default_world:atomic": (
        "the staged load is the same code for DTensor parameters (covered by the replicated atomic-load check); "
        f"corrupted DTensor checkpoints refused without change are {_FSDP2}"
    ),
}


def hybrid_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """``GefenMuonHybrid`` with its defaults (Gefen backup) over the kit's named parameters."""
    return GefenMuonHybrid(named_parameters, lr=1e-2)


def hybrid_adamw_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """``GefenMuonHybrid(backup_optimizer="adamw")`` over the kit's named parameters."""
    return GefenMuonHybrid(named_parameters, lr=1e-2, backup_optimizer="adamw", weight_decay=0.01)


hybrid_factory.conformance_waive = dict(HYBRID_WAIVERS)  # type: ignore[attr-defined]
hybrid_adamw_factory.conformance_waive = dict(HYBRID_WAIVERS)  # type: ignore[attr-defined]

"""Claims that appear only after ``post_sharding``: the kit binds the optimizer itself to find them.

A contract is dynamic (identity and canonical-state claims appear once the optimizer is
finalized), so enumerating the claims of a fresh and a trained optimizer is not enough. When
the fresh contract supports ``post_sharding``, the runner also enumerates the claims of
optimizers the kit finalized with its own plans (replicated copies, before and after training;
flattened member slices when flattened training is claimed). A plan the optimizer refuses adds
no claim here; the identity checks report the refusal as a failure.
"""

from __future__ import annotations

from ...capabilities import FEATURE_POST_SHARDING
from ...enums import ParameterLayout
from ..claims import enumerate_claims, training_claim
from ..context import CheckContext
from .twins import BoundTwin, FlatWorld, flat_step

__all__ = ["bound_claims"]


def bound_claims(context: CheckContext) -> frozenset[str]:
    """Every claim of the optimizer after the kit's own ``post_sharding`` plans (see above)."""
    if not context.contract.capabilities.supports(FEATURE_POST_SHARDING):
        return frozenset()
    claims: set[str] = set()
    try:
        twin = BoundTwin.replicated(context)
        claims |= enumerate_claims(twin.optimizer.optimizer_contract())
        context.train(twin.model, twin.optimizer, context.target.steps)
        claims |= enumerate_claims(twin.optimizer.optimizer_contract())
    except Exception:  # reported by identity.post_sharding
        pass
    flat = training_claim(ParameterLayout.FLATTENED_ELEMENT_SHARD.value)
    if any(c == flat or c.startswith(flat + "[") for c in context.claims):
        try:
            world = FlatWorld(context)
            driver = context.target.model_builder(0)
            for step in range(context.target.steps):
                flat_step(driver, step, world, (world,))
            for optimizer in world.optimizers:
                claims |= enumerate_claims(optimizer.optimizer_contract())
        except Exception:  # reported by identity.flattened_training
            pass
    return frozenset(claims)

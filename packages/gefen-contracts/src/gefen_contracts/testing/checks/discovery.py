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
from ...errors import ContractError
from ..claims import enumerate_claims, training_claim
from ..context import CheckContext
from .twins import BoundTwin, FlatWorld, flat_step

__all__ = ["bound_claims"]


def bound_claims(context: CheckContext) -> frozenset[str]:
    """Every claim of the optimizer after the kit's own ``post_sharding`` plans (see above)."""
    if not context.contract.capabilities.supports(FEATURE_POST_SHARDING):
        return frozenset()
    claims: set[str] = set()
    # a refused plan or a failing step is reported by the identity checks; a bound optimizer's
    # contract that raises is reported by nobody else, so it raises out of here (contract.provider)
    try:
        twin = BoundTwin.replicated(context)
    except Exception:  # reported by identity.post_sharding
        twin = None
    if twin is not None:
        claims |= _claims(twin.optimizer, "finalized by post_sharding")
        try:
            context.train(twin.model, twin.optimizer, context.target.steps)
        except Exception:  # reported by the identity checks' training
            pass
        else:
            claims |= _claims(twin.optimizer, "finalized by post_sharding and trained")
    flat = training_claim(ParameterLayout.FLATTENED_ELEMENT_SHARD.value)
    if any(c == flat or c.startswith(flat + "[") for c in context.claims):
        try:
            world = FlatWorld(context)
            driver = context.target.model_builder(0)
            for step in range(context.target.steps):
                flat_step(driver, step, world, (world,))
        except Exception:  # reported by identity.flattened_training
            world = None
        for optimizer in world.optimizers if world is not None else ():
            claims |= _claims(optimizer, "holding a flattened member slice")
    return frozenset(claims)


def _claims(optimizer: object, when: str) -> frozenset[str]:
    try:
        return enumerate_claims(optimizer.optimizer_contract())  # type: ignore[attr-defined]
    except Exception as exc:
        raise ContractError(f"optimizer_contract() of an optimizer {when} raised {type(exc).__name__}: {exc}") from exc

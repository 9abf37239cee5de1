"""What is specific to ``ContractedAdamW`` in post-sharding rebinding.

The request itself is validated by the generic ``gefen_contracts.torch_support.plan_rebinding``;
this module adds AdamW's rules and builds what a commit publishes:

* layouts: ``REPLICATED`` (the target has the global shape) and ``FLATTENED_ELEMENT_SHARD``
  (a contiguous 1-D run of the flattened parameter). AdamW is elementwise, so either trains
  exactly like the same elements of the full tensor; other layouts are refused;
* pristine: no parameter has state yet (AdamW creates all of it at a parameter's first step);
* compatibility names and the staged groups are every bindable optimizer's
  (``gefen_contracts.torch_support.compatibility_names``, ``staged_groups``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import ContractError
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.torch_support import RebindingPlan, SealedLayout, rebuilt_plan, staged_groups

__all__ = [
    "BINDABLE_LAYOUTS",
    "StagedBinding",
    "check_adamw_layout",
    "rebuild_sealed_layout",
    "stage_binding",
    "state_blockers",
]

#: The layouts ``ContractedAdamW.post_sharding`` binds.
BINDABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD})


@dataclass(frozen=True, slots=True, eq=False)
class StagedBinding:
    """New group dicts (one per live group, same order) and the sealed layout to publish."""

    groups: tuple[dict[str, Any], ...]
    sealed: SealedLayout


def check_adamw_layout(shard: ShardIdentity, target: torch.Tensor | None) -> None:
    """Refuse a layout ``ContractedAdamW`` does not bind (``ContractError`` naming it)."""
    if shard.layout not in BINDABLE_LAYOUTS:
        allowed = ", ".join(sorted(layout.value for layout in BINDABLE_LAYOUTS))
        raise ContractError(
            f"post_sharding: ContractedAdamW binds {allowed} shards; {shard.fqn!r} is {shard.layout.value}"
        )


def state_blockers(state: Mapping[Any, Any]) -> tuple[str, ...]:
    """Why the optimizer is not pristine (empty when it is): a parameter with state."""
    stepped = sum(1 for entry in state.values() if entry)
    if stepped:
        return (
            f"{stepped} parameter(s) already have AdamW state: post_sharding binds a pristine optimizer, "
            "before its first step",
        )
    return ()


def stage_binding(param_groups: Sequence[Mapping[str, Any]], plan: RebindingPlan) -> StagedBinding:
    """The group dicts and sealed layout a commit publishes (nothing live is touched)."""
    return StagedBinding(staged_groups(param_groups, plan), SealedLayout(plan, len(param_groups)))


def rebuild_sealed_layout(
    param_groups: Sequence[Mapping[str, Any]], manifest: Any, slots: Sequence[Any]
) -> SealedLayout:
    """The sealed layout of a copied optimizer (``copy.deepcopy``/pickle keep only tensors)."""
    return SealedLayout(rebuilt_plan(param_groups, manifest, slots, None), len(param_groups))

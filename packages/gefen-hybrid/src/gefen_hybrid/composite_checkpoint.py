"""``CompositeOptimizer``'s staged native load across its children: which children can stage,
the freshness token a staged load is claimed against, staging every child (with or without
their load pre-hooks), and the partial path for a child that cannot stage (loaded by its own
``load_state_dict`` after the others are staged and before they are published).

The composite's ``stage_state_dict`` / ``commit_staged_state_dict`` / ``load_state_dict``
call these; the flat dict's format is :mod:`gefen_hybrid.composite_format`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from gefen_contracts import FEATURE_STAGED_NATIVE_LOAD
from gefen_contracts.protocols import StagedNativeLoad
from gefen_contracts.torch_support import run_load_pre_hooks, share_options, shared_tensor_options, state_version_token
from gefen_contracts.transactions import StagedTransaction

from .composite_format import children_of_state_dict
from .composite_groups import child_groups_noted

if TYPE_CHECKING:
    from .composite import CompositeOptimizer

__all__ = ["LOAD_KIND", "load_partially_staged", "load_token", "stage", "staged_capable"]

#: The kind of a staged composite load (``StagedTransaction.kind``).
LOAD_KIND = "gefen.CompositeOptimizer.native_load"


def staged_capable(child: torch.optim.Optimizer) -> bool:
    """Whether ``child`` stages its native load (the Protocol and its contract's feature)."""
    if not isinstance(child, StagedNativeLoad):
        return False
    contract = child.optimizer_contract()  # type: ignore[attr-defined]
    return bool(contract.capabilities.supports(FEATURE_STAGED_NATIVE_LOAD))


def load_token(composite: CompositeOptimizer) -> tuple[object, ...]:
    """What a staged load is claimed against: the composite's change count and each child's
    groups and state (a step, a load or a new group in between makes the stage stale).

    The children's own version tokens (their groups, options, state entries and tensors by
    identity and version counter) are in it because a child can change without a hook the
    composite sees (its own staged load, an import, a codebook refresh). Each child claims its
    own staged load against its own token, and the first child commits before the second
    claims: a change only the second noticed would publish half a checkpoint."""
    children = tuple(
        (role, id(child), state_version_token(child.param_groups, child.state)) for role, child in composite._children
    )
    return (composite._changes.value, children)


def _children_of(composite: CompositeOptimizer, state_dict: object) -> dict[str, Any]:
    return children_of_state_dict(
        state_dict,
        implementations=composite._child_implementations,
        routing=composite.parameter_routing(),
        group_counts={role: len(child.param_groups) for role, child in composite._children},
    )


def _shared_options(composite: CompositeOptimizer, subs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The tensor options the children's parts (after their load pre-hooks) share across
    children (one tensor ``lr`` given to both factories), which each child's load alone cannot
    keep; groups in the composite's order. A hook's new value is its own, not shared."""
    groups: list[object] = []
    for role, _ in composite._children:
        sub = subs.get(role)
        part = sub.get("param_groups") if isinstance(sub, Mapping) else None
        if not isinstance(part, list):
            return ()  # the child's load names the problem
        groups += part
    return shared_tensor_options(groups)


def stage(composite: CompositeOptimizer, state_dict: object, *, run_child_hooks: bool) -> StagedTransaction:
    """Validate the flat dict and stage every child (its load pre-hooks first when asked)."""
    subs = _children_of(composite, state_dict)
    hooked = {
        role: run_load_pre_hooks(child, subs[role]) if run_child_hooks else subs[role]
        for role, child in composite._children
    }
    staged: dict[str, StagedTransaction] = {}
    for role, child in composite._children:
        with child_groups_noted(composite._children, role):
            staged[role] = child.stage_state_dict(hooked[role])  # type: ignore[attr-defined]
    payload = (staged, _shared_options(composite, hooked))
    return StagedTransaction(composite, kind=LOAD_KIND, token=load_token(composite), payload=payload)


def commit(composite: CompositeOptimizer, payload: object) -> None:
    """Publish every child's staged load (:func:`stage`'s payload), then share the options
    the checkpoint's groups shared."""
    assert isinstance(payload, tuple)
    staged, shared = payload
    for role, child in composite._children:
        child.commit_staged_state_dict(staged[role])  # type: ignore[attr-defined]
    share_options(composite.param_groups, shared)
    composite._changes.bump()


def load_partially_staged(composite: CompositeOptimizer, state_dict: object) -> list[torch.optim.Optimizer]:
    """Stage the staged-capable children, load the others with their own ``load_state_dict``
    (their hooks included), then publish the staged ones; return those."""
    subs = _children_of(composite, state_dict)
    hooked = {
        role: run_load_pre_hooks(child, subs[role]) if staged_capable(child) else subs[role]
        for role, child in composite._children
    }
    staged = {}
    for role, child in composite._children:
        if staged_capable(child):
            with child_groups_noted(composite._children, role):
                staged[role] = child.stage_state_dict(hooked[role])  # type: ignore[attr-defined]
    for role, child in composite._children:
        if role not in staged:
            with child_groups_noted(composite._children, role):
                child.load_state_dict(subs[role])
    for role, child in composite._children:
        if role in staged:
            child.commit_staged_state_dict(staged[role])  # type: ignore[attr-defined]
    share_options(composite.param_groups, _shared_options(composite, hooked))
    composite._changes.bump()
    return [child for role, child in composite._children if role in staged]

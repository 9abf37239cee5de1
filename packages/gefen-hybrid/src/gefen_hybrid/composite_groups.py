"""A parameter group added to a composite: routed by its rules and checked, one part per child.

:func:`new_group_parts` does everything ``CompositeOptimizer.add_param_group`` decides before
any child changes: the group's named parameters are routed by the composite's rules (frozen
ones kept, as torch's ``add_param_group`` keeps them), a name already in use, a parameter
already optimized or a part for an absent child is refused, and ``role_options`` are checked.
:func:`child_groups_noted` maps a child's group indices in its errors to the composite's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from .roles import ROLES, check_role
from .routing import backup_module_weight_ids, route_named_parameters

__all__ = ["child_groups_noted", "new_group_parts"]


@contextmanager
def child_groups_noted(children: Sequence[tuple[str, Any]], role: str) -> Iterator[None]:
    """Run a ``role`` child's step check or load; an exception it raises names the child's own
    group indices, so it leaves with a note mapping them to the composite's (the children's
    groups stand in ``children``'s order)."""
    try:
        yield
    except Exception as exc:
        offset = 0
        for name, child in children:
            count = len(child.param_groups)
            if name == role:
                exc.add_note(
                    f"raised by the {role!r} child, whose param_groups[0..{count - 1}] are this composite's "
                    f"param_groups[{offset}..{offset + count - 1}]"
                )
                break
            offset += count
        raise


def new_group_parts(
    composite: Any, param_group: object, role_options: Mapping[str, Mapping[str, Any]] | None
) -> dict[str, dict[str, Any]]:
    """Each role's new group (``params`` plus the group's options and ``role_options[role]``);
    raises ``TypeError`` or ``ValueError`` and changes nothing."""
    if not isinstance(param_group, Mapping) or "params" not in param_group:
        raise TypeError("add_param_group takes a dict with 'params': [(name, parameter), ...] and options")
    params = param_group["params"]
    if isinstance(params, tuple) and len(params) == 2 and isinstance(params[1], torch.Tensor):
        params = [params]
    model = composite._model_ref() if composite._model_ref is not None else None
    rules = composite._rules
    embedding_ids = backup_module_weight_ids(model, rules.embedding_types) if model is not None else frozenset()
    routed = route_named_parameters(params, rules, embedding_ids=embedding_ids, check_overrides=False, keep_frozen=True)
    taken = dict(composite.parameter_routing())
    for name, _ in routed.routing():
        if name in taken:
            raise ValueError(f"the name {name!r} is already used by role {taken[name]!r}")
    for _, parameter in (item for role in ROLES for item in routed.by_role[role]):
        if composite._owner_of(parameter) is not None:
            raise ValueError("a parameter of the new group is already optimized by this composite")
    present = dict(composite._children)
    for role in routed.present_roles:
        if role not in present:
            names = [name for name, _ in routed.by_role[role]]
            raise ValueError(
                f"parameters {names} route to {role!r}, but this composite has no {role!r} child: a role gets one "
                "only if a trainable parameter routed to it when the optimizer was built (were they frozen then?); "
                "build the optimizer with every layer trainable and freeze after (frozen parameters get no "
                "gradient and are skipped), so unfreezing needs nothing more"
            )
    if role_options is not None and not isinstance(role_options, Mapping):
        raise TypeError(f"role_options must map a role to its options, got {type(role_options).__name__}")
    extra = {} if role_options is None else dict(role_options)
    for role, given in extra.items():
        check_role(role, "role_options key")
        if not isinstance(given, Mapping):
            raise TypeError(f"role_options[{role!r}] must be a mapping of options, got {type(given).__name__}")
        # the routing decides each child's parameters: a role's options cannot replace them
        if "params" in given or "param_names" in given:
            raise ValueError(f"role_options[{role!r}] cannot set 'params' or 'param_names'; the routing does")
    options = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
    return {
        role: {"params": list(routed.by_role[role]), **options, **extra.get(role, {})}
        for role, _ in composite._children
        if routed.by_role[role]
    }

"""Whether an optimizer's parameters can be keyed by their names (torch-free).

An optimizer without a sealed layout keys its portable state by the names in
``param_groups[i]["param_names"]`` (what ``torch.optim.Optimizer`` stores when it is built
from ``model.named_parameters()``). Those names must be valid FQNs (the rule of
:attr:`ParameterIdentity.fqn <gefen_contracts.identity.ParameterIdentity>`) and unique.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ContractError, ContractTypeError
from .validation import identity_name

__all__ = ["fqn_problem", "param_group_naming_blockers"]


def fqn_problem(name: object) -> str | None:
    """Why ``name`` is not a valid parameter FQN, or ``None`` (checked without building a
    :class:`~gefen_contracts.identity.ParameterIdentity`: cheap enough to run per query)."""
    try:
        identity_name(name, "a parameter name")
    except (ContractError, ContractTypeError) as exc:
        return str(exc)
    assert isinstance(name, str)
    if any(not part for part in name.split(".")):
        return "it has an empty dot component"
    return None


def param_group_naming_blockers(param_groups: Sequence[Mapping[str, Any]], *, optimizer: str) -> tuple[str, ...]:
    """Why the parameters of ``param_groups`` cannot be keyed by their names (empty when they
    can): a group without names, a name that is not a valid FQN, a name used twice.
    ``optimizer`` names the class in the hint of a group without names."""
    reasons: list[str] = []
    seen: dict[str, int] = {}
    for index, group in enumerate(param_groups):
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            reasons.append(
                f"param_groups[{index}] has no parameter names: build {optimizer} from model.named_parameters() "
                "(or finalize it with post_sharding) so its state can be keyed by name"
            )
            continue
        for name in names:
            problem = fqn_problem(name)
            if problem is not None:
                reasons.append(f"param_groups[{index}] parameter name {name!r} is not a valid FQN: {problem}")
            elif name in seen:
                reasons.append(f"the parameter name {name!r} is used twice (param_groups {seen[name]} and {index})")
            else:
                seen[name] = index
    return tuple(reasons)

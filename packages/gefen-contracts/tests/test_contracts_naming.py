"""``fqn_problem`` and ``param_group_naming_blockers``: when parameters can be keyed by name."""

from __future__ import annotations

import pytest
from gefen_contracts import ContractError
from gefen_contracts.identity import ParameterIdentity
from gefen_contracts.naming import fqn_problem, param_group_naming_blockers


@pytest.mark.parametrize("name", ["w", "layers.0.attn.q", "embed_tokens.weight"])
def test_valid_fqns_have_no_problem_and_build_an_identity(name: str) -> None:
    assert fqn_problem(name) is None
    ParameterIdentity(name, (2, 3))


@pytest.mark.parametrize("name", ["", " w", "a..b", ".w", "w.", "a\x00b", 3, None])
def test_invalid_fqns_say_why_and_are_refused_by_the_identity(name: object) -> None:
    problem = fqn_problem(name)
    assert problem
    with pytest.raises((ContractError, TypeError)):
        ParameterIdentity(name, (2,))  # type: ignore[arg-type]


def test_blockers_name_every_problem_and_nothing_else() -> None:
    params = [object(), object()]
    groups = [
        {"params": params, "param_names": ["a", "b"]},
        {"params": params, "param_names": ["a", "c..d"]},
        {"params": params},
    ]
    reasons = param_group_naming_blockers(groups, optimizer="MyOptimizer")
    assert len(reasons) == 3
    assert "'a' is used twice (param_groups 0 and 1)" in reasons[0]
    assert "param_groups[1] parameter name 'c..d' is not a valid FQN" in reasons[1]
    assert reasons[2].startswith("param_groups[2] has no parameter names: build MyOptimizer from")
    assert param_group_naming_blockers(groups[:1], optimizer="MyOptimizer") == ()

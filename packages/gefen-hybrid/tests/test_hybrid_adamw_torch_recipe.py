"""ContractedAdamW takes the FQN-keyed state dicts of torch's optimizer-checkpoint recipe.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` key parameters by FQN
string, so the staged load accepts str ids as well as ints (never bools). The recipe's round
trip for every optimizer is ``tests/test_torch_dcp_recipe.py``.
"""

from __future__ import annotations

import pytest
from gefen_contracts import StateValidationError
from gefen_contracts.testing.model import kit_loss, make_kit_model
from gefen_hybrid import ContractedAdamW


def test_parameter_ids_may_be_fqns_but_not_bools() -> None:
    model = make_kit_model(0)
    optimizer = ContractedAdamW(model.named_parameters(), lr=1e-2)
    kit_loss(model, 0).backward()
    optimizer.step()
    sd = optimizer.state_dict()
    names = sd["param_groups"][0]["param_names"]
    by_name = {
        "state": {names[pid]: entry for pid, entry in sd["state"].items()},
        "param_groups": [{**sd["param_groups"][0], "params": list(names)}],
    }
    optimizer.load_state_dict(by_name)
    bools = {"state": {}, "param_groups": [{**sd["param_groups"][0], "params": [True] * len(names)}]}
    with pytest.raises(StateValidationError, match="int or str parameter ids"):
        optimizer.load_state_dict(bools)

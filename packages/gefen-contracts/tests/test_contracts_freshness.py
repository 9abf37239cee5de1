"""The version-counter freshness token: equal while nothing changed, different after every
kind of change a prepared transaction must notice; and case-preserving slot names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from contract_builders import replicated
from gefen_contracts.rebinding import LogicalSlotBinding
from gefen_contracts.torch_support import state_version_token


def _optimizer() -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    return optimizer


def _token(optimizer: torch.optim.Optimizer) -> Any:
    return state_version_token(optimizer.param_groups, optimizer.state)


def test_the_token_is_stable_while_nothing_changes() -> None:
    optimizer = _optimizer()
    optimizer.param_groups[0]["nan_option"] = float("nan")
    assert _token(optimizer) == _token(optimizer)
    optimizer.state_dict()  # reading does not count
    assert _token(optimizer) == _token(optimizer)


def _first_param(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    return optimizer.param_groups[0]["params"][0]  # type: ignore[no-any-return]


CHANGES: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "a step": lambda o: o.step(),
    "an in-place parameter update": lambda o: _first_param(o).detach().mul_(2),
    "a storage retarget (p.data = ...)": lambda o: setattr(_first_param(o), "data", torch.zeros(3)),
    "an option change": lambda o: o.param_groups[0].__setitem__("lr", 0.2),
    "a new option": lambda o: o.param_groups[0].__setitem__("initial_lr", 0.1),
    "an in-place state write": lambda o: o.state[_first_param(o)]["momentum_buffer"].add_(1),
    "a replaced state tensor": lambda o: o.state[_first_param(o)].__setitem__("momentum_buffer", torch.zeros(3)),
    "a replaced state entry": lambda o: o.state.__setitem__(_first_param(o), {}),
    "a reordered params list": lambda o: o.param_groups[0]["params"].reverse(),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_a_commit_must_notice_changes_the_token(change: str) -> None:
    optimizer = _optimizer()
    before = _token(optimizer)
    CHANGES[change](optimizer)
    assert _token(optimizer) != before


def test_inference_tensors_have_no_version_but_a_stable_token() -> None:
    with torch.inference_mode():
        lr = torch.tensor(0.1)
    optimizer = _optimizer()
    optimizer.param_groups[0]["lr_tensor"] = lr
    assert _token(optimizer) == _token(optimizer)


def test_a_write_that_bypasses_the_version_counter_is_the_documented_blind_spot() -> None:
    optimizer = _optimizer()
    before = _token(optimizer)
    _first_param(optimizer).data.add_(1)  # .data has its own version counter
    assert _token(optimizer) == before


def test_compatibility_names_keep_their_case() -> None:
    shard = replicated("Model.Layer.Weight", (2,))
    assert LogicalSlotBinding(0, 0, "Model.Layer.Weight", shard).compatibility_name == "Model.Layer.Weight"
    assert LogicalSlotBinding(0, 1, "", shard).compatibility_name == ""

"""The docs' example adopter (``gefen_example_sgd.ContractedSGD``) behaves as torch's SGD where
adopters copy it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from gefen_contracts import StaleTransactionError, StateValidationError
from gefen_example_sgd import ContractedSGD


def test_the_example_adopter_loads_a_checkpoint_with_a_schedulers_group_key() -> None:
    """A group key the optimizer does not own (a scheduler's ``initial_lr``) comes along on load,
    as torch's does; the example refused it, and adopters copy the example."""
    model = torch.nn.Linear(4, 2)
    source = ContractedSGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(source, step_size=1, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    source.step()
    scheduler.step()
    saved = source.state_dict()
    target = ContractedSGD(torch.nn.Linear(4, 2).parameters(), lr=0.1, momentum=0.9)
    target.load_state_dict(saved)  # before its scheduler exists, as a resume does
    assert target.param_groups[0]["initial_lr"] == 0.1 and target.param_groups[0]["lr"] == 0.05
    saved["param_groups"][0].pop("momentum")
    with pytest.raises(StateValidationError, match="must hold 'params' and the options"):
        target.load_state_dict(saved)


def test_a_copy_of_the_example_adopter_steps_as_the_original_does() -> None:
    # torch's __getstate__ keeps defaults, state and groups only: the copy lacked its counter
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = ContractedSGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    for duplicate in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        twin_model, twin = duplicate((model, optimizer))
        for m, o in ((model, optimizer), (twin_model, twin)):
            o.zero_grad()
            m(torch.ones(4, 3)).sum().backward()
            o.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
        twin_model.load_state_dict(model.state_dict())


def test_a_load_staged_before_a_new_param_group_is_stale() -> None:
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = ContractedSGD(first.parameters(), lr=0.1)
    staged = optimizer.stage_state_dict(optimizer.state_dict())
    optimizer.add_param_group({"params": list(second.parameters())})
    with pytest.raises(StaleTransactionError):
        optimizer.commit_staged_state_dict(staged)

"""The docs' example adopter (``gefen_example_sgd.ContractedSGD``) behaves as torch's SGD where
adopters copy it."""

from __future__ import annotations

import pytest
import torch
from gefen_contracts import StateValidationError
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

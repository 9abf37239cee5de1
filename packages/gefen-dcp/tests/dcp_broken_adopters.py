"""A parameter-shaped adopter that breaks the round trip (for the conformance checks' proof).

An adopter whose staged load mutates before validating cannot break the atomic-load check
through ``GefenDCPState``: every corruption is refused before the optimizer sees the state;
the kit's own staged-native-load checks catch that adopter."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts.transactions import StagedTransaction
from gefen_dcp.testing import Int8MomentumSGD


class ForgetfulLoad(Int8MomentumSGD):
    """Stages zeros instead of the loaded momentum."""

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        zeroed = {
            "param_groups": state_dict["param_groups"],
            "state": {
                number: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                for number, entry in state_dict["state"].items()
            },
        }
        return super().stage_state_dict(zeroed)


def forgetful(named: list[tuple[str, torch.nn.Parameter]]) -> ForgetfulLoad:
    return ForgetfulLoad(named, lr=0.05, momentum=0.9)

"""``torch.compile(GefenMuon.step)`` gives the eager step's results bit for bit.

Traced by TorchDynamo (torch 2.15), the step applied the second matrix's update to the
first parameter (the work item's guards omit the parameter's identity); ``step`` is now
excluded from tracing, so a compiled step is the eager step.
"""

from __future__ import annotations

import copy
import warnings

import torch
from gefen_core import GefenMuon


def _two_matrix_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False), torch.nn.Linear(16, 16, bias=False))


def test_a_compiled_step_matches_the_eager_step_bit_for_bit() -> None:
    eager_model = _two_matrix_model()
    compiled_model = copy.deepcopy(eager_model)
    eager = GefenMuon(list(eager_model.named_parameters()), lr=0.02)
    compiled = GefenMuon(list(compiled_model.named_parameters()), lr=0.02)
    compiled_step = torch.compile(compiled.step, backend="eager")
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for model, step in ((eager_model, eager.step), (compiled_model, compiled_step)):
                model.zero_grad()
                model(inputs).square().mean().backward()
                step()
    for expected, got in zip(eager_model.parameters(), compiled_model.parameters()):
        assert torch.equal(expected, got)
    assert all(not torch.equal(p, q) for p, q in zip(eager_model.parameters(), _two_matrix_model().parameters()))

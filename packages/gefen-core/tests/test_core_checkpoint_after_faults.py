"""Checkpoints taken after a fault: a step that failed partway (a kernel out of memory in a later
bucket) and model surgery (a parameter resized after its first step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts.testing import CheckContext
from gefen_core import Gefen, GefenMuon
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)

_roundtrip = CheckContext.weights_only_roundtrip


def _net() -> torch.nn.Module:
    """Parameters on two update paths (per-element and block second moments): two update calls."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8, bias=False))


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_step_that_fails_partway_still_counts_so_later_checkpoints_load(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel failing in the step's second update call (an out-of-memory on a device) leaves
    the first call's parameters stepped and their counters advanced; the global step advances
    with them, or every later checkpoint held a parameter's step above it and was refused."""
    from gefen_core import ops

    torch.manual_seed(0)
    if kind == "gefen":
        model = _net()
        opt: Any = Gefen(model.named_parameters(), lr=1e-2, fused=False)
        update_ops = {ops.BLOCK_STEP, ops.ELEMENT_STEP, ops.FACTORED_STEP}
        build: Callable[[], Any] = lambda: Gefen(model.named_parameters(), lr=1e-2, fused=False)  # noqa: E731
    else:
        model = torch.nn.Sequential(torch.nn.Linear(12, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
        opt = GefenMuon(model.named_parameters(), lr=1e-2, fused=False)
        update_ops = {ops.MUON_MOMENTUM}
        build = lambda: GefenMuon(model.named_parameters(), lr=1e-2, fused=False)  # noqa: E731

    def step() -> None:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()

    step()
    calls = []
    real_op = ops.Kernels.op

    def failing_second_update(self: ops.Kernels, name: str) -> Callable[..., Any]:
        run = real_op(self, name)
        if name not in update_ops:
            return run

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if len(calls) == 2:
                raise RuntimeError("out of memory (injected)")
            return run(*args, **kwargs)

        return call

    monkeypatch.setattr(ops.Kernels, "op", failing_second_update)
    with pytest.raises(RuntimeError, match="injected"):
        step()
    monkeypatch.undo()
    assert len(calls) == 2
    steps = [int(state["step"]) for state in opt.state.values()]
    assert max(steps) == 2 and opt.global_step == 2  # the first call's parameters stepped
    step()
    build().load_state_dict(_roundtrip(opt.state_dict()))


def test_a_state_dict_after_a_parameter_was_resized_names_it() -> None:
    """``state_dict()`` after model surgery (a bias given another length after its first step)
    raised torch's bare reshape error; it raises the step's own refusal, naming the parameter."""
    from gefen_core import ParameterError

    model = torch.nn.Linear(30, 20)
    opt = Gefen(model.named_parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    model.bias.data = torch.zeros(40)
    with pytest.raises(ParameterError, match=r"\['params'\]\[1\] \('bias'\): .*resized after its first step"):
        opt.state_dict()

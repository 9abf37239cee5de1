"""Kernel resolutions are kept between steps and asked again when what they depend on changes."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import KernelRegistry
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_core import Gefen
from gefen_core.ops import OPS


class _AskedProvider:
    """Runs the reference implementations and counts ``supports`` questions per op."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}
        self.runs = 0

    @property
    def name(self) -> str:
        return "asked"

    def op_ids(self) -> frozenset[str]:
        return frozenset(OPS)

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
        self.asked[op_id] = self.asked.get(op_id, 0) + 1
        return True

    def implementation(self, op_id: str) -> Callable[..., Any]:
        reference = OPS[op_id].reference

        def run(*args: Any, **kwargs: Any) -> Any:
            self.runs += 1
            return reference(*args, **kwargs)

        return run


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(3)
    return [torch.nn.Parameter(torch.randn(6, 10)), torch.nn.Parameter(torch.randn(10))]


def _step(opt: Gefen, params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


@pytest.mark.parametrize("fused", [None, True])
def test_a_step_with_nothing_changed_resolves_nothing(fused: bool | None) -> None:
    provider = _AskedProvider()
    params = _params()
    opt = Gefen(params, lr=1e-2, fused=fused, kernel_registry=KernelRegistry([provider]))
    _step(opt, params)  # learns the codebook; states start
    _step(opt, params)  # resolves once for the live states
    asked = dict(provider.asked)
    runs = provider.runs
    for _ in range(3):
        _step(opt, params)
    assert provider.asked == asked
    assert provider.runs == runs + 3 * 3  # matrix: moments + step; vector: block step


def test_a_changed_option_or_parameter_is_resolved_again() -> None:
    provider = _AskedProvider()
    params = _params()
    opt = Gefen(params, lr=1e-2, fused=True, kernel_registry=KernelRegistry([provider]))
    for _ in range(2):
        _step(opt, params)
    asked = sum(provider.asked.values())
    opt.param_groups[0]["maximize"] = True  # a kernel flag changes
    _step(opt, params)
    after_flag = sum(provider.asked.values())
    assert after_flag > asked
    opt.param_groups[0]["maximize"] = False
    with torch.no_grad():
        params[0].data = params[0].data.t().contiguous().t()  # same values, now strided
    _step(opt, params)
    assert sum(provider.asked.values()) > after_flag


class _QuietProvider(_AskedProvider):
    """Counts nothing (a snapshot of the optimizer reaches its providers)."""

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
        return True

    def implementation(self, op_id: str) -> Callable[..., Any]:
        return OPS[op_id].reference


def test_preflight_and_pickling_leave_the_memo_out() -> None:
    provider = _QuietProvider()
    params = _params()
    opt = Gefen(params, lr=1e-2, fused=None, kernel_registry=KernelRegistry([provider]))
    _step(opt, params)
    for p in params:
        p.grad = torch.randn_like(p)
    before = deep_snapshot(opt, *params)
    opt.preflight_step()  # resolves for the live states, keeps nothing
    assert not snapshot_diff(before, opt, *params)
    opt.step()
    restored = pickle.loads(pickle.dumps(opt))
    assert "_kernels_resolved" not in restored.__dict__
    assert restored.state_dict()["state"].keys() == opt.state_dict()["state"].keys()

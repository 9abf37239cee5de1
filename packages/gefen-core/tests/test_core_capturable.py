"""``capturable=True``: bit-identical to the eager path on CPU; CUDA graphs when a GPU exists."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from gefen_core import CaptureError, Gefen
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def _params(device: str = "cpu") -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(16, 24, device=device)),
        torch.nn.Parameter(torch.randn(24, device=device)),
        torch.nn.Parameter(torch.randn(4, 6, 8, device=device)),
    ]


def _grads(step: int, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator).to(p.device) for p in params]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"factored_v_2d": False, "weight_decay": 0.1},
        {"stochastic_round": True, "maximize": True},
        {"lr": torch.tensor(3e-3), "betas": (0.8, 0.95)},
    ],
)
def test_capturable_is_bit_identical_to_eager_on_cpu(options: dict[str, Any]) -> None:
    eager_params, captured_params = _params(), _params()
    lr = options.pop("lr", 3e-3)
    eager = Gefen(eager_params, lr=lr.clone() if isinstance(lr, torch.Tensor) else lr, fused=False, **options)
    capturable = Gefen(captured_params, lr=lr, fused=False, capturable=True, **options)
    for step in range(8):
        for p, q, g in zip(eager_params, captured_params, _grads(step, eager_params)):
            p.grad, q.grad = g.clone(), g.clone()
        eager.step()
        capturable.step()
    for p, q in zip(eager_params, captured_params):
        assert torch.equal(p, q)
    assert isinstance(capturable.state[captured_params[0]]["step"], torch.Tensor)
    assert capturable.global_step == eager.global_step == 8
    assert capturable.state_dict()["state"][0]["step"] == 8


def test_capture_without_capturable_is_refused() -> None:
    params = _params()
    opt = Gefen(params, fused=False)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    with pytest.raises(CaptureError, match="capturable=True"):
        import unittest.mock

        with unittest.mock.patch("gefen_core.gefen.capturing", return_value=True):
            opt.step()
    assert opt.codebook is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_eager_capturable() -> None:
    graph_params, eager_params = _params("cuda"), _params("cuda")
    lr = torch.tensor(3e-3, device="cuda")
    graphed = Gefen(graph_params, lr=lr, fused=False, capturable=True, stochastic_round=True)
    eager = Gefen(eager_params, lr=lr.clone(), fused=False, capturable=True, stochastic_round=True)
    static_grads = [torch.zeros_like(p) for p in graph_params]
    for p, g in zip(graph_params, static_grads):
        p.grad = g
    first = _grads(0, graph_params)
    for g, value in zip(static_grads, first):
        g.copy_(value)
    for p, value in zip(eager_params, first):
        p.grad = value.clone()
    graphed.step()  # eager warm-up learns the codebook and creates the state
    eager.step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.step()
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(1, 6):
        values = _grads(step, graph_params)
        for g, value in zip(static_grads, values):
            g.copy_(value)
        graph.replay()
        for p, value in zip(eager_params, values):
            p.grad = value.clone()
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(graph_params, eager_params):
        assert torch.equal(p, q)
    assert graphed.global_step == 6


@pytest.mark.parametrize("fused", [False, None])
def test_parameters_whose_counters_differ_share_one_call_bit_identically(fused: bool | None) -> None:
    """A parameter that started later has other counters than its bucket's others: the bucket's
    scalars become one row per parameter (host rows eagerly; one vectorised device computation
    and one counter op under ``capturable``), on the reference and on the kernels alike."""
    shapes = [(8, 12), (12, 8), (6, 10), (12,), (10,)]
    late = {1, 3}  # no gradient for the first two steps

    def run(capturable: bool) -> tuple[list[torch.Tensor], Gefen]:
        torch.manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
        optimizer = Gefen(params, lr=3e-3, fused=fused, capturable=capturable, weight_decay=0.1)
        for step in range(6):
            generator = torch.Generator().manual_seed(200 + step)
            for index, param in enumerate(params):
                grad = torch.randn(param.shape, generator=generator)
                param.grad = None if step < 2 and index in late else grad
            optimizer.step()
        return [p.detach().clone() for p in params], optimizer

    (eager, eager_opt), (captured, captured_opt) = run(False), run(True)
    for expected, got in zip(eager, captured):
        assert torch.equal(expected, got)
    steps = [int(captured_opt.state[p]["step"]) for p in captured_opt.param_groups[0]["params"]]
    assert steps == [6, 4, 6, 4, 6] == [eager_opt.state[p]["step"] for p in eager_opt.param_groups[0]["params"]]

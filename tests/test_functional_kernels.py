"""``gefen_core.functional.gefen`` over gefen-kernels (``fused=None`` and ``True``): bit for bit ``Gefen.step``."""

from __future__ import annotations

import copy

import pytest
import torch
from gefen_core import Gefen
from gefen_core.functional import gefen

SHAPES = [(37,), (128, 160), (8, 16), (4096 + 37,)]  # block, factored, element, ragged blocks


@pytest.mark.parametrize("fused", [None, True])
def test_the_functional_update_runs_the_kernels_bit_for_bit(fused: bool | None) -> None:
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = Gefen(params, lr=3e-3, fused=True)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    tensors = [param.detach().clone() for param in params]
    states = [copy.deepcopy(optimizer.state[param]) for param in params]
    grads = [torch.randn_like(param) for param in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    codebook = optimizer.codebook
    assert codebook is not None
    optimizer.step()
    gefen(tensors, grads, states, codebook=codebook, lr=3e-3, fused=fused)
    for param, tensor, state in zip(params, tensors, states):
        assert torch.equal(param.detach(), tensor)
        live = optimizer.state[param]
        for key, value in state.items():
            assert torch.equal(live[key], value) if isinstance(value, torch.Tensor) else live[key] == value, key

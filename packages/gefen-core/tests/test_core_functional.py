"""The functional form ``gefen_core.functional.gefen``: bit for bit ``Gefen.step``, checks before changes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from gefen_contracts import StateValidationError
from gefen_core import Gefen, GefenOptionError, GefenOptionTypeError, GradientError, ParameterError
from gefen_core.functional import gefen
from gefen_core.param_state import state_variant

SHAPES = [(37,), (128, 160), (8, 16)]  # block, factored and element second moments


def _trained(**options: Any) -> tuple[list[torch.nn.Parameter], Gefen]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = Gefen(params, lr=1e-2, fused=False, **options)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    return params, optimizer


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.0, "maximize": True}, {"clip_threshold": 1.0}])
def test_the_functional_update_is_the_optimizers_step_bit_for_bit(options: dict[str, Any]) -> None:
    params, optimizer = _trained(**options)
    tensors = [param.detach().clone() for param in params]
    states = [copy.deepcopy(optimizer.state[param]) for param in params]
    assert {state_variant(state) for state in states} == {"block", "factored", "element"}
    grads = [torch.randn_like(param) for param in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    codebook = optimizer.codebook
    assert codebook is not None
    optimizer.step()
    gefen(tensors, grads, states, codebook=codebook, lr=1e-2, fused=False, **options)
    for param, tensor, state in zip(params, tensors, states):
        assert torch.equal(param.detach(), tensor)
        assert _same_state(optimizer.state[param], state)


def test_fused_true_requires_the_kernels_each_variant_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused=True`` asks for the op each second moment steps with (a narrow matrix's is
    ``element_step``, not the factored pair), and nothing else."""
    from gefen_core import ops

    params, optimizer = _trained()
    states = [copy.deepcopy(optimizer.state[param]) for param in params]
    tensors = [param.detach().clone() for param in params]
    required: list[str] = []
    monkeypatch.setattr(ops.Kernels, "require", lambda self, op, device: required.append(op))
    codebook = optimizer.codebook
    assert codebook is not None
    gefen(tensors, [torch.randn_like(t) for t in tensors], states, codebook=codebook, lr=1e-2, fused=True)
    assert sorted(required) == sorted([ops.BLOCK_STEP, ops.FACTORED_MOMENTS, ops.FACTORED_STEP, ops.ELEMENT_STEP])


def test_stochastic_rounding_takes_the_optimizers_seeds() -> None:
    params, optimizer = _trained(stochastic_round=True)
    tensors = [param.detach().clone() for param in params]
    states = [copy.deepcopy(optimizer.state[param]) for param in params]
    grads = [torch.randn_like(param) for param in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    from gefen_core.momentum_codec import stochastic_seed

    seeds = torch.tensor([stochastic_seed(optimizer.global_step, slot) for slot in range(len(params))])
    codebook = optimizer.codebook
    assert codebook is not None
    optimizer.step()
    gefen(tensors, grads, states, codebook=codebook, lr=1e-2, fused=False, seeds=seeds)
    for param, tensor in zip(params, tensors):
        assert torch.equal(param.detach(), tensor)


def _edit(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of ``state`` with fields dropped (``None``), cast (``float``: fp64, ``int``: int64)
    or cut (a slice of the first dimension)."""
    out = dict(state)
    for key, change in changes.items():
        if change is None:
            del out[key]
        elif isinstance(change, slice):
            out[key] = state[key][change].clone()
        else:
            out[key] = state[key].to(torch.float64 if change is float else torch.int64)
    return out


def test_the_update_runs_without_autograd_as_the_optimizers_step() -> None:
    """Parameters that require grad and gradients that carry a graph: no history enters the
    parameters or the state, on the reference as on the kernels."""
    params, optimizer = _trained()
    codebook = optimizer.codebook
    assert codebook is not None
    for fused in (False, None):
        states = [copy.deepcopy(optimizer.state[param]) for param in params]
        leaves = [torch.nn.Parameter(param.detach().clone()) for param in params]
        grads = [(leaf * 2).detach().requires_grad_() * 1.0 for leaf in leaves]  # grads with a grad_fn
        gefen(leaves, grads, states, codebook=codebook, lr=1e-2, fused=fused)
        assert all(leaf.grad_fn is None for leaf in leaves)
        assert not any(v.grad_fn for state in states for v in state.values() if isinstance(v, torch.Tensor))
        copy.deepcopy(states)


def test_bad_input_is_refused_before_anything_changes() -> None:
    params, optimizer = _trained()
    tensors = [param.detach().clone() for param in params]
    states = [copy.deepcopy(optimizer.state[param]) for param in params]
    grads = [torch.randn_like(param) for param in params]
    codebook = optimizer.codebook
    assert codebook is not None
    before = [tensor.clone() for tensor in tensors]
    steps = [state["step"] for state in states]
    cases: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (GefenOptionError, "one entry each", {"grads": grads[:2]}),
        (ParameterError, "has no state", {"states": [*states[:2], {}]}),
        (ParameterError, "created for", {"states": [states[0], states[2], states[1]]}),
        (GefenOptionError, "epsilon", {"eps": 0.0}),
        (StateValidationError, "codebook", {"codebook": codebook.double()}),
        (GefenOptionError, "seeds", {"seeds": torch.zeros(2, dtype=torch.int64)}),
        (ParameterError, "device tensors", {"states": [*states[:2], {**states[2], "step": torch.tensor(2.0)}]}),
        # every field as the schema declares it, before a kernel sees it (or a counter moves)
        (
            ParameterError,
            "m_magnitude must be a torch.float32",
            {"states": [_edit(states[0], m_magnitude=float), *states[1:]]},
        ),
        (ParameterError, "m_codes must be a torch.uint8", {"states": [_edit(states[0], m_codes=int), *states[1:]]}),
        (ParameterError, "lacks 'v_col'", {"states": [states[0], _edit(states[1], v_col=None), states[2]]}),
        (ParameterError, "one scale per block", {"states": [*states[:2], _edit(states[2], m_magnitude=slice(-1))]}),
        (ParameterError, "an int >= 0", {"states": [*states[:2], {**states[2], "v_step": -1}]}),
        # types the kernels' schema would refuse only after the first bucket's counters moved
        (GefenOptionTypeError, "deterministic must be a bool", {"deterministic": "yes", "fused": None}),
        (GefenOptionTypeError, "fused must be None, True or False", {"fused": "yes"}),
        (GefenOptionTypeError, "seeds must be an int64 tensor", {"seeds": [1, 2, 3]}),
        (GradientError, r"grads\[1\] must be a tensor", {"grads": [grads[0], None, grads[2]]}),
        (ParameterError, r"params\[0\] must be a tensor", {"params": [3.0, *tensors[1:]]}),
        # a strided state tensor: the functional form updates the caller's tensors in place
        (
            ParameterError,
            "must be contiguous",
            {"states": [*states[:2], {**states[2], "m_codes": states[2]["m_codes"].t().contiguous().t()}]},
        ),
        # a parameter dtype the class refuses when a group is added: the first entry had stepped
        (
            ParameterError,
            r"params\[2\]: dtype torch.int32 is not supported",
            {"params": [*tensors[:2], tensors[2].to(torch.int32)], "grads": [*grads[:2], grads[2].to(torch.int32)]},
        ),
        # the kernels step entries concurrently: one listed twice raced (results varied run to run)
        (
            ParameterError,
            r"params\[0\] and params\[2\] overlap in storage",
            {
                "params": [tensors[0], tensors[1], tensors[0]],
                "states": [states[0], states[1], states[0]],
                "grads": [grads[0], grads[1], grads[0]],
            },
        ),
        (
            ParameterError,
            r"states\[0\] and states\[1\] are the same dict",
            {
                "params": [tensors[0], tensors[0].clone(), tensors[2]],
                "grads": [grads[0], grads[0], grads[2]],
                "states": [states[0], states[0], states[2]],
            },
        ),
    ]
    for error, match, override in cases:
        arguments: dict[str, Any] = {
            "params": tensors, "grads": grads, "states": states, "codebook": codebook, "fused": False, **override
        }  # fmt: skip
        with pytest.raises(error, match=match):
            gefen(arguments.pop("params"), arguments.pop("grads"), arguments.pop("states"), **arguments)
        assert all(torch.equal(a, b) for a, b in zip(tensors, before)), match
        assert [state["step"] for state in states] == steps, match

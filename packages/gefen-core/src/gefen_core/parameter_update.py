"""One parameter's update: counters, step scalars, the kernel calls and the write-back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import step_scalars
from .distributed import all_reduce_sums
from .ops import BLOCK_STEP, FACTORED_MOMENTS, FACTORED_STATS, FACTORED_STEP, Kernels
from .param_state import (
    AGE_KEYS,
    FACTORED,
    INDICES,
    MAGNITUDE,
    STEP,
    V_COL,
    V_ROW,
    VMEAN,
    state_variant,
    switch_second_moment,
)
from .second_moment import clip_row_factor, preconditioned_sumsq, update_factored_moments
from .step_plan import ParamWork

__all__ = ["decay_only", "placeholder_codebook", "step_calls", "update_parameter"]

Call = tuple[str, tuple[Any, ...], dict[str, Any]]


def placeholder_codebook(device: torch.device) -> torch.Tensor:
    """Any valid codebook: used only while no codebook exists, when every block scale is 0
    (all of this rank's gradients so far were zero), so the codes decode to 0 regardless."""
    return torch.linspace(-1.0, 1.0, 256, dtype=torch.float32, device=device)


def _lr_value(lr: float | torch.Tensor) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def decay_only(local: torch.Tensor, group: Mapping[str, Any]) -> None:
    """The decoupled decay of a parameter that has no state yet (its gradient is all zero)."""
    if group["weight_decay"] == 0:
        return
    decay = 1.0 - _lr_value(group["lr"]) * group["weight_decay"]
    local.mul_(torch.tensor(decay, dtype=torch.float32).to(local.device))


def _bump(state: dict[str, Any], key: str) -> None:
    value = state[key]
    if isinstance(value, torch.Tensor):
        value.add_(1)
    else:
        state[key] = value + 1


def _scalars(work: ParamWork, group: Mapping[str, Any], state: dict[str, Any], capturable: bool) -> torch.Tensor:
    beta1, beta2 = group["betas"]
    step, age = state[STEP], state[AGE_KEYS[work.variant]]
    common = {
        "beta1": beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "factored": work.variant == FACTORED,
    }
    if capturable:
        return step_scalars.device_scalars(lr=group["lr"], step=step, age=age, **common)
    lr = _lr_value(group["lr"])
    if type(step) is int and type(age) is int:  # one shared tensor per step (hashable values only)
        plain = {key: value if isinstance(value, bool) else float(value) for key, value in common.items()}
        return step_scalars.shared_host_scalars(work.local.device, lr=lr, step=step, age=age, **plain)
    return step_scalars.host_scalars(work.local.device, lr=lr, step=step, age=age, **common)


def step_calls(
    work: ParamWork,
    group: Mapping[str, Any],
    state: dict[str, Any],
    *,
    target: torch.Tensor,
    grad: torch.Tensor,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    seed: torch.Tensor | None,
    row_factor: torch.Tensor,
    deterministic: bool,
) -> list[Call]:
    """The kernel call that steps ``work`` (``target``/``grad``: contiguous local tensors)."""
    flags = {
        "apply_decay": group["weight_decay"] != 0,
        "maximize": bool(group["maximize"]),
        "deterministic": deterministic,
    }
    if work.variant == FACTORED:
        factored = (target, grad, state[INDICES], state[MAGNITUDE], row_factor, state[V_COL], codebook, scalars, seed)
        return [(FACTORED_STEP, factored, flags)]
    block = (target.view(-1), grad.view(-1), state[INDICES], state[MAGNITUDE], state[VMEAN], codebook, scalars, seed)
    return [(BLOCK_STEP, block, flags)]


def _moments_call(
    work: ParamWork, state: dict[str, Any], grad: torch.Tensor, scalars: torch.Tensor, deterministic: bool
) -> Call:
    """The second-moment call of a factored parameter: the statistics alone when its rows are
    sharded (the column sums are all-reduced before the update), else statistics and update."""
    if work.row_sharded:
        return (FACTORED_STATS, (grad,), {"deterministic": deterministic})
    return (FACTORED_MOMENTS, (grad, state[V_ROW], state[V_COL], scalars), {"deterministic": deterministic})


def update_parameter(
    work: ParamWork,
    group: Mapping[str, Any],
    stats: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    dispatch: Kernels,
    codebook: torch.Tensor,
    seed: torch.Tensor | None,
    deterministic: bool,
    capturable: bool,
) -> None:
    """Advance counters and second moment, then requantise the momentum and write ``work``'s
    parameter (through a contiguous copy when the parameter is strided)."""
    state = work.state
    assert state is not None
    if state_variant(state) != work.variant:
        switch_second_moment(state, work.variant, work.local, capturable)
    _bump(state, STEP)
    _bump(state, AGE_KEYS[work.variant])
    scalars = _scalars(work, group, state, capturable)
    target = work.local if work.local.is_contiguous() else work.local.contiguous()
    grad = work.grad.contiguous()
    row_factor = scalars
    if work.variant == FACTORED and stats is not None:
        row_sums, col_sums = stats
        row_factor = update_factored_moments(state[V_ROW], state[V_COL], row_sums, col_sums, work.global_rows, scalars)
    elif work.variant == FACTORED:
        op, args, kwargs = _moments_call(work, state, grad, scalars, deterministic)
        row_factor = dispatch(op, *args, **kwargs)
    threshold = group["clip_threshold"]
    if work.variant == FACTORED and threshold is not None:
        sumsq = preconditioned_sumsq(grad, row_factor, state[V_COL], scalars)
        if work.row_sharded:
            all_reduce_sums([(work.param, sumsq)])
        row_factor = clip_row_factor(row_factor, sumsq, work.global_rows * grad.shape[1], threshold)
    calls = step_calls(
        work,
        group,
        state,
        target=target,
        grad=grad,
        codebook=codebook,
        scalars=scalars,
        seed=seed,
        row_factor=row_factor,
        deterministic=deterministic,
    )
    for op, args, kwargs in calls:
        dispatch(op, *args, **kwargs)
    if target is not work.local:
        work.local.copy_(target)

"""One parameter's update: counters, step scalars, the kernel calls and the write-back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import step_scalars
from .distributed import all_reduce_sums
from .ops import BLOCK_STEP, FACTORED_MOMENTS, FACTORED_STEP, Kernels
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

__all__ = ["decay_only", "placeholder_codebook", "update_parameter"]


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
    if work.variant == FACTORED and stats is not None:  # row-sharded: the column sums were all-reduced
        row_sums, col_sums = stats
        row_factor = update_factored_moments(state[V_ROW], state[V_COL], row_sums, col_sums, work.global_rows, scalars)
    elif work.variant == FACTORED:
        row_factor = dispatch(FACTORED_MOMENTS, grad, state[V_ROW], state[V_COL], scalars, deterministic=deterministic)
    threshold = group["clip_threshold"]
    if work.variant == FACTORED and threshold is not None:
        sumsq = preconditioned_sumsq(grad, row_factor, state[V_COL], scalars)
        if work.row_sharded:
            all_reduce_sums([(work.param, sumsq)])
        row_factor = clip_row_factor(row_factor, sumsq, work.global_rows * grad.shape[1], threshold)
    flags = {
        "apply_decay": group["weight_decay"] != 0,
        "maximize": bool(group["maximize"]),
        "deterministic": deterministic,
    }
    momentum = (state[INDICES], state[MAGNITUDE])
    if work.variant == FACTORED:
        dispatch(FACTORED_STEP, target, grad, *momentum, row_factor, state[V_COL], codebook, scalars, seed, **flags)
    else:
        dispatch(BLOCK_STEP, target.view(-1), grad.view(-1), *momentum, state[VMEAN], codebook, scalars, seed, **flags)
    if target is not work.local:
        work.local.copy_(target)

"""A step's updates: counters, step scalars, one kernel call per phase for a whole bucket of
parameters (one group's parameters of one second-moment variant on one device), the write-back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts.torch_support import on_device

from . import step_scalars
from .distributed import all_reduce_sums
from .ops import BLOCK_STEP, ELEMENT_STEP, FACTORED_MOMENTS, FACTORED_STEP, Kernels
from .param_state import (
    AGE_KEYS,
    BLOCK,
    ELEMENT,
    FACTORED,
    INDICES,
    MAGNITUDE,
    STEP,
    V_COL,
    V_ROW,
    VARIANT_MARKERS,
    switch_second_moment,
)
from .reference_ops import scalars_of
from .second_moment import clip_row_factor, preconditioned_sumsq, update_factored_moments
from .step_plan import ParamWork

__all__ = ["decay_only", "placeholder_codebook", "update_parameters"]

Stats = Mapping[int, tuple[torch.Tensor, torch.Tensor]]


def placeholder_codebook(device: torch.device) -> torch.Tensor:
    """Any valid codebook: used only while no codebook exists, when every block scale is 0
    (all of this rank's gradients so far were zero), so the codes decode to 0 regardless."""
    return torch.linspace(-1.0, 1.0, 256, dtype=torch.float32, device=device)


def _lr_value(lr: float | torch.Tensor) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def decay_only(local: torch.Tensor, group: Mapping[str, Any]) -> None:
    """The decoupled decay of a parameter whose gradient is all zero and whose state is new or
    absent (a multiplication by exactly 1, as at ``lr = 0``, is skipped)."""
    if group["weight_decay"] == 0:
        return
    decay = 1.0 - _lr_value(group["lr"]) * group["weight_decay"]
    if decay == 1.0:
        return
    local.mul_(on_device([decay], torch.float32, local.device)[0])


def _scalars(
    states: Sequence[dict[str, Any]], group: Mapping[str, Any], variant: str, device: torch.device, capturable: bool
) -> torch.Tensor:
    """The bucket's step scalars: one shared packet when every parameter's counters agree (the
    usual case), else one row per parameter (``[N, NUM_SCALARS]``)."""
    beta1, beta2 = group["betas"]
    age_key = AGE_KEYS[variant]
    common = {
        "beta1": beta1,
        "beta2": beta2,
        "eps": group["eps"],
        "weight_decay": group["weight_decay"],
        "factored": variant != BLOCK,  # the factored and element paths share BC2 = 1 / (1 - beta2^tau)
    }
    if capturable:  # every counter pair at once: a fixed number of device ops per bucket
        steps = torch.stack([s[STEP] for s in states])
        ages = torch.stack([s[age_key] for s in states])
        return step_scalars.device_scalars(lr=group["lr"], step=steps, age=ages, **common)
    lr = _lr_value(group["lr"])
    step, age = states[0][STEP], states[0][age_key]
    if type(step) is int and type(age) is int and all(s[STEP] == step and s[age_key] == age for s in states):
        # one cached tensor per distinct set of values (hashable plain values only)
        plain = {key: value if isinstance(value, bool) else float(value) for key, value in common.items()}
        return step_scalars.shared_host_scalars(device, lr=lr, step=step, age=age, **plain)
    rows = [step_scalars.host_scalars(device, lr=lr, step=s[STEP], age=s[age_key], **common) for s in states]
    return torch.stack(rows)


def _row_factors(
    works: Sequence[ParamWork],
    grads: list[torch.Tensor],
    stats: Stats,
    scalars: torch.Tensor,
    *,
    dispatch: Kernels,
    deterministic: bool,
) -> list[torch.Tensor]:
    """Advance ``v_row``/``v_col`` and return each ``row_factor`` of a bucket that holds row-sharded
    parameters: their small update from all-reduced sums, ``factored_moments`` for the others."""
    states = [work.state for work in works]
    factors: list[torch.Tensor] = []
    for index, (work, state) in enumerate(zip(works, states, strict=True)):
        assert state is not None
        sums = stats.get(work.slot)
        packet = scalars_of(scalars, index)
        if sums is None:
            args = ([grads[index]], [state[V_ROW]], [state[V_COL]], packet)
            factors.append(dispatch.op(FACTORED_MOMENTS)(*args, deterministic=deterministic))
        else:
            factors.append(update_factored_moments(state[V_ROW], state[V_COL], *sums, work.global_rows, packet))
    return factors


def _clip(
    works: Sequence[ParamWork],
    grads: list[torch.Tensor],
    factors: list[torch.Tensor],
    scalars: torch.Tensor,
    threshold: float,
) -> list[torch.Tensor]:
    """Each ``row_factor`` raised so the preconditioned update's RMS is at most ``threshold``
    (summed over the shards of a row-sharded parameter)."""
    clipped = []
    for index, work in enumerate(works):
        assert work.state is not None
        sumsq = preconditioned_sumsq(grads[index], factors[index], work.state[V_COL], scalars_of(scalars, index))
        if work.row_sharded:
            all_reduce_sums([(work.param, sumsq)])
        elements = work.global_rows * grads[index].shape[1]
        clipped.append(clip_row_factor(factors[index], sumsq, elements, threshold))
    return clipped


def update_parameters(
    works: Sequence[ParamWork],
    group: Mapping[str, Any],
    stats: Stats,
    *,
    dispatch: Kernels,
    codebook: torch.Tensor,
    seeds: torch.Tensor | None,
    deterministic: bool,
    capturable: bool,
) -> None:
    """Advance the counters and second moments of ``works`` (one bucket, every work with state),
    then requantise their momentum and write their parameters: one call of each op for the
    bucket. Strided parameters step through contiguous copies, written back after.
    ``stats``: the all-reduced row/column sums of row-sharded factored parameters, by slot."""
    variant = works[0].variant
    factored = variant == FACTORED
    age_key = AGE_KEYS[variant]
    marker = VARIANT_MARKERS[variant]
    states: list[dict[str, Any]] = []
    targets: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    indices: list[torch.Tensor] = []
    magnitudes: list[torch.Tensor] = []
    seconds: list[torch.Tensor] = []  # the second moment the op reads: vmean, v or v_row (the marker)
    copied = False  # whether a strided parameter steps through a contiguous copy
    for work in works:
        state = work.state
        assert state is not None
        if marker not in state:
            switch_second_moment(state, variant, work.local, capturable)
        if not capturable:  # ints here; capturable counters are device tensors, advanced below
            state[STEP] += 1
            state[age_key] += 1
        states.append(state)
        local = work.local
        if local.is_contiguous():
            targets.append(local)
        else:
            targets.append(local.contiguous())
            copied = True
        grads.append(work.grad.contiguous())
        indices.append(state[INDICES])
        magnitudes.append(state[MAGNITUDE])
        seconds.append(state[marker])
    if capturable:  # device counters, advanced in place by one op for the bucket
        torch._foreach_add_([s[STEP] for s in states] + [s[age_key] for s in states], 1)
    scalars = _scalars(states, group, variant, works[0].local.device, capturable)
    flags = {
        "apply_decay": group["weight_decay"] != 0,
        "maximize": bool(group["maximize"]),
        "deterministic": deterministic,
    }
    # the ops are called here, not through helpers: the fused path stays five frames deep
    if factored:
        v_cols = [s[V_COL] for s in states]
        if stats and any(work.slot in stats for work in works):
            factors = _row_factors(works, grads, stats, scalars, dispatch=dispatch, deterministic=deterministic)
        else:
            flat = dispatch.op(FACTORED_MOMENTS)(grads, seconds, v_cols, scalars, deterministic=deterministic)
            factors = list(flat.split([grad.shape[0] for grad in grads]))
        threshold = group["clip_threshold"]
        if threshold is not None:
            factors = _clip(works, grads, factors, scalars, threshold)
        step = dispatch.op(FACTORED_STEP)
        step(targets, grads, indices, magnitudes, factors, v_cols, codebook, scalars, seeds, **flags)
    else:
        op = ELEMENT_STEP if variant == ELEMENT else BLOCK_STEP
        dispatch.op(op)(targets, grads, indices, magnitudes, seconds, codebook, scalars, seeds, **flags)
    if copied:
        for work, target in zip(works, targets, strict=True):
            if target is not work.local:
                work.local.copy_(target)

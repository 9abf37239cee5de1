"""``gefen(...)``: Gefen's update as a function of tensor lists, as ``torch.optim.adamw.adamw`` is AdamW's.

The optimizer class learns what a step needs (periods, the codebook, new states: see
:mod:`gefen_core.gefen_step`) and then runs this update; the function runs the update alone,
for a caller that keeps the state itself (a functional training loop, another optimizer
wrapping Gefen's arithmetic). Every parameter must already have a state, made by a
``Gefen`` step or by :func:`gefen_core.param_state.new_state`; its keys say its second moment
(``block``, ``factored`` or ``element``). Counters advance in place, as in torch's functional
optimizers, and the result is bit for bit what ``Gefen.step`` computes for the same tensors.

``fused`` keeps its meaning: ``None`` runs the registered kernels (gefen-kernels) where they
exist and the reference elsewhere, ``True`` requires them, ``False`` runs the single-tensor
reference (:mod:`gefen_core.reference_ops`). Plain tensors only: a DTensor's factored
statistics need the optimizer's collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from gefen_contracts.torch_support import storage_overlap

from .codebook import validate_codebook
from .distributed import is_dtensor
from .errors import GefenOptionError, GefenOptionTypeError, GradientError, ParameterError
from .ops import Kernels
from .param_groups import check_parameters, normalize_group_options
from .param_state import INDICES, MAGNITUDE, PARAMETER_FIELDS, VARIANT_FIELDS, state_variant
from .parameter_update import update_parameters
from .step_plan import ParamWork, check_gradient, check_state, update_ops

__all__ = ["gefen"]


def _check_fields(state: dict[str, Any], variant: str, where: str) -> None:
    """Every field of the variant present with its declared dtype (counters Python ints >= 0)
    and one scale per block; the rest of the geometry is :func:`check_state`'s."""
    for key in VARIANT_FIELDS[variant]:
        if key not in state:
            raise ParameterError(f"{where}: its {variant} state lacks {key!r}")
        declared, value = PARAMETER_FIELDS[key].dtype, state[key]
        if declared == "int":
            if isinstance(value, torch.Tensor):
                raise ParameterError(f"{where}: its counters are device tensors (capturable=True); step it with Gefen")
            if type(value) is not int or value < 0:
                raise ParameterError(f"{where}: {key} must be an int >= 0, got {value!r}")
        elif not isinstance(value, torch.Tensor) or value.dtype != getattr(torch, declared):
            found = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ParameterError(f"{where}: {key} must be a torch.{declared} tensor, got {found}")
    blocks = state[INDICES].shape[0] if state[INDICES].dim() == 2 else -1
    if tuple(state[MAGNITUDE].shape) != (blocks, 1):
        raise ParameterError(f"{where}: {MAGNITUDE} must hold one scale per block of {INDICES}")


@torch.no_grad()  # as Gefen.step: gradients are constants, and no history enters the state
def gefen(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict[str, Any]],
    *,
    codebook: torch.Tensor,
    lr: float | torch.Tensor = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    maximize: bool = False,
    clip_threshold: float | None = None,
    fused: bool | None = None,
    deterministic: bool = False,
    seeds: torch.Tensor | None = None,
) -> None:
    """Update ``params`` in place from ``grads`` and their Gefen ``states`` (see the module docstring).

    ``codebook`` is the learned fp32 ``[256]`` codebook (``Gefen.codebook``); ``seeds`` one
    int64 stochastic-rounding seed per parameter, or ``None`` to round to nearest. The options
    mean what ``Gefen``'s do. Every argument is checked before anything changes:
    ``GefenOptionError`` for an option, ``GradientError`` / ``ParameterError`` naming the
    entry for a tensor or state that does not fit, ``StateValidationError`` for the codebook.
    """
    if not len(params) == len(grads) == len(states):
        raise GefenOptionError(
            f"gefen: params, grads and states must have one entry each ({len(params)}, {len(grads)}, {len(states)})"
        )
    if type(deterministic) is not bool:
        raise GefenOptionTypeError(f"gefen: deterministic must be a bool, got {type(deterministic).__name__}")
    if seeds is not None and not isinstance(seeds, torch.Tensor):
        raise GefenOptionTypeError(f"gefen: seeds must be an int64 tensor or None, got {type(seeds).__name__}")
    options = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
    group = normalize_group_options({**options, "clip_threshold": clip_threshold})
    table = validate_codebook(codebook, "gefen: codebook")
    dispatch = Kernels(fused)
    check_parameters(list(params))  # dtype and layout, as the class checks them when a group is added
    buckets: dict[tuple[str, torch.device], list[ParamWork]] = {}
    for slot, (param, grad, state) in enumerate(zip(params, grads, states)):
        where = f"gefen: params[{slot}]"
        if not isinstance(param, torch.Tensor):
            raise ParameterError(f"{where} must be a tensor, got {type(param).__name__}")
        if not isinstance(grad, torch.Tensor):
            raise GradientError(f"gefen: grads[{slot}] must be a tensor, got {type(grad).__name__}")
        if is_dtensor(param):
            raise ParameterError(f"{where} is a DTensor; the functional form takes plain tensors (use Gefen)")
        check_gradient(param, grad, where)
        variant = state_variant(state)
        if variant is None:
            raise ParameterError(f"{where} has no state; make one with a Gefen step or param_state.new_state")
        _check_fields(state, variant, where)
        if check_state(state, param, functools.partial(str, where)):  # formatted only on failure
            raise ParameterError(
                f"{where}: its state must be contiguous and on the parameter's device (the functional form "
                "updates the given tensors in place)"
            )
        work = ParamWork(0, slot, param, param, grad, None, variant, False, state, None)
        buckets.setdefault((variant, param.device), []).append(work)
    # the kernels step a list's entries concurrently: an entry that shares memory with another
    # (the same parameter or state listed twice) would race where the reference runs in order
    overlap = storage_overlap([(f"params[{slot}]", param) for slot, param in enumerate(params)])
    if overlap is None:
        states_seen: dict[int, int] = {}
        for slot, state in enumerate(states):
            if id(state) in states_seen:
                overlap = f"states[{states_seen[id(state)]}] and states[{slot}] are the same dict"
            states_seen[id(state)] = slot
    if overlap:
        raise ParameterError(f"gefen: {overlap}; each parameter and its state may appear once")
    if seeds is not None and (seeds.dtype != torch.int64 or seeds.shape != (len(params),)):
        raise GefenOptionError(
            f"gefen: seeds must be int64 of shape ({len(params)},), got {seeds.dtype} {tuple(seeds.shape)}"
        )
    if fused is True:
        for variant, device in buckets:
            for op in update_ops(variant):
                dispatch.require(op, device)
    for (_, device), works in buckets.items():
        bucket_seeds = None if seeds is None else seeds[[work.slot for work in works]].to(device)
        update_parameters(
            works,
            group,
            {},
            dispatch=dispatch,
            codebook=table.to(device),
            seeds=bucket_seeds,
            deterministic=deterministic,
            capturable=False,
        )

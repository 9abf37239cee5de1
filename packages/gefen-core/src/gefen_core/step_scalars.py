"""The per-step scalars every step op receives, packed in one fp32 tensor.

Kernels read their scalars from device memory (so a captured CUDA graph replays new
values) and receive them already rounded to fp32. Layout of the ``scalars`` tensor
(``float32[NUM_SCALARS]`` on the parameter's device):

==========================  =======================================================
index                       value (computed in float64, rounded once to fp32)
==========================  =======================================================
``LR``                      learning rate ``lr``
``INV_BC1``                 ``1 / (1 - beta1**t)``   (``t``: the parameter's step)
``BC2``                     block path: ``1 / sqrt(1 - beta2**tau)``;
                            factored path: ``1 / (1 - beta2**tau)``
                            (``tau``: the second moment's own age)
``DECAY``                   ``1 - lr * weight_decay``
``BETA1`` / ``ONE_MINUS_BETA1``  ``beta1`` / ``1 - beta1``
``BETA2`` / ``ONE_MINUS_BETA2``  ``beta2`` / ``1 - beta2``
``EPS``                     ``eps``
==========================  =======================================================

:func:`host_scalars` computes them with Python floats; :func:`device_scalars` computes
the same expressions with 0-dim float64 tensor ops on the parameter's device (capturable
steps, no host synchronisation). On CPU both give bit-identical fp32 values (tested).

GefenMuon's momentum op (``gefen::muon_momentum.v3``) receives its own, shorter packet
(``float32[MUON_NUM_SCALARS]``), built by :func:`muon_scalars`:

==========================  =======================================================
``MUON_BETA``               ``momentum``  (the EMA coefficient beta)
``MUON_ONE_MINUS_BETA``     ``1 - momentum`` (computed in float64, rounded once)
==========================  =======================================================
"""

from __future__ import annotations

import functools
import math

import torch
from gefen_contracts.torch_support import on_device

__all__ = [
    "BC2",
    "BETA1",
    "BETA2",
    "DECAY",
    "EPS",
    "INV_BC1",
    "LR",
    "MUON_BETA",
    "MUON_NUM_SCALARS",
    "MUON_ONE_MINUS_BETA",
    "NUM_SCALARS",
    "ONE_MINUS_BETA1",
    "ONE_MINUS_BETA2",
    "device_scalars",
    "host_scalar_values",
    "host_scalars",
    "shared_host_scalars",
    "muon_scalars",
]

LR, INV_BC1, BC2, DECAY, BETA1, ONE_MINUS_BETA1, BETA2, ONE_MINUS_BETA2, EPS = range(9)
NUM_SCALARS = 9

MUON_BETA, MUON_ONE_MINUS_BETA = range(2)
MUON_NUM_SCALARS = 2


def host_scalar_values(
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    age: int,
    factored: bool,
) -> list[float]:
    """The float64 values of the scalars (before rounding to fp32), in layout order."""
    inv_bc1 = 1.0 / (1.0 - beta1**step)
    bc2 = 1.0 - beta2**age
    bc2_term = 1.0 / bc2 if factored else 1.0 / math.sqrt(bc2)
    return [lr, inv_bc1, bc2_term, 1.0 - lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps]


def host_scalars(device: torch.device, **values: float | int | bool) -> torch.Tensor:
    """:func:`host_scalar_values` packed as fp32 on ``device`` (keyword arguments as there)."""
    floats = host_scalar_values(**values)  # type: ignore[arg-type]
    return on_device(floats, torch.float32, device)


#: :func:`host_scalars`, one tensor per distinct set of keyword values: a step's parameters of
#: one group share their scalars, so one small tensor per step instead of one per parameter.
#: The tensor is shared (read it, never write it); pass plain floats and int counters (a tensor
#: would be cached by identity while its value changes).
shared_host_scalars = functools.lru_cache(maxsize=256)(host_scalars)


def device_scalars(
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: torch.Tensor,
    age: torch.Tensor,
    factored: bool,
) -> torch.Tensor:
    """The same scalars from device counters: float64 ``step`` and ``age``, 0-dim (one packet,
    ``[NUM_SCALARS]``) or ``[N]`` (one row per counter pair, ``[N, NUM_SCALARS]``, in a fixed
    number of device ops whatever ``N``: what a captured graph replays).

    ``lr`` may be a tensor (read on device, so a captured graph sees in-place updates).
    """
    device = step.device
    f64 = torch.float64
    one = torch.ones(step.shape, dtype=f64, device=device)
    lr64 = lr.detach().to(device=device, dtype=f64).reshape(()) * one if isinstance(lr, torch.Tensor) else one * lr
    inv_bc1 = one / (one - torch.pow(beta1, step))
    bc2 = one - torch.pow(beta2, age)
    bc2_term = one / bc2 if factored else one / torch.sqrt(bc2)
    values = [
        lr64,
        inv_bc1,
        bc2_term,
        one - lr64 * weight_decay,
        one * beta1,
        one * (1.0 - beta1),
        one * beta2,
        one * (1.0 - beta2),
        one * eps,
    ]
    return torch.stack(values, dim=-1).to(torch.float32)


def muon_scalars(device: torch.device, momentum: float) -> torch.Tensor:
    """The packet of ``gefen::muon_momentum.v3``: ``[momentum, 1 - momentum]`` as fp32 on ``device``."""
    return on_device([momentum, 1.0 - momentum], torch.float32, device)

"""One matrix's GefenMuon update: quantized momentum, Newton-Schulz, levers, and the write.

The same functions serve every path (plain tensors, ``"exact"``, ``"approx"``, the
``"distributed"`` owner and batched Newton-Schulz, whose inputs take one momentum call)::

    X = momentum_inputs([G])[0]      # gefen::muon_momentum.v3: EMA on the codes, Nesterov, bf16 NS input
    O = orthogonalize(X)             # bf16 Newton-Schulz (fp8 where eligible)
    O = finish_update(O, G)          # NorMuon, then cautious, when the group enables them
    apply_update(p, O)               # p <- p * (1 - lr * wd) ; p <- p - lr * rho * O

``G`` is the whole matrix's gradient, or the local rows under ``"approx"``; ``rho`` comes
from the **global** shape (:func:`gefen_core.muon_options.lr_ratio`). Decay uses the
unscaled ``lr``, as ``torch.optim.Muon`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .fp8_newton_schulz import newton_schulz_fp8
from .newton_schulz import Schedule, newton_schulz
from .normuon import cautious_mask, normuon_rescale
from .ops import MUON_MOMENTUM, Kernels
from .param_state import INDICES, MAGNITUDE, STEP
from .step_scalars import muon_scalars

__all__ = ["apply_update", "finish_update", "momentum_inputs", "orthogonalize"]


def momentum_inputs(
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    group: Mapping[str, Any],
    *,
    dispatch: Kernels,
    codebook: torch.Tensor,
    seeds: torch.Tensor | None,
    deterministic: bool,
) -> list[torch.Tensor]:
    """Advance the quantized momentum in each of ``states`` (one group's matrices on one device)
    with one op call, and return their bf16 Newton-Schulz inputs."""
    contiguous = [grad.contiguous() for grad in grads]
    outs = [torch.empty(g.shape, dtype=torch.bfloat16, device=g.device) for g in contiguous]
    scalars = muon_scalars(contiguous[0].device, group["momentum"])
    dispatch.op(MUON_MOMENTUM)(
        contiguous,
        [state[INDICES] for state in states],
        [state[MAGNITUDE] for state in states],
        codebook,
        scalars,
        seeds,
        outs,
        nesterov=bool(group["nesterov"]),
        deterministic=deterministic,
    )
    for state in states:
        state[STEP] = int(state[STEP]) + 1
    return outs


def orthogonalize(
    matrix: torch.Tensor, schedule: Schedule, eps: float, *, fp8: bool, compile_fp8: bool
) -> torch.Tensor:
    """Newton-Schulz in bf16, or the fp8 iteration when the caller found it eligible."""
    if fp8:
        return newton_schulz_fp8(matrix, schedule, eps, compile=compile_fp8)
    return newton_schulz(matrix, schedule, eps)


def finish_update(
    update: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any]
) -> torch.Tensor:
    """NorMuon, then the cautious mask, as the group enables them."""
    if group["normuon"]:
        update = normuon_rescale(update, state, group["normuon_beta2"], group["normuon_eps"])
    if group["cautious"]:
        update = cautious_mask(update, grad)
    return update


def apply_update(
    local: torch.Tensor, update: torch.Tensor | None, *, lr: float, weight_decay: float, ratio: float
) -> None:
    """Decoupled decay with the unscaled ``lr``, then ``local -= lr * ratio * update`` (in place)."""
    if weight_decay > 0:
        local.mul_(1.0 - lr * weight_decay)
    if update is not None and local.numel():
        local.add_(update, alpha=-(lr * ratio))

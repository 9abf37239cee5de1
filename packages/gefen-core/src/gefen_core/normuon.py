"""Post-Newton-Schulz levers: NorMuon row normalisation and the cautious mask.

**NorMuon** (``normuon=True``) equalises the rows of the orthogonalised update ``O``
(``R x C``, rows = dimension 0 as stored, e.g. a Linear weight's output neurons) with an
EMA of their squared norms, then rescales the whole update back to the Frobenius norm it
had, so the learning-rate calibration is unchanged. In fp32 (``fl`` one rounding)::

    q_i = sum_j fl32(O_ij)^2                              (fp32 accumulation)
    v_i = fl( fl(v_i * beta2) + fl( fl(q_i / C) * (1 - beta2) ) )
    t  += 1 ;  bc = fl32(1 - beta2^t)                      (float64, rounded once)
    d_i = fl(sqrt(fl(v_i / bc))) + eps
    s   = sqrt(sum_i q_i) / max( ||(sqrt(q_i) / d_i)_i||_2 , FLT_MIN )
    O_ij = ro( fl32(O_ij) * fl(s / d_i) )                  (ro: back to O's dtype)

State: ``normuon_v`` fp32 ``[R, 1]`` (zero at first use) and ``normuon_step``; both are
created lazily and recreated when the row count changes. An all-zero update stays exactly
zero (``s = 0``), so a zero gradient without weight decay leaves the parameter bit-unchanged.

**Cautious** (``cautious=True``, experimental): keep only the entries whose sign agrees with
the gradient fed to the pipeline and rescale by the kept fraction,
``O <- ro(fl32(O) * [O * G > 0] * (numel / max(kept, 1)))``. No state.
"""

from __future__ import annotations

from typing import Any

import torch

from .muon_state import NORMUON_STEP, NORMUON_V
from .second_moment import FLT_MIN

__all__ = ["cautious_mask", "normuon_rescale"]


def normuon_rescale(update: torch.Tensor, state: dict[str, Any], beta2: float, eps: float) -> torch.Tensor:
    """Advance ``state``'s NorMuon statistics with ``update`` (``R x C``) and return the rescaled update."""
    rows, cols = update.shape
    v = state.get(NORMUON_V)
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != (rows, 1):
        v = torch.zeros(rows, 1, dtype=torch.float32, device=update.device)
        state[NORMUON_V] = v
        state[NORMUON_STEP] = 0
    wide = update.to(torch.float32)
    squares = wide.square().sum(dim=1, keepdim=True)
    v.mul_(beta2).add_((squares / cols) * (1.0 - beta2))
    step = int(state[NORMUON_STEP]) + 1
    state[NORMUON_STEP] = step
    correction = float(torch.tensor(1.0 - beta2**step, dtype=torch.float32))
    denominator = torch.sqrt(v / correction) + eps
    total = torch.sqrt(squares.sum())
    equalised = torch.linalg.vector_norm(torch.sqrt(squares) / denominator).clamp(min=FLT_MIN)
    factor = (total / equalised) / denominator
    rescaled: torch.Tensor = (wide * factor).to(update.dtype)
    return rescaled


def cautious_mask(update: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Zero the entries of ``update`` whose sign disagrees with ``grad``; rescale by the kept fraction."""
    wide = update.to(torch.float32)
    keep = (wide * grad.to(torch.float32)) > 0
    kept = keep.sum().clamp(min=1).to(torch.float32)
    return (wide * keep * (update.numel() / kept)).to(update.dtype)

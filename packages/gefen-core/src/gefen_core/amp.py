"""``torch.amp.GradScaler`` support.

With fp32/bf16 parameters the scaler's ordinary path applies (``unscale_`` then a skipped or
performed ``step``) and nothing here is involved. True fp16 gradients are refused by the
ordinary path ("Attempting to unscale FP16 gradients"), so while any attached gradient is
fp16 the optimizer advertises ``_step_supports_amp_scaling``; the scaler then sets
``optimizer.found_inf`` and ``optimizer.grad_scale`` and calls ``step()``, which skips the
whole step (nothing mutated, the global step not advanced) on overflow and otherwise
multiplies every gradient in place by ``fl32(1 / float64(scale))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from .distributed import local_tensor

__all__ = ["has_fp16_gradients", "unscale_gradients"]


def has_fp16_gradients(param_groups: Iterable[dict[str, Any]]) -> bool:
    return any(p.grad is not None and p.grad.dtype is torch.float16 for group in param_groups for p in group["params"])


def unscale_gradients(optimizer: object, grads: Iterable[torch.Tensor]) -> None:
    """Divide gradients by the scaler's scale in place (no-op without ``grad_scale``)."""
    scale = getattr(optimizer, "grad_scale", None)
    if scale is None:
        return
    value = float(scale.item()) if isinstance(scale, torch.Tensor) else float(scale)
    if not math.isfinite(value) or value <= 0:
        raise RuntimeError(f"GradScaler passed a non-finite or non-positive scale {value}")
    inverse = float(torch.tensor(1.0 / value, dtype=torch.float32))
    for grad in grads:
        local_tensor(grad).mul_(inverse)

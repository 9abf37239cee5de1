"""What an optimizer that takes ``torch.amp.GradScaler``'s optimizer protocol must undo itself.

An optimizer advertising ``_step_supports_amp_scaling`` gets ``grad_scale`` and ``found_inf``
set on it by ``GradScaler.step``, which removes them only after ``step()`` returns. A step
that raises leaves them, and the scaler multiplies a ``grad_scale`` it finds into the next
one: a retried step would unscale its gradients by the square of the scale, silently.
``torch.optim.AdamW(fused=True)`` has the same trap; an optimizer calls
:func:`forget_scaler_state` when its step raises. On an overflow (:func:`scaler_overflowed`)
the step must change nothing.
"""

from __future__ import annotations

__all__ = ["forget_scaler_state", "scaler_overflowed"]

_ATTRIBUTES = ("grad_scale", "found_inf")


def forget_scaler_state(optimizer: object) -> None:
    """Drop what the gradient scaler set on ``optimizer`` for a step that raised."""
    for name in _ATTRIBUTES:
        optimizer.__dict__.pop(name, None)


def scaler_overflowed(optimizer: object) -> bool:
    """Whether the gradient scaler reported an overflow for this step (its ``found_inf``)."""
    found_inf = getattr(optimizer, "found_inf", None)
    return found_inf is not None and float(found_inf.sum().item()) > 0.0

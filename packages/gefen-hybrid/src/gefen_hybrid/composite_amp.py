"""The gradient scaler's optimizer protocol, passed through a composite to its children.

``torch.amp.GradScaler`` unscales an optimizer's gradients itself unless the optimizer
advertises ``_step_supports_amp_scaling``; then it sets ``grad_scale`` (``None`` when the
gradients were already unscaled) and ``found_inf`` on the optimizer, calls ``step()`` and
removes them again: the step must unscale, and skip on overflow, itself. The scaler refuses
to unscale fp16 gradients, so Gefen and GefenMuon advertise the protocol whenever they hold
one. A composite advertises it when any child does (:func:`supports_amp_scaling`) and passes
it on (:func:`step_child`): a child that advertises it gets the two attributes for its own
step; for one that does not, the composite does what the scaler would have done for that
child alone (the scaler's unscale op, and no step on overflow). fp16 gradients of a child
that does not advertise the protocol are refused before any child steps
(:func:`check_scalable`), with the scaler's own error. The scaler removes the two attributes
only after ``step()`` returns, and multiplies a ``grad_scale`` it finds into the next one, so
a refused step drops them (``gefen_contracts.torch_support.forget_scaler_state``): a retry is unscaled once, not twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from gefen_contracts.torch_support import forget_scaler_state, scaler_overflowed

__all__ = ["check_scalable", "step_child", "supports_amp_scaling"]


def _advertises(optimizer: Any) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def supports_amp_scaling(children: Iterable[Any]) -> bool:
    """Whether a composite of ``children`` takes the scaler's protocol (any child does)."""
    return any(_advertises(child) for child in children)


def _grads(child: Any) -> list[torch.Tensor]:
    return [p.grad for group in child.param_groups for p in group["params"] if p.grad is not None]


def check_scalable(composite: Any, children: Sequence[tuple[str, Any]]) -> None:
    """``ValueError`` (the scaler's) when the composite is asked to unscale fp16 gradients of a
    child that does not take the protocol itself; nothing has stepped yet."""
    if getattr(composite, "grad_scale", None) is None:
        return
    for role, child in children:
        if not _advertises(child) and any(grad.dtype == torch.float16 for grad in _grads(child)):
            raise ValueError(
                f"Attempting to unscale FP16 gradients: the {role!r} child ({type(child).__name__}) does not take "
                "the gradient scaler's optimizer protocol, and the scaler refuses to unscale fp16 gradients for it"
            )


def step_child(composite: Any, child: Any) -> None:
    """Step ``child`` under the protocol the scaler started on ``composite`` (or plainly, without one)."""
    if not hasattr(composite, "found_inf"):
        child.step()
        return
    scale, found_inf = composite.grad_scale, composite.found_inf
    if _advertises(child):
        child.grad_scale, child.found_inf = scale, found_inf
        try:
            child.step()
        finally:
            forget_scaler_state(child)  # the child's own step may have dropped them already
        return
    # what GradScaler.step does for an optimizer without the protocol: skip on overflow, else
    # unscale (by the reciprocal it computes in double) and step
    if scaler_overflowed(composite):
        return
    if scale is not None:
        inverse = scale.double().reciprocal().float()
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in _grads(child):
            by_device.setdefault(grad.device, []).append(grad)
        for device, grads in by_device.items():
            unused = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, unused, inverse.to(device))
    child.step()

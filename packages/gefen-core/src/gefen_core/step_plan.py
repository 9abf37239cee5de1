"""The step's preflight: every check ``step()`` makes before it mutates anything.

:func:`plan_step` validates the attached gradients, the live groups, the stored state and
the kernel choice, and returns a :class:`StepPlan` describing the work; it raises the same
specific error ``step()`` would, changes nothing, runs no closure and no collective. The
optimizer's ``preflight_step()`` is this function with the plan discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gefen_contracts.torch_support import check_tensor_lr, finite_bounds

from .distributed import is_dtensor, is_row_sharded, local_tensor
from .errors import CaptureError, GradientError, ParameterError
from .ops import BLOCK_STEP, ELEMENT_STEP, FACTORED_MOMENTS, FACTORED_STATS, FACTORED_STEP, HISTOGRAM, Kernels
from .param_groups import check_group_options, place
from .param_state import (
    ELEMENT,
    FACTORED,
    INDICES,
    MAGNITUDE,
    V_COL,
    V_ROW,
    VMEAN,
    V,
    second_moment_variant,
)
from .periods import RAGGED_PERIOD

__all__ = [
    "BucketKey",
    "PLAIN",
    "ParamWork",
    "StepDecision",
    "StepPlan",
    "capturing",
    "check_gradient",
    "check_state",
    "plan_step",
    "refuse_self_overlap",
    "refuse_unlearnable",
    "update_ops",
]

#: Parameter types that are neither DTensors nor other tensor subclasses.
PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


@dataclass(slots=True)
class ParamWork:
    """One parameter that steps: where it is, what it routes to, what it still needs."""

    group_index: int
    slot: int
    param: torch.Tensor
    local: torch.Tensor
    grad: torch.Tensor
    name: str | None
    variant: str
    row_sharded: bool
    state: dict[str, Any] | None
    local_nonzero: bool | None
    position: int = 0  # in its group's params (for messages)

    def where(self) -> str:
        """Where the parameter sits, for an error message (formatted only then)."""
        return place(self.group_index, self.position, self.name)

    @property
    def global_rows(self) -> int:
        return int(self.param.shape[0])


#: A bucket of a step: one group's parameters of one second-moment variant on one device,
#: which every op updates in one call.
BucketKey = tuple[int, str, torch.device]


@dataclass(slots=True)
class StepPlan:
    works: list[ParamWork] = field(default_factory=list)
    #: ``works`` by bucket, in the order of their first parameter (filled by the plan's one pass)
    buckets: dict[BucketKey, list[ParamWork]] = field(default_factory=dict)
    refresh_due: bool = False
    has_dtensors: bool = False  # whether a stepping parameter is a DTensor
    #: buckets holding a row-sharded parameter (whose statistics take ``factored_stats``)
    row_sharded: set[BucketKey] = field(default_factory=set)
    #: works whose parameter has no state yet (the step starts it)
    starting: list[ParamWork] = field(default_factory=list)
    #: works whose state lives on another device than the parameter (moved before the update)
    moving: list[ParamWork] = field(default_factory=list)
    #: the mesh of the DTensors stepping (set by ``gefen_step.agree_on_mesh``, read by ``decide``)
    mesh: Any = None
    #: where each work's local parameter begins (set by ``gefen_step.plan`` outside tracing)
    memory_layout: tuple[int, ...] | None = None


@dataclass(slots=True)
class StepDecision:
    """What a step learned, staged without touching the optimizer: parameters whose state
    starts now (with their new states), stateless ones that only decay, the codebook the
    step uses, and re-quantised momentum indices ``(state, new indices)`` of a refresh."""

    starting: list[ParamWork] = field(default_factory=list)
    states: dict[int, dict[str, Any]] = field(default_factory=dict)
    idle: list[ParamWork] = field(default_factory=list)
    codebook: torch.Tensor | None = None
    refreshed: list[tuple[dict[str, Any], torch.Tensor]] = field(default_factory=list)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    # a stream captures only once CUDA is initialised; is_available() reads the environment per call
    return bool(torch.cuda.is_initialized()) and torch.cuda.is_current_stream_capturing()  # type: ignore[no-untyped-call]


def refuse_meta(grad: torch.Tensor, where: str) -> None:
    """A first gradient on the meta device holds no values to learn the codebook from."""
    if grad.is_meta:
        raise ParameterError(
            f"{where}: the parameter is on the meta device; its first step learns the codebook from the "
            "gradient's values, so materialise the model first (e.g. module.to_empty(device=...))"
        )


def check_gradient(param: torch.Tensor, grad: torch.Tensor, where: str, *, optimizer: str = "Gefen") -> None:
    """A gradient must be dense, real, and match its parameter's shape, dtype, device and layout
    (``GradientError`` naming ``where``)."""
    if grad.is_sparse or grad.layout is not torch.strided:
        raise GradientError(f"{where}: {optimizer} does not support sparse gradients (layout {grad.layout})")
    if grad.is_complex():
        raise GradientError(f"{where}: {optimizer} does not support complex gradients ({grad.dtype})")
    if grad.shape != param.shape:
        raise GradientError(
            f"{where}: gradient shape {tuple(grad.shape)} differs from parameter shape {tuple(param.shape)}"
        )
    if grad.dtype != param.dtype:
        raise GradientError(f"{where}: gradient dtype {grad.dtype} differs from parameter dtype {param.dtype}")
    if is_dtensor(param) != is_dtensor(grad):
        raise GradientError(f"{where}: a DTensor parameter needs a DTensor gradient and a plain one a plain gradient")
    if is_dtensor(param):
        if tuple(grad.placements) != tuple(param.placements):  # type: ignore[attr-defined]
            raise GradientError(f"{where}: gradient placements differ from the parameter's")
        if local_tensor(grad).shape != local_tensor(param).shape:
            raise GradientError(f"{where}: local gradient shape differs from the local parameter shape")
    elif grad.device != param.device:
        raise GradientError(
            f"{where}: the gradient is on {grad.device} but the parameter on {param.device} (they must be on the same device)"
        )


def refuse_self_overlap(local: torch.Tensor, where: str) -> None:
    """A parameter whose elements share memory (an ``expand()``-ed tensor) cannot be written in
    place: torch refuses the write only after the step's earlier parameters have changed, so it
    is refused here, before anything does (``ParameterError`` naming ``where``)."""
    if not local.is_contiguous() and any(s == 0 and n > 1 for n, s in zip(local.shape, local.stride(), strict=True)):
        raise ParameterError(
            f"{where}: the parameter's elements share memory (stride 0 in a dimension of size > 1, as an expand()ed "
            "tensor has), so it cannot be updated in place; give it memory of its own (.clone())"
        )


def _ragged_cover(state: dict[str, Any], period: int, codes: int, numel: int) -> bool:
    return period == RAGGED_PERIOD and VMEAN in state and codes - period < numel < codes


def check_state(state: dict[str, Any], local: torch.Tensor, where: Callable[[], str]) -> bool:
    """Validate a live state against its parameter; return whether its tensors must be moved to
    the parameter's device or made contiguous (:func:`gefen_core.gefen_step.move_state`, when the
    step mutates): a state tensor left strided between steps, as torch's optimizers take any
    strides, was refused by the kernels mid-step, after other buckets had stepped."""
    indices = state[INDICES]
    numel = local.numel()
    codes = indices.numel()
    # the common case first, one attribute read per fact (this check is on every step's path):
    # the codes cover the elements exactly, in a 2-D [blocks, period] tensor
    if codes != numel or indices.dim() != 2 or not codes:
        shape = indices.shape
        if len(shape) != 2:
            raise ParameterError(
                f"{where()}: the optimizer state's m_codes have shape {tuple(shape)}, not [blocks, period] (a "
                "checkpoint's parameter-shaped layout: was the state put into optimizer.state without "
                "load_state_dict, as torch's ZeroRedundancyOptimizer does?)"
            )
        period = shape[-1]
        # or (block path) ragged blocks with their padding
        if len(shape) != 2 or period < 1 or not (codes == numel or _ragged_cover(state, period, codes, numel)):
            raise ParameterError(
                f"{where()}: the optimizer state was created for {codes} elements in blocks of {period}, "
                f"but the local parameter now has {numel}; the parameter was replaced or resized after its first step"
            )
    if V_ROW in state:
        shape = local.shape
        if len(shape) != 2 or state[V_ROW].numel() != shape[0] or state[V_COL].numel() != shape[1]:
            raise ParameterError(f"{where()}: the factored second moment does not fit the parameter's shape")
        strided = not (state[V_ROW].is_contiguous() and state[V_COL].is_contiguous())
    elif V in state:
        if state[V].shape != local.shape:
            raise ParameterError(f"{where()}: the per-element second moment does not fit the parameter's shape")
        strided = not state[V].is_contiguous()
    elif state[VMEAN].shape != state[MAGNITUDE].shape:
        raise ParameterError(f"{where()}: vmean does not match the block count")
    else:
        strided = not state[VMEAN].is_contiguous()
    strided = strided or not (indices.is_contiguous() and state[MAGNITUDE].is_contiguous())
    return strided or bool(indices.device != local.device)


def refuse_unlearnable(grad: torch.Tensor, where: str, when: str) -> None:
    """A gradient a codebook is learned from must be finite: a NaN would crash the reference's
    bincount and silently skew the kernels' counts (``GradientError`` saying ``when``)."""
    if grad.numel() and finite_bounds(grad) is None:
        raise GradientError(f"{where}: the gradient is not finite {when}; the codebook cannot be learned from it")


def plan_step(
    param_groups: Sequence[dict[str, Any]],
    state: Any,
    *,
    dispatch: Kernels,
    capturable: bool,
    codebook_ready: bool,
    refresh_due: bool,
) -> StepPlan:
    """Validate everything a step needs and describe its work (see the module docstring).
    With ``fused=True`` every op the step runs must have a kernel registered for its device."""
    in_capture = capturing()
    if in_capture and not capturable:
        raise CaptureError("this step is being captured in a CUDA graph; construct Gefen with capturable=True")
    plan = StepPlan(refresh_due=refresh_due)
    works = plan.works
    buckets = plan.buckets
    slot = -1
    for group_index, group in enumerate(param_groups):
        check_group_options(group, group_index)
        check_tensor_lr(group["lr"], group["params"], f"param_groups[{group_index}]")
        names = group.get("param_names")
        variants: dict[torch.Size, str] = {}  # by shape: a group's parameters share a few shapes
        for position, param in enumerate(group["params"]):
            slot += 1
            grad = param.grad
            if grad is None:
                continue
            name = names[position] if names is not None else None
            shape = param.shape
            device = param.device
            if (
                type(param) in PLAIN  # neither a DTensor nor another subclass: the common case, checked inline
                and type(grad) is torch.Tensor
                and grad.layout is torch.strided
                and grad.dtype is param.dtype  # never complex: complex parameters are refused when added
                and grad.shape == shape
                and grad.device == device
            ):
                local, local_grad, row_sharded = param, grad, False
            else:
                check_gradient(param, grad, place(group_index, position, name))
                local, local_grad, row_sharded = local_tensor(param), local_tensor(grad), is_row_sharded(param)
                device = local.device
                plan.has_dtensors = plan.has_dtensors or is_dtensor(param)
            if not local.is_contiguous():
                refuse_self_overlap(local, place(group_index, position, name))
            live = state.get(param)
            variant = variants.get(shape)
            if variant is None:
                variant = variants[shape] = second_moment_variant(shape, group)
            work = ParamWork(
                group_index, slot, param, local, local_grad, name, variant, row_sharded, live, None, position
            )
            if live:
                if check_state(live, local, work.where):
                    if capturable and live[INDICES].device != device:
                        raise CaptureError(
                            f"{work.where()}: state lives on another device; capturable steps cannot move it"
                        )
                    plan.moving.append(work)
                # a refresh, or a codebook still unlearned after all-zero gradients, learns from
                # every gradient's histogram
                if refresh_due or not codebook_ready:
                    when = (
                        "at a codebook refresh (codebook_refresh_every)"
                        if refresh_due
                        else "while the codebook is unlearned"
                    )
                    refuse_unlearnable(local_grad, work.where(), when)
            else:
                plan.starting.append(work)
                if in_capture:
                    raise CaptureError(f"{work.where()}: has no state yet; run one eager step before capturing")
                if local_grad.numel():
                    refuse_meta(local_grad, work.where())
                    bounds = finite_bounds(local_grad)
                    if bounds is None:
                        raise GradientError(
                            f"{work.where()}: the first gradient is not finite; the codebook cannot be learned from it"
                        )
                    work.local_nonzero = bounds != (0.0, 0.0)
            works.append(work)
            key = (group_index, variant, device)
            buckets.setdefault(key, []).append(work)
            if row_sharded:
                plan.row_sharded.add(key)
    if in_capture and (not codebook_ready or refresh_due):
        raise CaptureError("the codebook must be learned (and not refreshed) outside graph capture")
    # (a traced step is a steady one: the eager steps before it checked the kernels, and the
    # dispatcher query would break the graph)
    if dispatch.fused is True and not torch.compiler.is_compiling():
        _check_kernels(plan, dispatch, learns=not codebook_ready or refresh_due)
    return plan


def update_ops(variant: str, *, row_sharded: bool = False) -> tuple[str, ...]:
    """The ops that update a parameter of ``variant`` (the statistics of a row-sharded factored
    matrix come from ``factored_stats`` and an all-reduce, the others' from ``factored_moments``)."""
    if variant == FACTORED:
        return (FACTORED_STATS if row_sharded else FACTORED_MOMENTS, FACTORED_STEP)
    return (ELEMENT_STEP,) if variant == ELEMENT else (BLOCK_STEP,)


def _check_kernels(plan: StepPlan, dispatch: Kernels, *, learns: bool) -> None:
    """``fused=True``: every op this step runs must have a kernel for its parameter's device."""
    needed: dict[tuple[str, torch.device], None] = {}  # (in the buckets' order: a deterministic first error)
    for key in plan.buckets:  # a few buckets, not every parameter
        _, variant, device = key
        ops = ((HISTOGRAM,) if learns else ()) + update_ops(variant)
        if key in plan.row_sharded:  # (the statistics op too; a kernel package registers both)
            ops += update_ops(variant, row_sharded=True)
        needed.update(dict.fromkeys((op, device) for op in ops))
    for op, device in needed:
        dispatch.require(op, device)

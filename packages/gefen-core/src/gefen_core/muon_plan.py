"""GefenMuon's preflight: every check a step makes before it mutates anything.

:func:`check_entry` validates what does not depend on gradients (capture, the live groups,
the parameters); :func:`plan_muon_step` adds the gradients and the stored state and returns
a :class:`MuonPlan` describing the work. Both raise the same specific error ``step()`` would,
change nothing, run no closure and no collective. ``GefenMuon.preflight_step()`` is
:func:`plan_muon_step` with the plan discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from gefen_contracts.torch_support import check_tensor_lr

from .batched_newton_schulz import chunk_capacity, plan_chunks, shape_eligible
from .distributed import check_parameter_layout, local_tensor
from .errors import CaptureError, ParameterError
from .muon_distributed import APPROX, DISTRIBUTED, EXACT, LOCAL, MuonScope, build_scope, execution_mode
from .muon_options import check_muon_group, group_schedule
from .muon_state import check_muon_state
from .ops import HISTOGRAM, MUON_MOMENTUM, Kernels
from .param_groups import SUPPORTED_DTYPES, place
from .param_state import refuse_codes_without_codebook
from .step_plan import capturing, check_gradient, refuse_meta, refuse_self_overlap, refuse_unlearnable

__all__ = ["MuonItem", "MuonPlan", "batched_chunks", "check_entry", "check_matrix", "plan_muon_step"]

_NAME = "GefenMuon"


@dataclass(slots=True)
class MuonItem:
    """One parameter of the optimizer in ``param_groups`` order, with or without a gradient."""

    group_index: int
    position: int
    slot: int
    param: torch.Tensor
    name: str
    mode: str
    grad: torch.Tensor | None
    owner: int | None = None
    state: dict[str, Any] | None = None

    @property
    def where(self) -> str:
        return place(self.group_index, self.position, self.name)

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.param.shape
        return int(rows), int(cols)

    @property
    def local(self) -> torch.Tensor:
        return local_tensor(self.param)

    @property
    def local_grad(self) -> torch.Tensor:
        assert self.grad is not None
        return local_tensor(self.grad)

    @property
    def state_numel(self) -> int:
        """Elements the state describes: local rows under approx, the whole matrix otherwise."""
        return self.local.numel() if self.mode == APPROX else self.param.numel()


@dataclass(slots=True)
class MuonPlan:
    items: list[MuonItem] = field(default_factory=list)
    scope: MuonScope | None = None

    @property
    def active(self) -> list[MuonItem]:
        return [item for item in self.items if item.grad is not None]

    def scope_items(self) -> list[MuonItem]:
        return [item for item in self.items if item.mode in (EXACT, DISTRIBUTED)]


def check_matrix(param: object, where: str) -> None:
    """A GefenMuon parameter: a real, dense, 2-D floating tensor in a supported layout."""
    if not isinstance(param, torch.Tensor):
        return  # torch's add_param_group raises its own TypeError
    if param.dim() != 2:
        raise ParameterError(
            f"{where}: GefenMuon only supports 2D parameters, got shape {tuple(param.shape)} "
            "(route embeddings, heads, norms and biases to Gefen or AdamW; a ZeRO-style wrapper that flattens "
            "parameters cannot be used with GefenMuon)"
        )
    if param.is_complex():
        raise ParameterError(f"{where}: {_NAME} does not support complex parameters ({param.dtype})")
    if param.dtype not in SUPPORTED_DTYPES:
        raise ParameterError(
            f"{where}: dtype {param.dtype} is not supported (use float32, bfloat16, float16 or float64)"
        )
    if param.layout is not torch.strided:
        raise ParameterError(f"{where}: only strided (dense) parameters are supported, got {param.layout}")
    check_parameter_layout(param, where)


def _names(group: dict[str, Any], first_slot: int) -> list[str]:
    names = group.get("param_names")
    if names is not None:
        return [str(n) for n in names]
    return [f"param_{first_slot + i}" for i in range(len(group["params"]))]


def check_entry(param_groups: Sequence[dict[str, Any]]) -> list[MuonItem]:
    """Capture, options and parameters; returns every parameter as an item (no gradients read)."""
    if capturing():
        raise CaptureError("GefenMuon steps cannot be captured in a CUDA graph (capturable=True is not implemented)")
    items: list[MuonItem] = []
    slot = 0
    for group_index, group in enumerate(param_groups):
        check_muon_group(group, group_index)
        check_tensor_lr(group["lr"], group["params"], f"param_groups[{group_index}]")
        names = _names(group, slot)
        for position, param in enumerate(group["params"]):
            name = names[position]
            check_matrix(param, place(group_index, position, name))
            items.append(
                MuonItem(group_index, position, slot, param, name, execution_mode(param, group["sharded_mode"]), None)
            )
            slot += 1
    return items


def _assign_owners(items: list[MuonItem], scope: MuonScope | None) -> None:
    counters = {EXACT: 0, DISTRIBUTED: 0}
    for item in items:
        if item.mode in counters:
            assert scope is not None
            item.owner = counters[item.mode] % scope.world
            counters[item.mode] += 1


def plan_muon_step(
    param_groups: Sequence[dict[str, Any]],
    state: Any,
    *,
    dispatch: Kernels,
    codebook_ready: bool,
    overflowed: bool = False,
) -> MuonPlan:
    """Validate everything a step needs and describe its work (see the module docstring).
    ``overflowed``: the grad scaler found an overflow, so the step is skipped and its
    gradients are not learned from (their finiteness is not an error)."""
    items = check_entry(param_groups)
    scope = build_scope([(item.param, item.mode) for item in items], [item.where for item in items])
    seen: dict[tuple[str, tuple[int, ...], torch.dtype], str] = {}
    for item in items:
        if item.mode in (EXACT, DISTRIBUTED):
            key = (item.name, tuple(item.param.shape), item.param.dtype)
            if key in seen:
                raise ParameterError(
                    f"{item.where}: two sharded parameters share the name, shape and dtype of {seen[key]}; pass "
                    "model.named_parameters() so every rank can check the registration order"
                )
            seen[key] = item.where
        item.state = state.get(item.param) or None
        grad = item.param.grad
        if grad is not None:
            check_gradient(item.param, grad, item.where, optimizer=_NAME)
            refuse_self_overlap(item.local, item.where)
            item.grad = grad
        if item.state is not None:
            check_muon_state(item.state, item.state_numel, item.where)
            if not codebook_ready:
                refuse_codes_without_codebook(item.state, "GefenMuon", f"{item.where}: ")
        if grad is not None and item.state is None and item.local_grad.numel():
            refuse_meta(item.local_grad, item.where)
        # the codebook is learned from every active gradient while it is unlearned (also after
        # all-zero first gradients gave states): a NaN would skew or crash the histogram. Once
        # it is learned nothing is learned from a gradient (a starting matrix's period is its
        # shape's), so a non-finite one is taken as torch's Muon takes it, whether this member
        # holds the matrix's state or not: a "distributed" member keeps only the matrices it
        # owns, and refused a NaN in its rows of a matrix whose owner took one in its own
        if grad is not None and not codebook_ready and not overflowed:
            refuse_unlearnable(item.local_grad, item.where, "while the codebook is still unlearned")
    _assign_owners(items, scope)
    plan = MuonPlan(items, scope)
    if dispatch.fused is True:
        _check_kernels(plan, dispatch, codebook_ready)
    return plan


def _check_kernels(plan: MuonPlan, dispatch: Kernels, codebook_ready: bool) -> None:
    """``fused=True``: the momentum op (and the histogram while the codebook is unlearned) must
    have a kernel for every active parameter's device."""
    ops = (MUON_MOMENTUM,) if codebook_ready else (HISTOGRAM, MUON_MOMENTUM)
    for device in sorted({item.param.device for item in plan.active}, key=str):
        for op in ops:
            dispatch.require(op, device)


def batched_chunks(
    items: list[MuonItem], param_groups: Sequence[dict[str, Any]], log: Callable[..., None]
) -> tuple[list[list[MuonItem]], list[MuonItem]]:
    """Split items into batched-NS chunks and serial ones (:mod:`gefen_core.batched_newton_schulz`).

    Eligible: local (unsharded) matrices of groups with ``batched_ns`` and without ``fp8_ns``
    whose shape passes the gate, outside ``torch.compile``; they are bucketed by device, shape,
    schedule, ``eps`` and workspace (first-seen order) and each bucket is cut by
    :func:`~gefen_core.batched_newton_schulz.plan_chunks`.
    """
    if torch.compiler.is_compiling():
        return [], items
    buckets: dict[tuple[Any, ...], list[MuonItem]] = {}
    serial: list[MuonItem] = []
    for item in items:
        group = param_groups[item.group_index]
        if item.mode != LOCAL or not group["batched_ns"] or group["fp8_ns"] or not shape_eligible(*item.shape):
            serial.append(item)
            continue
        key = (item.local.device, item.shape, group_schedule(group), group["eps"], group["batched_ns_workspace_bytes"])
        buckets.setdefault(key, []).append(item)
    chunks: list[list[MuonItem]] = []
    for key, members in buckets.items():
        sizes, rest = plan_chunks(len(members), chunk_capacity(*key[1], key[4]))
        start = 0
        for size in sizes:
            chunks.append(members[start : start + size])
            start += size
        serial.extend(members[start:])
        log("batched NS %s: chunks %s, %d serial", key[1], sizes, rest)
    return chunks, serial

"""``GefenMuon``'s step execution: what one step does to each active matrix once planned.

:func:`execute`, a function of the optimizer (as torch's ``adam.py`` keeps its arithmetic
outside ``Adam``): given the :class:`~gefen_core.muon_plan.MuonPlan` that ``step()`` (or a
codebook scope) agreed on, it learns what is missing, creates and moves per-matrix state, and runs the local, exact,
approx, batched and distributed paths through :mod:`gefen_core.muon_update`. The
orchestration (entry checks, votes, preflight) stays in :mod:`gefen_core.muon`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from gefen_contracts.torch_support import scaler_overflowed

from .batched_newton_schulz import newton_schulz_batched
from .distributed import local_tensor
from .fp8_newton_schulz import fp8_capable, fp8_eligible
from .gefen_step import RELEARN_WHEN, outgrown, requantize_all
from .identity import verify_layout
from .momentum_codec import stochastic_seed
from .muon_distributed import APPROX, DISTRIBUTED, EXACT, MuonScope, shard_rows, vote
from .muon_learning import LearningResult, learn_codebook
from .muon_options import group_schedule, lr_ratio
from .muon_owners import BucketItem, gather_to_owners, owner_buckets, scatter_from_owners
from .muon_plan import MuonItem, MuonPlan, batched_chunks, plan_muon_step
from .muon_state import new_muon_state
from .muon_update import apply_update, finish_update, momentum_inputs, orthogonalize
from .ops import Kernels
from .optimizer_support import codebook_on
from .param_groups import refuse_edited_groups
from .param_state import INDICES, place_state
from .parameter_update import placeholder_codebook
from .periods import shape_period
from .step_plan import refuse_unlearnable

_LOG = logging.getLogger("gefen_core.muon")

__all__ = ["execute", "log", "move_state", "plan", "warn_fp8", "warn_fp8_at_construction"]


class _Host(Protocol):
    param_groups: Any
    state: Any
    _dispatch: Kernels
    _stochastic_round: bool
    _deterministic: bool
    _codebook: torch.Tensor | None
    _codebook_copies: dict[torch.device, torch.Tensor]
    _global_step: int
    _version: int
    _verbose: bool
    _fp8_warned: bool


def plan(optimizer: Any) -> MuonPlan:
    """Every check ``GefenMuon.step`` runs before mutating (the sealed layout, a group edited to
    set an option of the whole optimizer, then the matrices)."""
    verify_layout(optimizer, "step")
    refuse_edited_groups(optimizer)
    return plan_muon_step(
        optimizer.param_groups,
        optimizer.state,
        dispatch=optimizer._dispatch,
        codebook_ready=optimizer._codebook is not None,
        overflowed=scaler_overflowed(optimizer),  # a skipped step learns nothing from its gradients
    )


def log(optimizer: _Host, message: str, *args: Any) -> None:
    """A step's diagnostic line when the optimizer was built with ``verbose=True``."""
    if optimizer._verbose:
        _LOG.info("GefenMuon step %d: " + message, optimizer._global_step, *args)


def warn_fp8(optimizer: _Host) -> None:
    """Warn once per optimizer that ``fp8_ns`` falls back to bf16 here."""
    if not optimizer._fp8_warned:
        optimizer._fp8_warned = True
        warnings.warn(
            "fp8_ns=True needs a CUDA GPU of compute capability >= 8.9; Newton-Schulz runs in bf16 here",
            RuntimeWarning,
            stacklevel=4,
        )


def warn_fp8_at_construction(optimizer: _Host) -> None:
    """Warn at construction when no device of an ``fp8_ns`` group can run e4m3 GEMMs."""
    if optimizer._fp8_warned or not any(group["fp8_ns"] for group in optimizer.param_groups):
        return
    groups = [group for group in optimizer.param_groups if group["fp8_ns"]]
    devices = {local_tensor(p).device for group in groups for p in group["params"]}
    if not any(fp8_capable(device) for device in devices):
        warn_fp8(optimizer)


def execute(optimizer: _Host, plan: MuonPlan, learned: LearningResult | None = None) -> None:
    """Learn what is missing (unless a scope already did: ``learned``), then update every
    active matrix and advance the step."""
    active = plan.active
    for item in active:
        move_state(item)
    periods: dict[int, int] = {}
    gathered: dict[int, torch.Tensor] | None = None  # distributed gradients already at their owners
    if learned is not None:
        periods = learned.periods
        if learned.codebook is not None:
            optimizer._codebook, optimizer._codebook_copies = learned.codebook, {}
    elif optimizer._codebook is None and (active or plan.scope is not None):
        # with a scope every member learns (its collectives run on every member): a plain or
        # approx matrix can have a gradient on some members only, and a member without one
        # skipping the learning would leave the others in its vote (an empty histogram adds nothing)
        learned = learn_codebook(active, plan.scope, optimizer._dispatch, deterministic=optimizer._deterministic)
        periods = learned.periods
        if any(item.mode == DISTRIBUTED for item in active):
            gathered = learned.gathered
        if learned.codebook is not None:
            optimizer._codebook, optimizer._codebook_copies = learned.codebook, {}
            log(optimizer, "learned the codebook from %d gradients", len(periods))
    elif plan.scope is None and outgrown(optimizer, [item.param for item in active if not item.state]):  # type: ignore[arg-type]
        periods = _relearn(optimizer, active)
    lrs = {index: float(group["lr"]) for index, group in enumerate(optimizer.param_groups)}
    regular = [item for item in active if item.mode != DISTRIBUTED]
    chunks, serial = batched_chunks(
        regular, optimizer.param_groups, lambda message, *args: log(optimizer, message, *args)
    )
    # whether a matrix may have stepped: then the step counts even if a later one fails, or
    # later checkpoints would hold a counter above the global step (refused at load). Every
    # rank decides alike: the local matrices step on every rank, and the distributed ones only
    # after a bucket's gather vote passed on all of them; a failed first gather changes nothing
    started = [bool(serial or chunks)]
    try:
        for item in serial:
            _step_one(optimizer, item, periods, lrs)
        for chunk in chunks:
            _step_batched(optimizer, chunk, periods, lrs)
        distributed = [item for item in active if item.mode == DISTRIBUTED]
        if distributed:
            assert plan.scope is not None
            _step_distributed(optimizer, plan.scope, distributed, periods, gathered, lrs, started)
        started[0] = True
    finally:
        if started[0]:
            optimizer._global_step += 1
            optimizer._version += 1


def _relearn(optimizer: _Host, active: list[MuonItem]) -> dict[int, int]:
    """Relearn the codebook from this step's gradients and re-express every live momentum in
    it, as Gefen does when the matrices starting now outnumber those holding state
    (:func:`gefen_core.gefen_step.relearn_if_outgrown`: a model unfrozen in stages kept the
    three codewords its first, tiny stage gave). Not under a collective scope, whose matrices'
    state lives on their owners only, where no member could count it alike. Returns the
    starting matrices' periods."""
    for item in active:  # (the plan checks gradients only while the codebook is unlearned)
        refuse_unlearnable(item.local_grad, item.where, RELEARN_WHEN)
    learned = learn_codebook(active, None, optimizer._dispatch, deterministic=optimizer._deterministic)
    old, new = optimizer._codebook, learned.codebook
    if old is not None and new is not None:
        for state, codes in requantize_all(optimizer, old, new):  # type: ignore[arg-type]
            state[INDICES] = codes
        optimizer._codebook, optimizer._codebook_copies = new, {}
        log(optimizer, "relearned the codebook from %d gradients", len(learned.periods))
    return learned.periods


def move_state(item: MuonItem) -> None:
    """The matrix's state placed on its device, dense (:func:`~gefen_core.param_state.place_state`)."""
    if item.state:
        place_state(item.state, item.local.device)


# -- one matrix -----------------------------------------------------------------------


def _state_for(
    optimizer: _Host, item: MuonItem, grad: torch.Tensor, periods: Mapping[int, int]
) -> dict[str, Any] | None:
    """The item's state, created at its first gradient (zero or not: the template step of
    torch's DCP state-dict helpers makes the state a checkpoint loads into)."""
    if item.state:
        return item.state
    period = periods.get(item.slot)
    if period is None:
        period = shape_period(item.shape, grad.numel())
    state = new_muon_state(grad.numel(), period, grad.device)
    optimizer.state[item.param] = state
    item.state = state
    return state


def _seeds(optimizer: _Host, items: list[MuonItem]) -> torch.Tensor | None:
    """One stochastic-rounding seed per item (its slot and first element at this step)."""
    if not optimizer._stochastic_round:
        return None
    seeds = []
    for item in items:
        first = 0
        if item.mode == APPROX:
            mesh = item.param.device_mesh  # type: ignore[attr-defined]
            first = shard_rows(item.shape[0], int(mesh.size()), int(mesh.get_local_rank()))[0] * item.shape[1]
        seeds.append(stochastic_seed(optimizer._global_step, item.slot, first))
    return torch.tensor(seeds, dtype=torch.int64, device=items[0].local.device)


def _codebook_for(optimizer: _Host, device: torch.device) -> torch.Tensor:
    if optimizer._codebook is None:
        return placeholder_codebook(device)  # every block scale is still 0
    return codebook_on(optimizer._codebook, optimizer._codebook_copies, device)


def _momenta(
    optimizer: _Host, items: list[MuonItem], grads: list[torch.Tensor], states: list[dict[str, Any]]
) -> list[torch.Tensor]:
    """The Newton-Schulz inputs of one group's matrices on one device: one momentum call."""
    return momentum_inputs(
        grads,
        states,
        optimizer.param_groups[items[0].group_index],
        dispatch=optimizer._dispatch,
        codebook=_codebook_for(optimizer, grads[0].device),
        seeds=_seeds(optimizer, items),
        deterministic=optimizer._deterministic,
    )


def _fp8_for(optimizer: _Host, group: Mapping[str, Any], matrix: torch.Tensor) -> bool:
    if not group["fp8_ns"]:
        return False
    if fp8_eligible((int(matrix.shape[0]), int(matrix.shape[1])), matrix.device):
        return True
    if not fp8_capable(matrix.device):
        warn_fp8(optimizer)
        log(optimizer, "fp8_ns: %s cannot run e4m3 GEMMs; bf16 Newton-Schulz", matrix.device)
    return False


def _update(optimizer: _Host, item: MuonItem, grad: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
    group = optimizer.param_groups[item.group_index]
    (matrix,) = _momenta(optimizer, [item], [grad], [state])
    if optimizer._codebook is None:  # (see _step_batched)
        update = torch.zeros(matrix.shape, dtype=torch.bfloat16, device=matrix.device)
    else:
        update = orthogonalize(
            matrix,
            group_schedule(group),
            group["eps"],
            fp8=_fp8_for(optimizer, group, matrix),
            compile_fp8=bool(group["fp8_ns_compile"]),
        )
    return finish_update(update, grad, state, group)


def _apply(optimizer: _Host, item: MuonItem, update: torch.Tensor | None, lrs: Mapping[int, float]) -> None:
    group = optimizer.param_groups[item.group_index]
    rows, cols = item.shape
    apply_update(
        item.local,
        update,
        lr=lrs[item.group_index],
        weight_decay=group["weight_decay"],
        ratio=lr_ratio(group["adjust_lr_fn"], rows, cols),
    )


def _step_one(optimizer: _Host, item: MuonItem, periods: Mapping[int, int], lrs: Mapping[int, float]) -> None:
    if item.mode == EXACT:
        grad: torch.Tensor = item.grad.full_tensor()  # type: ignore[union-attr]
    else:
        grad = item.local_grad
    state = _state_for(optimizer, item, grad, periods) if grad.numel() else None
    if state is None:
        _apply(optimizer, item, None, lrs)
        return
    update = _update(optimizer, item, grad, state)
    if item.mode == EXACT:
        mesh = item.param.device_mesh  # type: ignore[attr-defined]
        start, length = shard_rows(item.shape[0], int(mesh.size()), int(mesh.get_local_rank()))
        update = update[start : start + length]
    _apply(optimizer, item, update, lrs)


# -- batched Newton-Schulz ----------------------------------------------------------


def _step_batched(
    optimizer: _Host, chunk: list[MuonItem], periods: Mapping[int, int], lrs: Mapping[int, float]
) -> None:
    started: list[tuple[MuonItem, torch.Tensor, dict[str, Any]]] = []
    for item in chunk:
        grad = item.local_grad
        state = _state_for(optimizer, item, grad, periods)
        if state is None:
            _apply(optimizer, item, None, lrs)
        else:
            started.append((item, grad, state))
    by_group: dict[int, list[tuple[MuonItem, torch.Tensor, dict[str, Any]]]] = {}
    for entry in started:
        by_group.setdefault(entry[0].group_index, []).append(entry)
    matrices: dict[int, torch.Tensor] = {}  # by slot
    for members in by_group.values():  # one momentum call per group (momentum, Nesterov)
        items, grads, states = (list(column) for column in zip(*members, strict=True))
        matrices.update(zip((i.slot for i in items), _momenta(optimizer, items, grads, states), strict=True))
    if not started:
        return
    inputs = torch.stack([matrices[item.slot] for item, _, _ in started])
    matrices.clear()  # the stack holds them now: W(B) models one copy of the inputs, not two
    group = optimizer.param_groups[started[0][0].group_index]
    if optimizer._codebook is None:
        # no codebook after this step's learning: no gradient anywhere was non-zero (as in the
        # zero-gradient template step of torch's get_optimizer_state_dict), so every scale is 0,
        # every Newton-Schulz input is 0 and so is its orthogonalisation (seconds of matmuls saved)
        stack = torch.zeros(inputs.shape, dtype=torch.bfloat16, device=inputs.device)
    else:
        stack = newton_schulz_batched(inputs, group_schedule(group), group["eps"])
    for (item, grad, state), update in zip(started, stack):
        _apply(optimizer, item, finish_update(update, grad, state, optimizer.param_groups[item.group_index]), lrs)


# -- distributed mode -----------------------------------------------------------------


def _step_distributed(
    optimizer: _Host,
    scope: MuonScope,
    items: list[MuonItem],
    periods: Mapping[int, int],
    gathered: Mapping[int, torch.Tensor] | None,
    lrs: Mapping[int, float],
    started: list[bool],
) -> None:
    """Owners compute, every rank applies its rows; ``gathered`` (the learning step's full
    gradients, the same decision on every rank) spares the bucket gather. ``started[0]`` is
    set once a bucket passed its gather (owners then change state)."""
    for bucket in owner_buckets([item.owner or 0 for item in items], scope.world):
        members = [items[index] for index in bucket]
        metadata = [BucketItem(item.owner or 0, item.shape, item.local_grad.dtype) for item in members]
        error: BaseException | None = None
        if gathered is not None:
            full: list[torch.Tensor | None] = [gathered.get(item.slot) for item in members]
        else:
            pieces: list[torch.Tensor] = []
            try:
                pieces = _local_pieces(members)
            except Exception as exc:
                error = exc
            vote(scope, "bucket gather", error)
            full = gather_to_owners(scope, metadata, pieces)
        started[0] = True
        updates: list[torch.Tensor | None] = [None] * len(members)
        try:
            for index, (item, grad) in enumerate(zip(members, full)):
                if grad is None:
                    continue
                state = _state_for(optimizer, item, grad, periods)
                updates[index] = (
                    _update(optimizer, item, grad, state)
                    if state is not None
                    else torch.zeros(item.shape, dtype=torch.bfloat16, device=grad.device)
                )
        except Exception as exc:
            error = exc
        vote(scope, "update broadcast", error)
        for item, rows in zip(members, scatter_from_owners(scope, metadata, updates)):
            _apply(optimizer, item, rows, lrs)


def _local_pieces(members: list[MuonItem]) -> list[torch.Tensor]:
    """This rank's rows of each bucket member's gradient, as the gather sends them."""
    return [item.local_grad.contiguous() for item in members]

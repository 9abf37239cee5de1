"""``Gefen``'s step between its checks and its arithmetic, as functions of the optimizer.

``Gefen.step`` runs :func:`plan` (every check, nothing mutated), under FSDP2 then
:func:`agree_on_mesh` (every member planned, and steps the same DTensor parameters), then :func:`decide` (what
the step starts: periods of parameters stepping for the first time, the codebook when none
exists or a refresh is due; staged, nothing published), then :func:`publish` (new states,
the codebook, one :func:`~gefen_core.parameter_update.update_parameters` call per bucket of
one group, variant and device, and the counters). The codebook scope's host side
(:mod:`gefen_core.gefen_binding`) runs the same pieces between its collectives. The
arithmetic itself lives in :mod:`gefen_core.parameter_update` and the ops it calls.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from gefen_contracts.torch_support import on_device, storage_overlap

from .codebook import codebook_from_counts, gradient_histogram, requantize
from .distributed import (
    agree_step,
    all_reduce_sums,
    counted_once_per_mesh,
    is_dtensor,
    learning_mesh,
    local_tensor,
    shard_rows,
    sum_over_mesh,
)
from .errors import ParameterError
from .identity import verify_layout
from .momentum_codec import nearest_codeword, stochastic_seed
from .ops import CODEBOOK_SOLVE, DISPATCHED_OPS, FACTORED_STATS, HISTOGRAM
from .optimizer_support import codebook_on
from .param_groups import refuse_edited_groups
from .param_state import (
    AGE_KEYS,
    FACTORED,
    INDICES,
    STEP,
    element_codes,
    new_state,
    period_of,
    place_state,
    refuse_codes_without_codebook,
    zero_padding,
)
from .parameter_update import decay_only, placeholder_codebook, update_parameters
from .periods import period_policy
from .step_plan import PLAIN, ParamWork, StepDecision, StepPlan, plan_step, refuse_unlearnable

if TYPE_CHECKING:
    from .gefen import Gefen

__all__ = [
    "Stats",
    "agree_on_mesh",
    "decide",
    "factored_stats",
    "locally_nonzero",
    "move_state",
    "plan",
    "publish",
    "refresh_due",
    "outgrown",
    "relearn_if_outgrown",
    "requantize_all",
    "require_kernels",
    "stage_decision",
]

#: Row and column sums of ``g^2`` of row-sharded factored parameters, by slot.
Stats = dict[int, tuple[torch.Tensor, torch.Tensor]]


def require_kernels(optimizer: Gefen) -> None:
    """``fused=True``: kernels for every op, on every device the parameters live on."""
    devices = {p.device for group in optimizer.param_groups for p in group["params"]}
    for device in sorted(devices, key=str):
        for op in DISPATCHED_OPS:
            optimizer._dispatch.require(op, device)


def refresh_due(optimizer: Gefen) -> bool:
    """Whether this step relearns the codebook (every ``codebook_refresh_every`` steps)."""
    step = optimizer._global_step
    return bool(
        optimizer._refresh_every
        and optimizer._codebook is not None
        and step > 0
        and step % optimizer._refresh_every == 0
    )


def plan(optimizer: Gefen) -> StepPlan:
    """Every check the step runs before mutating (the sealed layout, a group edited to set an
    option of the whole optimizer, :func:`plan_step`, then distinct parameters sharing memory
    whenever the stepping parameters' memory moved since a step last checked it)."""
    verify_layout(optimizer, "step")
    refuse_edited_groups(optimizer)
    plan = plan_step(
        optimizer.param_groups,
        optimizer.state,
        dispatch=optimizer._dispatch,
        capturable=optimizer._capturable,
        codebook_ready=optimizer._codebook is not None,
        refresh_due=refresh_due(optimizer),
    )
    if not torch.compiler.is_compiling():  # (a traced step is a steady one, checked eagerly before)
        # one address per stepping parameter (0 for a fake one): `b.data = a.data.t()` after a
        # step moves b's, so that sharing is caught like one present when the groups changed
        # (publish records the layout; add_param_group forgets it)
        plan.memory_layout = tuple(w.local.data_ptr() if type(w.local) in PLAIN else 0 for w in plan.works)
        if plan.memory_layout != optimizer._memory_layout:
            refuse_shared_memory(optimizer.param_groups)
    return plan


#: When a relearn for parameters starting now refuses a gradient (:func:`refuse_unlearnable`).
RELEARN_WHEN = (
    "at a step that relearns the codebook for the parameters starting now (they outnumber those that learned it)"
)


def outgrown(optimizer: torch.optim.Optimizer, starting: list[torch.Tensor]) -> bool:
    """Whether the parameters starting now hold more elements (whole parameters: a DTensor's
    global size) than those already holding state."""
    if not starting:
        return False
    return sum(p.numel() for p in starting) > sum(p.numel() for p, state in optimizer.state.items() if state)


def relearn_if_outgrown(optimizer: Gefen, plan: StepPlan) -> None:
    """Make this step relearn the codebook (a refresh: ``plan.refresh_due``) when the parameters
    starting now hold more elements than those already holding state. The codebook was then
    learned without most of the gradients it is to quantise: a model unfrozen in stages whose
    first stage was one scalar kept three codewords, and a 40 % worse loss, for the rest of its
    training. Each such step at least doubles the elements holding state, so it comes a few
    times at most. Counted in whole parameters (a DTensor's global size), so every member of a
    mesh decides alike; a refresh's gradients must be finite, as :func:`plan_step` checks them
    for one."""
    if plan.refresh_due or optimizer._codebook is None or not outgrown(optimizer, [w.param for w in plan.starting]):
        return
    for work in plan.works:  # (the starting ones' were checked by the plan)
        if work.state:
            refuse_unlearnable(work.grad, work.where(), RELEARN_WHEN)
    plan.refresh_due = True


def agree_on_mesh(optimizer: Gefen, plan: StepPlan | None, error: BaseException | None) -> None:
    """Under FSDP2 (DTensor parameters on a mesh of two or more), the agreement every member
    runs before the step's first collective (:func:`gefen_core.distributed.agree_step`):
    ``plan`` is ``None`` where planning raised ``error``. Plain tensors: nothing, at no cost.
    (A member whose gradients are all plain tensors while another's are DTensors is not
    caught: no model gives one rank only its replicated parameters' gradients.)"""
    if plan is not None and plan.works and not plan.has_dtensors:
        return
    if plan is not None and plan.has_dtensors:
        mesh = plan.mesh = learning_mesh(w.param for w in plan.works)  # (decide's collectives take it)
    else:  # failed, or nothing to step here: the optimizer's parameters tell the mesh
        mesh = learning_mesh(p for group in optimizer.param_groups for p in group["params"])
    if mesh is None:
        return
    stepping = [] if plan is None else [w.slot for w in plan.works if is_dtensor(w.param)]
    agree_step(mesh, error, stepping, lambda: _slot_names(optimizer))


def _slot_names(optimizer: Gefen) -> list[str]:
    names = []
    for index, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for position in range(len(group["params"])):
            names.append(repr(given[position]) if given else f"param_groups[{index}]['params'][{position}]")
    return names


def decide(optimizer: Gefen, plan: StepPlan) -> StepDecision:
    """Learn what this step needs from local gradients (periods of starting parameters, the
    codebook, a due refresh) and stage it; nothing of the optimizer is touched."""
    works = plan.works
    starting = plan.starting
    periods = {
        w.slot: period_policy(optimizer.param_groups[w.group_index]).resolve(
            w.name, tuple(w.param.shape), w.grad.numel(), row_sharded=w.row_sharded
        )
        for w in starting
    }

    def work_period(work: ParamWork) -> int:
        return periods[work.slot] if work.slot in periods else period_of(work.state)  # type: ignore[arg-type]

    # (raises for DTensors on meshes over different ranks, on every step)
    mesh = plan.mesh  # found by agree_on_mesh (None without DTensors stepping)
    old_codebook = optimizer._codebook
    new_codebook = old_codebook
    refreshed: list[tuple[dict[str, Any], torch.Tensor]] = []
    if old_codebook is not None and not plan.refresh_due:  # a steady step learns nothing
        return stage_decision(optimizer, starting, [], periods, new_codebook, refreshed)
    learners = [w for w in works if w.state or w.slot in periods]
    if old_codebook is None:
        for w in works:  # (only until the codebook is learned)
            if w.state:
                refuse_codes_without_codebook(w.state, "Gefen", f"{w.where()}: ")
        contributing = [(w, work_period(w)) for w in learners if locally_nonzero(w)]
        if contributing or mesh is not None:
            new_codebook = _learn(optimizer, contributing, mesh)
    else:
        relearned = _learn(optimizer, [(w, work_period(w)) for w in learners], mesh)
        if relearned is not None:
            refreshed = requantize_all(optimizer, old_codebook, relearned)
            new_codebook = relearned
    return stage_decision(optimizer, starting, [], periods, new_codebook, refreshed)


def stage_decision(
    optimizer: Gefen,
    starting: list[ParamWork],
    idle: list[ParamWork],
    periods: Mapping[int, int],
    codebook: torch.Tensor | None,
    refreshed: list[tuple[dict[str, Any], torch.Tensor]],
) -> StepDecision:
    """New zero states for ``starting`` (not inserted)."""
    states = {w.slot: new_state(w.local, periods[w.slot], w.variant, optimizer._capturable) for w in starting}
    return StepDecision(starting, states, idle, codebook, refreshed)


def publish(optimizer: Gefen, plan: StepPlan, decision: StepDecision, stats: Stats) -> None:
    """Publish a staged decision, then update every parameter (no failure path but the kernels')."""
    for work in decision.starting:
        state = decision.states[work.slot]
        optimizer.state[work.param] = state
        work.state = state
    if decision.codebook is not optimizer._codebook:
        optimizer._codebook = decision.codebook
        optimizer._codebook_copies = {}
    for state, indices in decision.refreshed:
        state[INDICES].copy_(indices)
    for work in decision.idle:
        decay_only(work.local, optimizer.param_groups[work.group_index])
    # No codebook after this step's learning: no rank had a non-zero gradient (as in the
    # zero-gradient step torch's get_optimizer_state_dict takes to build a template). A new
    # state's update is then arithmetic on zeros, done here instead of by a pass of the kernels
    # (not under stochastic rounding, whose draws pick either code next to 0)
    zeros_only = decision.codebook is None and not optimizer._stochastic_round
    resting = decision.starting if zeros_only else []
    rested = {work.slot for work in resting}
    for work in resting:
        _step_on_zeros(work, optimizer.param_groups[work.group_index])
    try:
        for (group_index, _, device), works in plan.buckets.items():
            if decision.idle or rested:  # stateless parameters only decayed, resting ones stepped (above)
                works = [work for work in works if work.state and work.slot not in rested]
                if not works:
                    continue
            update_parameters(
                works,
                optimizer.param_groups[group_index],
                stats,
                dispatch=optimizer._dispatch,
                codebook=_codebook_on(optimizer, device),
                seeds=_seeds(optimizer, works, device),
                deterministic=optimizer._deterministic,
                capturable=optimizer._capturable,
            )
    finally:
        # a bucket that failed (a kernel out of memory) leaves the earlier buckets' counters
        # advanced: the step still counts, or every later checkpoint would hold a parameter's
        # step above the global step and be refused at load
        _advance_global_step(optimizer, plan.works)
    if plan.memory_layout is not None:
        optimizer._memory_layout = plan.memory_layout  # a stepped layout needs no second look until it moves


@functools.cache
def _rest() -> tuple[int, float]:
    """The nearest code of 0 under the placeholder codebook, and the update it decodes to at scale 0."""
    codebook = placeholder_codebook(torch.device("cpu"))
    code = int(nearest_codeword(codebook, torch.zeros(1)))
    return code, float(codebook[code]) * 0.0


def _step_on_zeros(work: ParamWork, group: Mapping[str, Any]) -> None:
    """What the kernels make of a new (zero) state and an all-zero gradient under nearest
    rounding: the second moment and the scales stay zero, every code becomes the nearest code
    of 0 under the placeholder codebook (the one in use while none is learned), the counters
    advance, and the parameter decays, then takes the update ``C[q'] * 0``, a zero with the
    codeword's sign (it turns a -0.0 element into +0.0, as the kernels' ``p - d`` does)."""
    state = work.state
    assert state is not None
    code, update = _rest()
    element_codes(state[INDICES], work.local.numel()).fill_(code)
    for key in (STEP, AGE_KEYS[work.variant]):
        counter = state[key]
        if isinstance(counter, torch.Tensor):
            counter.add_(1)
        else:
            state[key] = counter + 1
    decay_only(work.local, group)
    work.local.sub_(update)


def locally_nonzero(work: ParamWork) -> bool:
    """Whether this member's gradient of ``work`` has a non-zero element (computed once)."""
    if work.local_nonzero is None:
        if work.grad.numel():
            low, high = torch.aminmax(work.grad.reshape(-1))  # one pass, no mask
            work.local_nonzero = bool(low != 0) or bool(high != 0)
        else:
            work.local_nonzero = False
    return work.local_nonzero


def refuse_shared_memory(param_groups: list[dict[str, Any]]) -> None:
    """Distinct parameters that share memory (``Parameter(w.data.t())`` beside ``w``, or
    ``b.data = a.data.t()`` after a step) are refused: a bucket's op updates them together, and
    a strided one steps through a copy written back after, over the other's update (torch steps
    them one after another). Checked once over every parameter when the stepping parameters'
    memory moved (a check per added group made building 2,000 one-parameter groups 4x slower).
    Tie weights by sharing one ``Parameter``."""
    overlap = storage_overlap(
        [
            (f"param_groups[{g}]['params'][{i}]", local_tensor(p))
            for g, group in enumerate(param_groups)
            for i, p in enumerate(group["params"])
        ]
    )
    if overlap is not None:
        raise ParameterError(
            f"{overlap}: distinct parameters must not share memory (Gefen updates a bucket of parameters in one "
            "call, so one's update would overwrite the other's); tie weights by sharing one Parameter"
        )


def move_state(work: ParamWork) -> None:
    """The parameter's state placed on its device, dense (:func:`~gefen_core.param_state.place_state`)."""
    assert work.state is not None
    place_state(work.state, work.local.device)


def factored_stats(optimizer: Gefen, plan: StepPlan) -> Stats:
    """Row/column sums of ``g^2`` of the row-sharded factored parameters, their column sums
    all-reduced (every rank's update needs them first). The other
    factored parameters' sums are taken just before their own update, while the gradient is
    still in cache, by ``gefen::factored_moments.v3`` (the statistics and the ``v_row``/``v_col``
    update in one call for the bucket)."""
    stats: Stats = {}
    if not plan.row_sharded:  # (no DTensor row shards: the common case walks nothing)
        return stats
    works = plan.works
    by_device: dict[torch.device, list[ParamWork]] = {}
    for work in works:
        if work.variant == FACTORED and work.row_sharded:
            by_device.setdefault(work.grad.device, []).append(work)
    for members in by_device.values():  # one call of the op per device
        grads = [work.grad.contiguous() for work in members]
        rows, cols = optimizer._dispatch.op(FACTORED_STATS)(grads, deterministic=optimizer._deterministic)
        row_parts = rows.split([grad.shape[0] for grad in grads])
        col_parts = cols.split([grad.shape[1] for grad in grads])
        for work, row_sums, col_sums in zip(members, row_parts, col_parts, strict=True):
            stats[work.slot] = (row_sums, col_sums)
    if stats:  # in the step's parameter order, the same on every rank
        all_reduce_sums([(work.param, stats[work.slot][1]) for work in works if work.slot in stats])
    return stats


def _codebook_on(optimizer: Gefen, device: torch.device) -> torch.Tensor:
    if optimizer._codebook is None:
        return placeholder_codebook(device)
    return codebook_on(optimizer._codebook, optimizer._codebook_copies, device)


def _learn(optimizer: Gefen, items: list[tuple[ParamWork, int]], mesh: Any) -> torch.Tensor | None:
    """The codebook of the items' gradients; with a ``mesh`` (DTensor parameters) the
    histogram is summed over it, so every rank learns the same codebook (a replicated
    parameter counted once, by coordinate 0)."""
    if mesh is not None:
        items = [(w, p) for w, p in items if counted_once_per_mesh(w.param)]
    counts = gradient_histogram(
        (
            (w.grad.neg() if optimizer.param_groups[w.group_index]["maximize"] else w.grad, period)
            for w, period in items
        ),
        optimizer._dispatch.op(HISTOGRAM),
        deterministic=optimizer._deterministic,
    )
    if mesh is not None:
        counts = sum_over_mesh(counts, mesh)
    return codebook_from_counts(counts, optimizer._dispatch.op(CODEBOOK_SOLVE))


def requantize_all(
    optimizer: torch.optim.Optimizer, old: torch.Tensor, new: torch.Tensor
) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Every live state's codes re-expressed in the ``new`` codebook (staged, not written; Gefen's
    and GefenMuon's states alike)."""
    staged = []
    for param, state in optimizer.state.items():
        if state and state[INDICES].numel():
            device = state[INDICES].device
            old_on, new_on = old.to(device), new.to(device)
            codes = requantize(state[INDICES], old_on, new_on)
            zero_padding(codes, local_tensor(param).numel())  # a ragged block's padding stays 0
            staged.append((state, codes))
    return staged


def _seeds(optimizer: Gefen, works: list[ParamWork], device: torch.device) -> torch.Tensor | None:
    """One stochastic-rounding seed per work (its slot at this global step, and a row shard's
    first element: every element draws what it draws in one process), or ``None``."""
    if not optimizer._stochastic_round:
        return None
    firsts = [_first_element(work) for work in works]
    if optimizer._capturable:  # device arithmetic only: no host-to-device copy in a captured graph
        counter = _device_step(optimizer, device) * (1 << 32)
        return torch.stack([counter + stochastic_seed(0, work.slot, first) for work, first in zip(works, firsts)])
    seeds = [stochastic_seed(optimizer._global_step, work.slot, first) for work, first in zip(works, firsts)]
    return on_device(seeds, torch.int64, device)


def _first_element(work: ParamWork) -> int:
    """The flat index, in the whole parameter, of the local shard's first element (a row-sharded
    DTensor's rows before this member's; 0 for a tensor held whole)."""
    if not work.row_sharded:
        return 0
    param: Any = work.param
    mesh = param.device_mesh
    start = shard_rows(param.shape[0], int(mesh.size()), int(mesh.get_local_rank()))[0]
    return start * int(param.numel() // max(1, param.shape[0]))


def _device_step(optimizer: Gefen, device: torch.device) -> torch.Tensor:
    counters = optimizer._device_global_steps
    counter = counters.get(device)
    if counter is None:
        if counters:  # the device count is the truth: a traced step advances only it
            counter = next(iter(counters.values())).to(device, copy=True)
        else:
            counter = torch.tensor(optimizer._global_step, dtype=torch.int64, device=device)
        counters[device] = counter
    return counter


def _advance_global_step(optimizer: Gefen, works: list[ParamWork]) -> None:
    if optimizer._capturable:
        for device in {w.local.device for w in works}:
            _device_step(optimizer, device)  # created from the host count before it advances
        for counter in optimizer._device_global_steps.values():
            counter.add_(1)
    # (under TorchDynamo these two writes are not kept: a traced step's count is the device
    # counters', read by global_step, and the staged-load token reads global_step too)
    optimizer._global_step += 1
    optimizer._version += 1

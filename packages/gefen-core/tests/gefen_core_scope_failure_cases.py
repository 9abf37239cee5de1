"""Injected-failure and disagreement rank functions for the codebook-scope tests (gloo ranks).

A failure injected at one phase on one member, an AMP ``found_inf`` or a gradient presence or
manifest seen on one member only: every member raises the same error with nothing changed.
The shared plans, models and ``_outcome`` live in ``gefen_core_scope_cases``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from gefen_core import scoped_learning, scoped_step
from gefen_core.codebook_scope import CLOSURE_PHASE, PHASES
from gefen_core_scope_cases import (
    Spec,
    _outcome,
    backward,
    bind,
    binding,
    even_cuts,
    gefen_factory,
    layouts_for,
    make_net,
    save,
)


class Injected(RuntimeError):
    """The failure a test hook raises."""


#: Phase -> what runs in it (patched to raise): a module function, or a method of the
#: optimizer's binding (patched on its class, GefenBinding or MuonBinding).
_PATCHED: dict[str, Callable[[Any], tuple[object, str]]] = {
    "entry checks": lambda opt: (scoped_step, "_entry_checks"),
    "refresh preamble": lambda opt: (scoped_step, "_entry_checks"),
    "initialize preamble": lambda opt: (scoped_step, "_entry_checks"),
    "gradient preflight": lambda opt: (type(opt._binding), "plan"),
    "AMP agreement": lambda opt: (scoped_step, "read_amp"),
    "period selection": lambda opt: (type(opt._binding), "items"),
    "histogram and solve": lambda opt: (scoped_learning, "gradient_histogram"),
    "re-quantisation": lambda opt: (type(opt._binding), "requantize"),
    "commit": lambda opt: (type(opt._binding), "stage"),
}
assert set(_PATCHED) | {CLOSURE_PHASE} == set(PHASES)
_closure_fails = [False]


def closure() -> torch.Tensor:
    """A closure that leaves the attached gradients alone, or raises inside :func:`failing_at`'s
    ``closure`` phase."""
    if _closure_fails[0]:
        raise Injected("injected failure")
    return torch.zeros(())


@contextmanager
def failing_at(active: bool, phase: str, optimizer: Any) -> Iterator[None]:
    """While active, ``optimizer``'s scoped operations fail locally at ``phase``: the call that
    phase makes raises :class:`Injected` (the closure phase: :func:`closure` raises)."""
    if not active:
        yield
    elif phase == CLOSURE_PHASE:
        _closure_fails[0] = True
        try:
            yield
        finally:
            _closure_fails[0] = False
    else:
        target, name = _PATCHED[phase](optimizer)
        with mock.patch.object(target, name, side_effect=Injected("injected failure")):
            yield


#: Phase -> the operation a failure at that phase is injected into.
OPERATION_OF = {
    "entry checks": "step_closure",
    "closure": "step_closure",
    "gradient preflight": "first_step",
    "AMP agreement": "first_step",
    "period selection": "first_step",
    "histogram and solve": "first_step",
    "re-quantisation": "refresh",
    "refresh preamble": "refresh",
    "initialize preamble": "initialize",
    "commit": "first_step",
}
assert set(OPERATION_OF) == set(PHASES)


def one_rank_failures(rank: int, world: int, failing: int, phases: Sequence[str]) -> dict[str, Any]:
    """For each phase: a failure on ``failing`` only makes every rank raise, nothing changed; then
    the same operation succeeds and every rank agrees."""
    results: dict[str, Any] = {}
    for phase in phases:
        driver = make_net()
        bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
        operation = OPERATION_OF[phase]
        if operation in ("refresh", "step_closure"):
            backward(driver, 0)
            bound.feed(driver)
            bound.optimizer.step()
        backward(driver, 1)
        bound.feed(driver)
        opt = bound.optimizer

        def act(op: str = operation, opt: Any = opt) -> object:
            if op == "step_closure":
                return opt.step(closure)
            if op == "refresh":
                return opt.refresh_collective_state()
            if op == "initialize":
                return opt.initialize_collective_state()
            return opt.step()

        roots = (opt, *[p for p in bound.pieces.values() if p is not None])
        with failing_at(rank == failing, phase, opt):
            outcome = _outcome(act, roots)
        retried = _outcome(act, roots)
        codebooks: list[Any] = [None] * world
        dist.all_gather_object(codebooks, save(opt.codebook))
        outcome["retry_raised"] = retried["raised"]
        outcome["codebooks_agree"] = all(c == codebooks[0] for c in codebooks)
        results[phase] = outcome
    return results


def _after_one_step(rank: int, world: int) -> Any:
    """A scoped Gefen bound to this member's shards, one step taken, the next gradients fed."""
    driver = make_net()
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    backward(driver, 0)
    bound.feed(driver)
    bound.optimizer.step()
    backward(driver, 1)
    bound.feed(driver)
    return bound


def amp_disagreement(rank: int, world: int) -> dict[str, Any]:
    """A found_inf seen on one member only raises everywhere (no mutation); an agreed overflow skips."""
    bound = _after_one_step(rank, world)
    opt = bound.optimizer
    roots = (opt, *[p for p in bound.pieces.values() if p is not None])
    opt.grad_scale = torch.tensor(2.0**10)
    opt.found_inf = torch.tensor(1.0 if rank == 0 else 0.0)
    divergent = _outcome(opt.step, roots)
    opt.found_inf = torch.tensor(1.0)
    overflow = _outcome(opt.step, roots)
    skipped = opt.global_step == 1
    opt.found_inf = torch.tensor(0.0)
    stepped = _outcome(opt.step, roots)
    return {
        "supports_amp": opt._step_supports_amp_scaling,
        "divergent": divergent,
        "overflow": overflow,
        "skipped": skipped,
        "stepped": stepped["raised"] is None and opt.global_step == 2,
    }


def disagreements(rank: int, world: int) -> dict[str, Any]:
    """Gradient presence or a manifest differing on one member raises the same error everywhere."""
    results: dict[str, Any] = {}
    driver = make_net()
    bound = bind(driver, layouts_for(world), rank, world, gefen_factory(), scope=binding(rank, world))
    opt = bound.optimizer
    backward(driver, 0)
    bound.feed(driver)
    if rank == 0:
        bound.pieces["up"].grad = None  # type: ignore[union-attr]
    roots = (opt, *[p for p in bound.pieces.values() if p is not None])
    results["presence"] = _outcome(opt.step, roots)
    other = layouts_for(world)
    if rank == 0:
        other["bias"] = Spec("flat", even_cuts(32, world))
    mismatched = bind(driver, other, rank, world, gefen_factory(), scope=binding(rank, world))
    backward(driver, 0)
    mismatched.feed(driver)
    roots = (mismatched.optimizer, *[p for p in mismatched.pieces.values() if p is not None])
    results["manifest"] = _outcome(mismatched.optimizer.step, roots)
    return results


def nonfinite_gradient(rank: int, world: int) -> dict[str, Any]:
    """A NaN in one member's gradient after the first step: every member raises, nothing
    changes; the same NaN under an agreed GradScaler overflow is skipped by every member; with
    the NaN gone every member steps."""
    bound = _after_one_step(rank, world)
    opt = bound.optimizer
    pieces = [p for p in bound.pieces.values() if p is not None and p.grad is not None and p.grad.numel()]
    clean = pieces[0].grad.clone()  # type: ignore[union-attr]
    if rank == 0:
        pieces[0].grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
    roots = (opt, *[p for p in bound.pieces.values() if p is not None])
    raised = _outcome(opt.step, roots)
    opt.grad_scale = torch.tensor(1.0)
    opt.found_inf = torch.tensor(1.0)  # what torch.amp.GradScaler reports to every member on overflow
    skipped = _outcome(opt.step, roots)
    skipped["global_step"] = opt.global_step
    del opt.grad_scale, opt.found_inf
    pieces[0].grad.copy_(clean)  # type: ignore[union-attr]
    stepped = _outcome(opt.step, roots)
    stepped["global_step"] = opt.global_step
    return {"raised": raised, "skipped": skipped, "stepped": stepped}


def tampered_layout(rank: int, world: int) -> dict[str, Any]:
    """Member 0 edits its sealed layout (no hook: the real check) before each collective
    operation; every member raises ``CollectiveFailureError``, none waits for member 0."""
    bound = _after_one_step(rank, world)
    opt = bound.optimizer
    params = opt.param_groups[0]["params"]
    stray = torch.nn.Parameter(torch.zeros(3))
    results = {}
    for operation in ("step", "initialize_collective_state", "refresh_collective_state"):
        if rank == 0:
            params.append(stray)
        roots = (opt, *[p for p in bound.pieces.values() if p is not None])
        results[operation] = _outcome(getattr(opt, operation), roots)
        if rank == 0:
            params.pop()
    return results


def scoped_copies(rank: int, world: int) -> dict[str, Any]:
    """A deep copy of a scoped optimizer shares its process group and steps like the original;
    pickling it says why it cannot."""
    import copy
    import pickle

    bound = _after_one_step(rank, world)
    opt = bound.optimizer
    twin = copy.deepcopy(opt)
    originals = [p for group in opt.param_groups for p in group["params"]]
    copies = [p for group in twin.param_groups for p in group["params"]]
    for original, copied in zip(originals, copies, strict=True):
        copied.grad = None if original.grad is None else original.grad.clone()  # torch copies no .grad
    opt.step()
    twin.step()
    try:
        pickle.dumps(opt)
        pickled = "pickled"
    except TypeError as exc:
        pickled = str(exc)
    return {
        "same_group": twin.collective_scope().process_group is opt.collective_scope().process_group,
        "equal": all(torch.equal(a, b) for a, b in zip(originals, copies, strict=True)),
        "distinct": all(a is not b for a, b in zip(originals, copies, strict=True)),
        "pickled": pickled,
    }

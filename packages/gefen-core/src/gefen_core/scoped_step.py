"""Driving ``step()``, ``initialize_collective_state()`` and ``refresh_collective_state()`` over a
codebook scope, for any Gefen-family optimizer (the protocol is in
:mod:`gefen_core.codebook_scope`, the learning in :mod:`gefen_core.scoped_learning`).

A scoped ``step(closure)``:

1. entry checks (graph capture, the sealed layout, the binding's runtime) - with a closure,
   voted before the closure runs (so no member runs a closure with collectives in it after
   a peer failed);
2. the closure, then the preflight (the identity record unchanged, the sealed layout again,
   every gradient check of ``preflight_step``), then the gradient scaler's state and, unless
   the scaler reported an overflow (which every member then skips), every local gradient
   finite: one member's NaN or inf makes every member raise :class:`GradientError` instead
   of one member stepping into NaN state while the others go on;
3. the header: every member sees every member's failures, fingerprints, gradient presence,
   scaler state and needs; all raise together, skip together (agreed overflow) or go on;
4. steady state: update locally, no further collective. Otherwise learn over the scope,
   stage everything (new states, re-quantised indices, kernel checks), vote on the commit,
   then publish by swaps that cannot raise, unscale the gradients and update.

The host optimizer implements :class:`ScopedHost`. Each phase runs inside ``_attempt(phase, ...)``,
which records a local error with the phase's name for the next collective round (the tests inject one by
making the phase's own call raise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from gefen_contracts import LayoutTamperedError
from gefen_contracts.torch_support import finite_bounds

from .codebook_scope import (
    AMP_PHASE,
    CLOSURE_PHASE,
    COMMIT_PHASE,
    ENTRY_PHASE,
    INITIALIZE_PREAMBLE_PHASE,
    NEEDS_GRAD,
    NEEDS_NONZERO,
    NEEDS_START,
    OP_INITIALIZE,
    OP_REFRESH,
    OP_STEP,
    PERIOD_PHASE,
    PREFLIGHT_PHASE,
    REFRESH_PREAMBLE_PHASE,
    REQUANTIZE_PHASE,
    AmpReading,
    Failure,
    codebook_digest,
    commit_agreement,
    entry_vote,
    read_amp,
    share_header,
)
from .distributed import local_tensor
from .errors import CaptureError, GradientError
from .identity import IdentityRecord, verify_layout
from .ops import Kernels
from .scoped_learning import LearningOutcome, LearnItem, learn_over_scope, periods_digest
from .step_plan import capturing

__all__ = ["ScopeBinding", "ScopePlan", "ScopedHost", "scoped_initialize", "scoped_refresh", "scoped_step"]


@dataclass(slots=True)
class ScopePlan:
    """A preflighted step as the protocol sees it: the optimizer's own plan, the gradient
    presence of shared parameters (bytes in binding order), the header's needs bits, and
    every attached gradient (unscaled after the commit)."""

    inner: Any
    presence: bytes
    needs: int
    grads: list[torch.Tensor] = field(default_factory=list)


class ScopeBinding(Protocol):
    """An optimizer class's host side of the protocol (its ``_binding``; stateless, every
    method takes the optimizer): :class:`gefen_core.gefen_binding.GefenBinding`,
    :class:`gefen_core.muon_binding.MuonBinding`."""

    who: str

    def plan(self, optimizer: Any) -> ScopePlan: ...

    def items(self, optimizer: Any, plan: ScopePlan, inverse: float | None) -> list[LearnItem]: ...

    def stage(self, optimizer: Any, plan: ScopePlan, outcome: LearningOutcome) -> Any: ...

    def requantize(self, optimizer: Any, codebook: torch.Tensor) -> Any: ...

    def publish(self, optimizer: Any, plan: ScopePlan, staged: Any, requantized: Any, amp: AmpReading) -> None: ...

    def publish_codebook(self, optimizer: Any, codebook: torch.Tensor, requantized: Any) -> None: ...

    def refresh_due(self, optimizer: Any) -> bool: ...


class ScopedHost(Protocol):
    """What a Gefen-family optimizer provides to the scope drivers."""

    _identity: IdentityRecord | None
    _codebook: torch.Tensor | None
    _global_step: int
    _dispatch: Kernels
    _deterministic: bool

    @property
    def _binding(self) -> ScopeBinding: ...


def _attempt(phase: str, action: Callable[[], object]) -> tuple[object, Failure | None]:
    try:
        return action(), None
    except Exception as exc:
        return None, Failure(phase, exc)


def _check_finite(grads: Sequence[torch.Tensor]) -> None:
    # Checked here, not in the kernel: the header vote then makes every member raise together.
    for position, grad in enumerate(grads):
        local = local_tensor(grad)
        if local.numel() and finite_bounds(local) is None:
            raise GradientError(
                f"gradient {position} of this member holds NaN or inf; a scoped step raises on every member "
                "rather than step with it (attach a torch.amp.GradScaler to skip such steps together)"
            )


def _entry_checks(host: ScopedHost, identity: IdentityRecord | None, where: str) -> None:
    if capturing():
        raise CaptureError(f"{where}: a scoped operation synchronises with the host and cannot be graph-captured")
    verify_layout(host, where)
    if identity is not None and identity.scope is not None:
        identity.scope.validate_runtime()


def _learn(
    host: ScopedHost,
    identity: IdentityRecord | None,
    items: list[LearnItem],
    *,
    decide_starts: bool,
    learn_codebook: bool,
    refresh: bool,
    failure: Failure | None,
    who: str,
) -> LearningOutcome:
    binding = None if identity is None else identity.scope
    return learn_over_scope(
        binding,
        identity.fqns if identity is not None else tuple(item.fqn for item in items),
        items,
        decide_starts=decide_starts,
        learn_codebook=learn_codebook,
        refresh=refresh,
        dispatch=host._dispatch,
        deterministic=host._deterministic,
        failure=failure,
        who=who,
    )


def _requantize(host: ScopedHost, codebook: torch.Tensor) -> tuple[Any, Failure | None]:
    return _attempt(REQUANTIZE_PHASE, lambda: host._binding.requantize(host, codebook))


def _agreed(outcome: LearningOutcome) -> list[int]:
    return [*codebook_digest(outcome.codebook), *periods_digest(outcome.shared_periods)]


_AGREED = "the new codebook or the periods of shared parameters"


def scoped_step(host: ScopedHost, closure: Callable[[], Any] | None) -> Any:
    """One scoped ``step(closure)`` (module docstring); returns the closure's loss."""
    identity = host._identity
    assert identity is not None
    binding = identity.scope
    who = f"{host._binding.who} step"

    _, failure = _attempt(ENTRY_PHASE, lambda: _entry_checks(host, identity, "step"))
    loss = None
    if closure is not None:
        entry_vote(binding, failure, who)
        try:
            with torch.enable_grad():
                loss = closure()
        except Exception as exc:
            failure = Failure(CLOSURE_PHASE, exc)
    plan: ScopePlan | None = None
    if failure is None:

        def preflight() -> ScopePlan:
            if host._identity is not identity:
                raise LayoutTamperedError("step: the post_sharding identity (and its codebook scope) was replaced")
            return host._binding.plan(host)

        planned, failure = _attempt(PREFLIGHT_PHASE, preflight)
        plan = planned if isinstance(planned, ScopePlan) else None
    amp = AmpReading()
    if failure is None:

        def scaler() -> AmpReading:
            reading = read_amp(host)
            if not reading.overflow and plan is not None:
                _check_finite(plan.grads)
            return reading

        read, failure = _attempt(AMP_PHASE, scaler)
        amp = read if isinstance(read, AmpReading) else amp
    agreement = share_header(
        binding,
        operation=OP_STEP,
        failure=failure,
        global_step=host._global_step,
        codebook=host._codebook,
        static=identity.fingerprint,
        presence=b"" if plan is None else plan.presence,
        amp=amp,
        needs=0 if plan is None else plan.needs,
        who=who,
    )
    assert plan is not None
    if agreement.overflow:
        return loss
    learn = not agreement.codebook_present and agreement.any_needs(NEEDS_NONZERO)
    refresh = agreement.codebook_present and host._binding.refresh_due(host) and agreement.any_needs(NEEDS_GRAD)
    starts = agreement.any_needs(NEEDS_START)
    if not (learn or refresh or starts):
        host._binding.publish(host, plan, None, None, amp)
        return loss
    items, failure = _attempt(PERIOD_PHASE, lambda: host._binding.items(host, plan, amp.inverse))
    outcome = _learn(
        host,
        identity,
        items if isinstance(items, list) else [],
        decide_starts=starts or learn,
        learn_codebook=learn,
        refresh=refresh,
        failure=failure,
        who=who,
    )
    failure = outcome.failure
    requantized: Any = None
    if failure is None and refresh and outcome.codebook is not None:
        requantized, failure = _requantize(host, outcome.codebook)
    staged: Any = None
    if failure is None:
        staged, failure = _attempt(COMMIT_PHASE, lambda: host._binding.stage(host, plan, outcome))
    commit_agreement(binding, failure=failure, agreed=_agreed(outcome), what=_AGREED, who=who)
    host._binding.publish(host, plan, staged, requantized, amp)
    return loss


def _preamble(host: ScopedHost, phase: str, where: str) -> tuple[ScopePlan | None, Failure | None]:
    identity = host._identity

    def run() -> ScopePlan:
        _entry_checks(host, identity, where)
        return host._binding.plan(host)

    plan, failure = _attempt(phase, run)
    return (plan if isinstance(plan, ScopePlan) else None), failure


def _header(host: ScopedHost, operation: int, plan: ScopePlan | None, failure: Failure | None, who: str) -> Any:
    identity = host._identity
    return share_header(
        None if identity is None else identity.scope,
        operation=operation,
        failure=failure,
        global_step=host._global_step,
        codebook=host._codebook,
        static=(0, 0, 0, 0) if identity is None else identity.fingerprint,
        presence=b"" if plan is None else plan.presence,
        amp=AmpReading(),
        needs=0 if plan is None else plan.needs,
        who=who,
    )


def scoped_initialize(host: ScopedHost) -> bool:
    """``initialize_collective_state()``: learn the codebook if none exists (no state is created)."""
    who = f"{host._binding.who} initialize_collective_state"
    plan, failure = _preamble(host, INITIALIZE_PREAMBLE_PHASE, "initialize_collective_state")
    agreement = _header(host, OP_INITIALIZE, plan, failure, who)
    assert plan is not None
    if agreement.codebook_present:
        return True
    if not agreement.any_needs(NEEDS_NONZERO):
        return False
    identity = host._identity
    items, failure = _attempt(PERIOD_PHASE, lambda: host._binding.items(host, plan, None))
    outcome = _learn(
        host,
        identity,
        items if isinstance(items, list) else [],
        decide_starts=True,
        learn_codebook=True,
        refresh=False,
        failure=failure,
        who=who,
    )
    failure = outcome.failure
    commit_agreement(
        None if identity is None else identity.scope, failure=failure, agreed=_agreed(outcome), what=_AGREED, who=who
    )
    if outcome.codebook is None:
        return False
    host._binding.publish_codebook(host, outcome.codebook, None)
    return True


def scoped_refresh(host: ScopedHost) -> bool:
    """``refresh_collective_state()``: relearn the codebook with the stored periods and re-express
    every momentum index in it; ``True`` when the codebook changed."""
    who = f"{host._binding.who} refresh_collective_state"
    plan, failure = _preamble(host, REFRESH_PREAMBLE_PHASE, "refresh_collective_state")
    agreement = _header(host, OP_REFRESH, plan, failure, who)
    assert plan is not None
    if not agreement.codebook_present or not agreement.any_needs(NEEDS_GRAD):
        return False
    identity = host._identity
    old = host._codebook
    items, failure = _attempt(PERIOD_PHASE, lambda: host._binding.items(host, plan, None))
    outcome = _learn(
        host,
        identity,
        items if isinstance(items, list) else [],
        decide_starts=False,
        learn_codebook=False,
        refresh=True,
        failure=failure,
        who=who,
    )
    failure = outcome.failure
    new = outcome.codebook
    changed = new is not None and (old is None or not torch.equal(old, new))
    requantized: Any = None
    if failure is None and changed:
        assert new is not None
        requantized, failure = _requantize(host, new)
    commit_agreement(
        None if identity is None else identity.scope, failure=failure, agreed=_agreed(outcome), what=_AGREED, who=who
    )
    if not changed:
        return False
    assert new is not None
    host._binding.publish_codebook(host, new, requantized)
    return True

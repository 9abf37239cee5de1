"""Conformance checks for parameter-shaped state claims, contributed to the kit through the
``gefen.conformance`` entry-point group (``gefen_dcp = "gefen_dcp.conformance:checks"``).

They execute the ``feature:parameter_shaped_state`` and ``checkpoint:parameter_shaped:*``
claims of an optimizer's contract through real DCP with :class:`~gefen_dcp.GefenDCPState`:

* ``dcp.parameter_shaped_roundtrip`` - a replicated (single-process) save and load into a
  fresh twin restores ``state_dict()`` bit for bit and the continuation's losses equal the
  uninterrupted run's (within :data:`LOSS_RTOL`); ``state_dict()`` changes nothing.
* ``dcp.parameter_shaped_atomic_load`` - corrupted checkpoints (a flipped byte in a state
  tensor, an edited envelope or digest table, a truncated data file) are refused with the
  optimizer unchanged (deep snapshot).
* ``dcp.parameter_shaped_reshard`` - with an importable target (``MODULE:FACTORY``), FSDP2
  ``fully_shard`` on gloo: replicated -> 2 ranks (when that transition is claimed), 2 -> 3
  ranks and 2 ranks -> replicated,
  each continuing within :data:`LOSS_RTOL` of its uninterrupted run, with every replicated
  state tensor (a plain tensor, or a DTensor replicated on its mesh) equal on every rank
  (DCP keeps one copy of it, so a rank's own value would be lost unseen) (the first also
  executes ``training:dtensor_1d_default_world``: sharded training tracks the replicated
  run), and a corrupted 2-rank load refused on both ranks with nothing changed.

Resharding parameter-shaped state moves tensors and re-quantises nothing, but another world
size may sum a reduction in another order, hence a loss tolerance for the reshards.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from gefen_contracts.protocols import ParameterShapedState
from gefen_contracts.testing import CheckContext, ConformanceCheck, GlooWorld, deep_snapshot, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.context import Unverifiable

from . import conformance_ranks as ranks

__all__ = ["LOSS_RTOL", "checks"]

#: Largest relative difference of a continuation's loss from the uninterrupted run.
LOSS_RTOL = 5e-3

_TRANSPORT = "parameter_shaped"
_LAYOUTS = ("replicated", "dtensor_1d_default_world")
#: replicated -> FSDP2: Gefen claims it only with FSDP2's rule for 1-D parameters, so the leg
#: (and the sharded-training comparison it carries) runs only when claimed
_TO_SHARDED = f"checkpoint:{_TRANSPORT}:transition:replicated->dtensor_1d_default_world:placement_reshard"
_FEATURE = "feature:parameter_shaped_state"


def _shaped_claims(claims: frozenset[str], suffix: str = "") -> frozenset[str]:
    return frozenset(c for c in claims if c.startswith(f"checkpoint:{_TRANSPORT}:") and c.endswith(suffix))


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _relative(values: list[float], reference: list[float]) -> float:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(values, reference, strict=True)), default=0.0)


def _losses(context: CheckContext, model: Any, optimizer: Any, start: int, steps: int) -> list[float]:
    return [float(context.step(model, optimizer, index)) for index in range(start, start + steps)]


class ParameterShapedRoundTripCheck:
    name = "dcp.parameter_shaped_roundtrip"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        wanted = {_FEATURE, f"checkpoint:{_TRANSPORT}:replicated"}
        return frozenset(wanted) & claims

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model, optimizer = context.trained(steps)
        assert isinstance(optimizer, ParameterShapedState), "claims parameter_shaped_state without its Protocol"
        before = deep_snapshot(optimizer, model)
        with tempfile.TemporaryDirectory(prefix="gefen-dcp-kit-") as root, _quiet():
            path = Path(root)
            ranks.save_state(model, optimizer, path)
            diffs = snapshot_diff(before, optimizer, model)
            assert not diffs, "saving changed the optimizer: " + "; ".join(diffs[:3])
            twin_model, twin = context.fresh()
            context.copy_parameters(model, twin_model)
            ranks.load_state(twin_model, twin, path, with_model=False)
        assert_trees_equal(twin.state_dict(), optimizer.state_dict())
        reference = _losses(context, model, optimizer, steps, steps)
        resumed = _losses(context, twin_model, twin, steps, steps)
        gap = _relative(resumed, reference)
        assert gap <= LOSS_RTOL, f"continuation after a round trip differs by {gap:.2e} (limit {LOSS_RTOL})"
        context.notes.append(f"state restored bit for bit, continuation within {gap:.1e}")


class ParameterShapedAtomicLoadCheck:
    name = "dcp.parameter_shaped_atomic_load"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({f"checkpoint:{_TRANSPORT}:replicated:atomic"}) & claims

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model, optimizer = context.trained(steps)
        problems: list[str] = []
        with tempfile.TemporaryDirectory(prefix="gefen-dcp-kit-") as root, _quiet():
            for corruption in ranks.CORRUPTIONS:
                path = Path(root) / corruption
                ranks.save_state(model, optimizer, path)
                ranks.corrupt(path, corruption, optimizer)
                target_model, target = context.trained(1, seed=1)
                before = deep_snapshot(target)
                try:
                    ranks.load_state(target_model, target, path, with_model=False)
                except ranks.LOAD_ERRORS:
                    pass
                else:
                    problems.append(f"accepted a corrupted checkpoint ({corruption})")
                    continue
                diffs = snapshot_diff(before, target)
                if diffs:
                    problems.append(f"a refused load ({corruption}) changed the optimizer: " + "; ".join(diffs[:3]))
        assert not problems, "; ".join(problems)
        context.notes.append(f"{len(ranks.CORRUPTIONS)} corrupted checkpoints refused without mutation")


class ParameterShapedReshardCheck:
    name = "dcp.parameter_shaped_reshard"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        if _FEATURE not in claims:
            return frozenset()
        # Sharded training from a loaded replicated state is compared with the replicated
        # run, which also executes the plain DTensor training claim.
        covered = {"training:dtensor_1d_default_world"} & claims if _TO_SHARDED in claims else set()
        for claim in _shaped_claims(claims):
            if claim in (
                f"checkpoint:{_TRANSPORT}:dtensor_1d_default_world",
                f"checkpoint:{_TRANSPORT}:dtensor_1d_default_world:atomic",
            ):
                covered.add(claim)
            elif claim.startswith(f"checkpoint:{_TRANSPORT}:transition:") and claim.endswith(":placement_reshard"):
                source, _, target = claim.split(":")[3].partition("->")
                if source in _LAYOUTS and target in _LAYOUTS:
                    covered.add(claim)
        return frozenset(covered)

    def run(self, context: CheckContext) -> None:
        spec = context.target.spec
        if spec is None:
            raise Unverifiable("resharding needs an importable MODULE:FACTORY target for spawned ranks")
        if not torch.distributed.is_available():
            raise Unverifiable("torch.distributed is not available")
        steps = context.target.steps
        with tempfile.TemporaryDirectory(prefix="gefen-dcp-kit-") as root, _quiet():
            replicated = Path(root) / "replicated"
            sharded = Path(root) / "sharded"
            model, optimizer = context.trained(steps)
            ranks.save_state(model, optimizer, replicated)
            from_replicated = _losses(context, model, optimizer, steps, steps)
            to_sharded = _TO_SHARDED in context.claims
            with GlooWorld(2) as world:
                saved = world.run(ranks.save_sharded, spec, str(sharded), steps)
                on_two = world.run(ranks.load_sharded, spec, str(replicated), steps) if to_sharded else []
                refused = world.run(ranks.refuse_corrupted, spec, str(sharded), steps)
            with GlooWorld(3) as world:
                on_three = world.run(ranks.load_sharded, spec, str(sharded), steps)
            uninterrupted = saved[0]["losses"]
            resumed_on_two = on_two[0]["losses"] if on_two else []
            resumed_on_three = on_three[0]["losses"]
            twin_model, twin = context.fresh()
            ranks.load_state(twin_model, twin, sharded, with_model=True)
            resumed_replicated = _losses(context, twin_model, twin, steps, steps)
        gaps = {
            **({"replicated -> 2 ranks": _relative(resumed_on_two, from_replicated)} if to_sharded else {}),
            "2 -> 3 ranks": _relative(resumed_on_three, uninterrupted),
            "2 ranks -> replicated": _relative(resumed_replicated, uninterrupted),
        }
        problems = [
            f"{k}: continuation differs by {v:.2e} (limit {LOSS_RTOL})" for k, v in gaps.items() if v > LOSS_RTOL
        ]
        problems += [f"rank {r}: {outcome}" for r, outcome in enumerate(refused) if outcome != "refused unchanged"]
        for label, results in (("2 ranks", saved), ("replicated -> 2 ranks", on_two), ("2 -> 3 ranks", on_three)):
            problems += [f"{label}: {problem}" for problem in (results[0]["replicas"] if results else [])]
        assert not problems, "; ".join(problems)
        context.notes.append(", ".join(f"{k} within {v:.1e}" for k, v in gaps.items()))


def checks() -> list[ConformanceCheck]:
    """The checks gefen-dcp contributes to the conformance kit."""
    return [ParameterShapedRoundTripCheck(), ParameterShapedAtomicLoadCheck(), ParameterShapedReshardCheck()]


__all__ += ["ParameterShapedAtomicLoadCheck", "ParameterShapedReshardCheck", "ParameterShapedRoundTripCheck"]

"""Conformance checks for dense-shard claims, contributed to the kit through the
``gefen.conformance`` entry-point group (``gefen_dcp = "gefen_dcp.conformance:checks"``).

They execute the ``feature:dense_shard_codec`` and ``checkpoint:dense_shard:*`` claims of
an optimizer's contract through real DCP with :class:`~gefen_dcp.GefenDCPState`:

* ``dcp.dense_shard_roundtrip`` - a replicated (single-process) save and load into a fresh
  twin keeps the layout record (variants, counters, options), the dense fields within
  :data:`FIELD_RTOL` and the continuation's losses within :data:`LOSS_RTOL` of the
  uninterrupted run; ``state_dict()`` changes nothing.
* ``dcp.dense_shard_atomic_load`` - corrupted or mismatched checkpoints (a flipped chunk
  byte, an edited envelope, a truncated data file, another model) are refused with the
  optimizer unchanged (deep snapshot); the codec's staged load refuses a stale, foreign or
  second commit.
* ``dcp.dense_shard_reshard`` - with an importable target (``MODULE:FACTORY``), FSDP2
  ``fully_shard`` on gloo: replicated -> 2 ranks, 2 -> 3 ranks and 2 ranks -> replicated,
  each continuing within :data:`LOSS_RTOL` of its uninterrupted run (the first also
  executes ``training:dtensor_1d_default_world``: sharded training tracks the replicated
  run), and a corrupted 2-rank load refused on both ranks with nothing changed.

The dense-shard transport may be approximate (an optimizer may re-quantise after a
reshard), hence tolerances rather than bit equality.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from gefen_contracts import DenseShardCodec, StaleTransactionError
from gefen_contracts.testing import CheckContext, ConformanceCheck, GlooWorld, deep_snapshot, snapshot_diff
from gefen_contracts.testing.context import Unverifiable

from . import conformance_ranks as ranks

__all__ = ["FIELD_RTOL", "LOSS_RTOL", "checks"]

#: Largest relative difference of a continuation's loss from the uninterrupted run.
LOSS_RTOL = 5e-3
#: Largest relative L2 difference of a dense field after a save/load round trip.
FIELD_RTOL = 1e-2

_TRANSPORT = "dense_shard"
_LAYOUTS = ("replicated", "dtensor_1d_default_world")


def _dense_claims(claims: frozenset[str], suffix: str = "") -> frozenset[str]:
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


class DenseShardRoundTripCheck:
    name = "dcp.dense_shard_roundtrip"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        wanted = {"feature:dense_shard_codec", f"checkpoint:{_TRANSPORT}:replicated"}
        return frozenset(wanted) & claims

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model, optimizer = context.trained(steps)
        assert isinstance(optimizer, DenseShardCodec), "claims dense_shard_codec without DenseShardCodec"
        before = deep_snapshot(optimizer, model)
        with tempfile.TemporaryDirectory(prefix="gefen-dcp-kit-") as root, _quiet():
            path = Path(root)
            ranks.save_state(model, optimizer, path)
            diffs = snapshot_diff(before, optimizer, model)
            assert not diffs, "saving changed the optimizer: " + "; ".join(diffs[:3])
            twin_model, twin = context.fresh()
            context.copy_parameters(model, twin_model)
            ranks.load_state(twin_model, twin, path, with_model=False)
        saved = {s.fqn: s for s in optimizer.dense_shard_slots()}
        loaded = {s.fqn: s for s in twin.dense_shard_slots()}
        assert set(saved) == set(loaded), f"parameters differ after load: {sorted(set(saved) ^ set(loaded))}"
        for fqn, slot in saved.items():
            other = loaded[fqn]
            assert (slot.variant, dict(slot.counters), dict(slot.options), slot.fields) == (
                other.variant,
                dict(other.counters),
                dict(other.options),
                other.fields,
            ), f"{fqn}: the loaded layout record differs"
            for field in slot.fields:
                a = optimizer.materialize_dense_field(fqn, field)
                b = twin.materialize_dense_field(fqn, field)
                error = float((a - b).norm() / a.norm().clamp_min(1e-30))
                assert error <= FIELD_RTOL, f"{fqn}.{field}: relative error {error:.2e} after a round trip"
        reference = _losses(context, model, optimizer, steps, steps)
        resumed = _losses(context, twin_model, twin, steps, steps)
        gap = _relative(resumed, reference)
        assert gap <= LOSS_RTOL, f"continuation after a round trip differs by {gap:.2e} (limit {LOSS_RTOL})"
        context.notes.append(f"continuation within {gap:.1e}")


class DenseShardAtomicLoadCheck:
    name = "dcp.dense_shard_atomic_load"

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
        problems.extend(self._staged(context))
        assert not problems, "; ".join(problems)
        context.notes.append(f"{len(ranks.CORRUPTIONS)} corrupted checkpoints refused without mutation")

    @staticmethod
    def _staged(context: CheckContext) -> list[str]:
        problems = []
        model, optimizer = context.trained(context.target.steps)
        slots = ranks.loads_of(optimizer)
        common = dict(optimizer.dense_shard_common())
        before = deep_snapshot(optimizer, model)
        staged = optimizer.prepare_dense_shard_load(common, slots)
        if snapshot_diff(before, optimizer, model):
            problems.append("prepare_dense_shard_load changed the optimizer")
        _, other = context.trained(context.target.steps, seed=1)
        try:
            other.commit_dense_shard_load(staged)
            problems.append("a staged dense-shard load committed on another optimizer")
        except StaleTransactionError:
            pass
        context.step(model, optimizer, 10_000)
        try:
            optimizer.commit_dense_shard_load(staged)
            problems.append("a stale staged dense-shard load (the optimizer stepped) was committed")
        except StaleTransactionError:
            pass
        fresh = optimizer.prepare_dense_shard_load(dict(optimizer.dense_shard_common()), ranks.loads_of(optimizer))
        optimizer.commit_dense_shard_load(fresh)
        try:
            optimizer.commit_dense_shard_load(fresh)
            problems.append("a staged dense-shard load was committed twice")
        except StaleTransactionError:
            pass
        return problems


class DenseShardReshardCheck:
    name = "dcp.dense_shard_reshard"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        if "feature:dense_shard_codec" not in claims:
            return frozenset()
        # Sharded training from a loaded replicated state is compared with the replicated
        # run, which also executes the plain DTensor training claim.
        covered = {"training:dtensor_1d_default_world"} & claims
        for claim in _dense_claims(claims):
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
            with GlooWorld(2) as world:
                uninterrupted = world.run(ranks.save_sharded, spec, str(sharded), steps)[0]
                resumed_on_two = world.run(ranks.load_sharded, spec, str(replicated), steps)[0]
                refused = world.run(ranks.refuse_corrupted, spec, str(sharded), steps)
            with GlooWorld(3) as world:
                resumed_on_three = world.run(ranks.load_sharded, spec, str(sharded), steps)[0]
            twin_model, twin = context.fresh()
            ranks.load_state(twin_model, twin, sharded, with_model=True)
            resumed_replicated = _losses(context, twin_model, twin, steps, steps)
        gaps = {
            "replicated -> 2 ranks": _relative(resumed_on_two, from_replicated),
            "2 -> 3 ranks": _relative(resumed_on_three, uninterrupted),
            "2 ranks -> replicated": _relative(resumed_replicated, uninterrupted),
        }
        problems = [
            f"{k}: continuation differs by {v:.2e} (limit {LOSS_RTOL})" for k, v in gaps.items() if v > LOSS_RTOL
        ]
        problems += [f"rank {r}: {outcome}" for r, outcome in enumerate(refused) if outcome != "refused unchanged"]
        assert not problems, "; ".join(problems)
        context.notes.append(", ".join(f"{k} within {v:.1e}" for k, v in gaps.items()))


def checks() -> list[ConformanceCheck]:
    """The checks gefen-dcp contributes to the conformance kit."""
    return [DenseShardRoundTripCheck(), DenseShardAtomicLoadCheck(), DenseShardReshardCheck()]


__all__ += ["DenseShardAtomicLoadCheck", "DenseShardReshardCheck", "DenseShardRoundTripCheck"]

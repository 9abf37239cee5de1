"""Checkpoint claims as executed checks: bit-exact round trips and atomic loads."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ...enums import CheckpointTransport, ParameterLayout
from ...errors import StaleTransactionError
from ...protocols import StagedNativeLoad
from ..claims import atomic_claim, checkpoint_claim
from ..context import CheckContext
from ..corruption import corrupted_variants
from ..snapshot import deep_snapshot, snapshot_diff

__all__ = [
    "AtomicLoadCheck",
    "NativeRefusalsCheck",
    "NativeRoundTripCheck",
    "TorchRecipeCheck",
    "assert_trees_equal",
    "corrupted_loads",
]

_REPL = ParameterLayout.REPLICATED.value
_NATIVE = (CheckpointTransport.NATIVE_OPTIMIZER.value, CheckpointTransport.COMPOSITE_NATIVE.value)
_RANK_LOCAL = CheckpointTransport.PYTORCH_RANK_LOCAL.value


def assert_trees_equal(a: Any, b: Any, path: str = "state_dict") -> None:
    """Bitwise equality of two primitive/tensor trees (dict key sets, list lengths, bytes)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{path}: tensor vs non-tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        ua = a.detach().cpu().contiguous().reshape(-1)
        ub = b.detach().cpu().contiguous().reshape(-1)
        if ua.dtype is torch.bool:
            ua, ub = ua.to(torch.uint8), ub.to(torch.uint8)
        assert torch.equal(ua.view(torch.uint8), ub.view(torch.uint8)), f"{path}: tensor bytes differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            assert_trees_equal(a[key], b[key], f"{path}[{key!r}]")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: sequences differ"
        for index, (x, y) in enumerate(zip(a, b)):
            assert_trees_equal(x, y, f"{path}[{index}]")
        return
    assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


#: A key torch's ``LRScheduler`` writes into every group; a load must carry it like any option.
SCHEDULER_KEY = "initial_lr"


def _scheduled(optimizer: Any) -> Any:
    """``optimizer`` with every non-zero float option scaled by 0.75 (each float of a tuple
    option too: torch's ``betas``) and a scheduler's :data:`SCHEDULER_KEY` in each group, as
    schedulers leave them (``OneCycleLR`` cycles the momentum, ``betas[0]``, too): a checkpoint
    then carries options its loading twin (built by the same factory) does not have, so a
    load that keeps some of its own, drops a key it does not know, or writes them (or a
    multiple) before it refuses, is seen. Options of other types (flags, counts) keep their
    values: a changed flag could ask for a mode the optimizer does not run here."""
    for group in optimizer.param_groups:
        for key, value in list(group.items()):
            if type(value) is float and value != 0.0:
                group[key] = value * 0.75
            elif type(value) is tuple and value and all(type(item) is float for item in value):
                group[key] = tuple(item * 0.75 for item in value)
        if type(group.get("lr")) is float:
            group.setdefault(SCHEDULER_KEY, group["lr"] / 0.75)
    return optimizer


class NativeRoundTripCheck:
    """Same-topology native checkpoints: save (weights-only), load into a fresh twin whose
    options differ (the source's options were scheduled) through torch's load hooks, continue
    bit-exactly; a staged loader keeps no reference to the caller's tensors; a checkpoint
    saved before the first step replaces a trained optimizer's state; two groups (the second
    added by ``add_param_group`` under other options) round-trip."""

    name = "checkpoint.native_roundtrip"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset(checkpoint_claim(t, _REPL) for t in _NATIVE) & claims

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model, optimizer = context.trained(steps)
        _scheduled(optimizer)
        before = deep_snapshot(optimizer, model)
        live = optimizer.state_dict()
        diffs = snapshot_diff(before, optimizer, model)
        assert not diffs, "state_dict() changed the optimizer: " + "; ".join(diffs[:3])
        saved = context.weights_only_roundtrip(live)
        twin_model, twin = context.fresh()
        context.copy_parameters(model, twin_model)
        reference = context.weights_only_roundtrip(saved)
        hooks: list[str] = []
        twin.register_load_state_dict_pre_hook(lambda *_: hooks.append("pre"))
        twin.register_load_state_dict_post_hook(lambda *_: hooks.append("post"))
        twin.load_state_dict(saved)
        assert hooks == ["pre", "post"], f"load_state_dict ran torch's load hooks as {hooks}, not ['pre', 'post']"
        assert_trees_equal(saved, reference, "caller's state dict after load_state_dict")
        assert_trees_equal(optimizer.state_dict(), twin.state_dict(), "state_dict after load")
        context.train(model, optimizer, steps, start=steps)
        context.train(twin_model, twin, steps, start=steps)
        context.assert_models_bitwise_equal(model, twin_model, "continuation after a native round trip")
        assert_trees_equal(optimizer.state_dict(), twin.state_dict(), "state_dict after continuation")
        if isinstance(twin, StagedNativeLoad):  # a staged load builds on fresh tensors (torch's aliases)
            assert_trees_equal(saved, reference, "caller's state dict after the loaded optimizer stepped")
        self._step_zero_into_trained(context)
        self._two_groups(context)

    @staticmethod
    def _two_groups(context: CheckContext) -> None:
        # the factory's optimizer over half the parameters, the rest added as a second group
        # with other options: a load that gives every group the first group's options is seen
        # even when the factory builds one group
        def build() -> tuple[Any, Any]:
            torch.manual_seed(0)
            model = context.target.model_builder(0)
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            cut = max(1, len(named) // 2)
            optimizer = context.target.factory(named[:cut])
            _add_group_like_last(optimizer, named[cut:])
            return model, optimizer

        try:
            model, source = build()
        except Exception as exc:  # add_param_group is torch's, but an optimizer may refuse it
            context.notes.append(f"two-group round trip not exercised: add_param_group raised {type(exc).__name__}")
            return
        for key, value in list(source.param_groups[-1].items()):
            if type(value) is float and value != 0.0:
                source.param_groups[-1][key] = value * 0.5
        steps = context.target.steps
        context.train(model, source, steps)
        saved = context.weights_only_roundtrip(source.state_dict())
        twin_model, twin = build()
        context.copy_parameters(model, twin_model)
        twin.load_state_dict(saved)
        assert_trees_equal(source.state_dict(), twin.state_dict(), "two-group state_dict after load")
        context.train(model, source, steps, start=steps)
        context.train(twin_model, twin, steps, start=steps)
        context.assert_models_bitwise_equal(model, twin_model, "two-group continuation after a native round trip")
        context.notes.append("two groups round-tripped")

    @staticmethod
    def _step_zero_into_trained(context: CheckContext) -> None:
        # a checkpoint taken before the first step (state for no parameter) is valid: loading it
        # into a trained optimizer replaces its state (a merge keeps the old state, silently)
        source_model, source = context.fresh()
        saved = context.weights_only_roundtrip(source.state_dict())
        model, trained = context.trained()
        context.copy_parameters(source_model, model)
        try:
            trained.load_state_dict(saved)
        except Exception as exc:
            raise AssertionError(
                f"a checkpoint saved before the first step was refused: {type(exc).__name__}: {exc}"
            ) from exc
        assert_trees_equal(
            source.state_dict(), trained.state_dict(), "a trained optimizer after loading a step-0 checkpoint"
        )
        context.train(source_model, source, 1)
        context.train(model, trained, 1)
        context.assert_models_bitwise_equal(source_model, model, "continuation after loading a step-0 checkpoint")


class TorchRecipeCheck:
    """torch's checkpoint recipe in one process, nested and flattened (torchtitan's):
    ``get_optimizer_state_dict`` -> ``dcp.save``; a fresh twin, its template from
    ``get_optimizer_state_dict`` (which steps a stateless optimizer once with zero gradients) ->
    ``dcp.load`` -> ``set_optimizer_state_dict``; the twin's ``state_dict()`` equals the
    source's bit for bit and training continues bit-exactly.

    The flattened recipe rebuilds each parameter's entry from the keys of the *live*
    ``optimizer.state[param]``, so a native state dict whose per-parameter keys differ from the
    live state's loses state there (a key only the checkpoint has is dropped, a key only the live
    state has comes back as ``{}``); the recipe also re-keys the state by parameter name, which a
    load that accepts only integer ids refuses (the example ``ContractedSGD`` did)."""

    name = "checkpoint.torch_recipe"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({checkpoint_claim(_RANK_LOCAL, _REPL)}) & claims

    def run(self, context: CheckContext) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load
        from torch.distributed.checkpoint.state_dict_saver import save

        steps = context.target.steps
        for flatten in (False, True):
            recipe = f"torch's {'flattened' if flatten else 'nested'} recipe"
            options = StateDictOptions(flatten_optimizer_state_dict=flatten)
            model, optimizer = context.trained(steps)
            twin_model, twin = context.fresh()
            context.copy_parameters(model, twin_model)
            with tempfile.TemporaryDirectory() as path, warnings.catch_warnings():
                # DCP warns that it runs in one process, which is the point here
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                save(get_optimizer_state_dict(model, optimizer, options=options), checkpoint_id=path)
                template = get_optimizer_state_dict(twin_model, twin, options=options)
                load(template, checkpoint_id=path)
                set_optimizer_state_dict(twin_model, twin, template, options=options)
            context.assert_models_bitwise_equal(model, twin_model, f"parameters after {recipe} (its template step)")
            assert_trees_equal(optimizer.state_dict(), twin.state_dict(), f"state_dict after {recipe}")
            context.train(model, optimizer, steps, start=steps)
            context.train(twin_model, twin, steps, start=steps)
            context.assert_models_bitwise_equal(model, twin_model, f"continuation after {recipe}")
        context.notes.append("nested and flattened recipes round-tripped")


class AtomicLoadCheck:
    """A claimed atomic native load raises and changes nothing under every corruption class;
    a staged load refuses a stale commit."""

    name = "checkpoint.native_atomic_load"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        wanted = {atomic_claim(t, _REPL) for t in _NATIVE} | {"feature:staged_native_load"}
        return frozenset(wanted) & claims

    def run(self, context: CheckContext) -> None:
        valid, problems, tried = corrupted_loads(context, unchanged=True)
        model, optimizer = context.trained(context.target.steps)
        if isinstance(optimizer, StagedNativeLoad):
            problems.extend(self._staged(context, model, optimizer, valid))
        assert not problems, "; ".join(problems)
        context.notes.append(f"{tried} corrupted loads rejected without mutation")

    @staticmethod
    def _staged(context: CheckContext, model: Any, optimizer: Any, valid: dict[str, Any]) -> list[str]:
        other: Any
        fresh_optimizer: Any
        problems = []
        before = deep_snapshot(optimizer, model)
        staged = optimizer.stage_state_dict(valid)
        diffs = snapshot_diff(before, optimizer, model)
        if diffs:
            problems.append("stage_state_dict changed the optimizer: " + "; ".join(diffs[:3]))
        # and a fresh one, whose state is empty: reading ``optimizer.state[p]`` (a defaultdict)
        # adds an entry there, which a trained optimizer's full state hides
        fresh_model, fresh_optimizer = context.fresh()
        before = deep_snapshot(fresh_optimizer, fresh_model)
        fresh_optimizer.stage_state_dict(valid)
        diffs = snapshot_diff(before, fresh_optimizer, fresh_model)
        if diffs:
            problems.append("stage_state_dict changed a fresh optimizer: " + "; ".join(diffs[:3]))
        other_model, other = context.trained(context.target.steps)
        refusals = [_stale_refusal(other, other_model, staged, "a staged load on another optimizer")]
        context.step(model, optimizer, 10_000)
        refusals.append(_stale_refusal(optimizer, model, staged, "a staged load after the optimizer stepped"))
        fresh = optimizer.stage_state_dict(valid)
        optimizer.commit_staged_state_dict(fresh)
        refusals.append(_stale_refusal(optimizer, model, fresh, "a staged load committed a second time"))
        # two loads staged from the same state: committing one makes the other stale
        first, second = optimizer.stage_state_dict(valid), optimizer.stage_state_dict(valid)
        optimizer.commit_staged_state_dict(second)
        refusals.append(_stale_refusal(optimizer, model, first, "a load staged before another load was committed"))
        problems.extend(problem for problem in refusals if problem)
        # stage + commit publishes what load_state_dict publishes
        _loaded_model, loaded = context.trained(context.target.steps)
        loaded.load_state_dict(valid)
        try:
            assert_trees_equal(optimizer.state_dict(), loaded.state_dict(), "state_dict after stage + commit")
        except AssertionError as exc:
            problems.append(f"stage_state_dict + commit_staged_state_dict did not publish the checkpoint: {exc}")
        # last, as it leaves the optimizer a group larger: a load staged before a group was
        # added knows nothing of that group, so its commit must be refused too
        staged = optimizer.stage_state_dict(valid)
        if _added_group(context, optimizer):
            refusal = _stale_refusal(optimizer, model, staged, "a load staged before add_param_group")
            problems.extend([refusal] if refusal else [])
        return problems


def _add_group_like_last(optimizer: Any, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """``add_param_group`` of ``named`` with the last group's options, as ``(name, parameter)``
    pairs when its parameters are named (torch then records the names; a composite routes by them)."""
    last = optimizer.param_groups[-1]
    options = {k: v for k, v in last.items() if k not in ("params", "param_names")}
    optimizer.add_param_group({**options, "params": list(named) if "param_names" in last else [p for _, p in named]})


def _added_group(context: CheckContext, optimizer: Any) -> bool:
    """Add a group of one new parameter (:func:`_add_group_like_last`); ``False`` (noted) when
    the optimizer refuses it, as it may."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    if first is None:  # a group may be empty (ZeRO builds them); with no parameter there is nothing to copy
        context.notes.append("staged load across add_param_group not exercised: the optimizer holds no parameter")
        return False
    extra = torch.nn.Parameter(torch.zeros(4, dtype=first.dtype, device=first.device))
    try:
        _add_group_like_last(optimizer, [("kit_added_group.weight", extra)])
    except Exception as exc:
        context.notes.append(f"staged load across add_param_group not exercised: it raised {type(exc).__name__}")
        return False
    return True


def _stale_refusal(optimizer: Any, model: Any, staged: Any, what: str) -> str | None:
    """``None`` when committing ``staged`` raises ``StaleTransactionError`` and changes nothing;
    else the problem, naming ``what``."""
    before = deep_snapshot(optimizer, model)
    try:
        optimizer.commit_staged_state_dict(staged)
    except StaleTransactionError:
        return f"refusing {what} changed the optimizer" if snapshot_diff(before, optimizer, model) else None
    return f"{what} was committed"


class NativeRefusalsCheck:
    """A native load claimed without atomicity still refuses every corruption class (a
    non-atomic claim licenses a partial change on a refused load, not accepting garbage)."""

    name = "checkpoint.native_refusals"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return (
            frozenset(c for c in (checkpoint_claim(t, _REPL) for t in _NATIVE) if c + ":atomic" not in claims) & claims
        )

    def run(self, context: CheckContext) -> None:
        _valid, problems, tried = corrupted_loads(context, unchanged=False)
        assert not problems, "; ".join(problems)
        context.notes.append(f"{tried} corrupted loads rejected")


def corrupted_loads(context: CheckContext, *, unchanged: bool) -> tuple[dict[str, Any], list[str], int]:
    """Every corruption class through ``load_state_dict`` (and ``stage_state_dict``): the valid
    state dict, the problems (a load accepted, or raising another type; with ``unchanged``, a
    refused load that changed the optimizer) and how many corruptions applied."""
    steps = context.target.steps
    # the source is trained further than every target: a load that writes part of a
    # checkpoint before it refuses changes bytes (an identically trained source would
    # write the bytes already there, and no snapshot could see it)
    _source_model, source = context.trained(steps + 2)
    valid = _scheduled(source).state_dict()
    problems: list[str] = []
    tried = 0
    for name, corrupted in corrupted_variants(valid):
        tried += 1
        model, optimizer = context.trained(steps)
        loads: list[tuple[str, Any]] = [("load_state_dict", optimizer.load_state_dict)]
        if isinstance(optimizer, StagedNativeLoad):
            loads.append(("stage_state_dict", optimizer.stage_state_dict))
        for what, load in loads:
            before = deep_snapshot(optimizer, model)
            problem = _refusal_problem(load, corrupted, f"{what} ({name})")
            diffs = snapshot_diff(before, optimizer, model) if unchanged else []
            if problem:
                problems.append(problem)
            elif diffs:
                problems.append(f"a rejected {what} ({name}) changed the optimizer: " + "; ".join(diffs[:3]))
    assert tried > 0, "no corruption class applied to this optimizer's state dict"
    return valid, problems, tried


#: What a refused native load raises (``StagedNativeLoad``: a ValueError, TypeError or KeyError naming the problem).
REFUSALS = (ValueError, TypeError, KeyError)


def _refusal_problem(load: Any, corrupted: Any, what: str) -> str | None:
    """``None`` when ``load(corrupted)`` raises one of :data:`REFUSALS`, else what went wrong."""
    try:
        load(corrupted)
    except REFUSALS:
        return None
    except Exception as exc:
        return f"{what} raised {type(exc).__name__}, not a ValueError, TypeError or KeyError: {exc}"
    return f"accepted a corrupted checkpoint: {what}"

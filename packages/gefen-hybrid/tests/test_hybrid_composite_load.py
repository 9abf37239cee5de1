"""The composite's native load is atomic across both children."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import FEATURE_STAGED_NATIVE_LOAD, NotSupportedError, StaleTransactionError, StateValidationError
from gefen_contracts.enums import CheckpointTransport, LoadAtomicity
from gefen_contracts.testing import CORRUPTIONS, deep_snapshot, snapshot_diff
from gefen_contracts.testing.corruption import corrupted_variants
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from hybrid_toys import SignMomentum, UnstagedSGD, llama_loss, make_tiny_llama, single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn


def _build(seed: int = 0, backup: str = "adamw") -> tuple[nn.Module, CompositeOptimizer]:
    model = make_tiny_llama(seed)

    def make_backup(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        if backup == "adamw":
            return ContractedAdamW(named, lr=1e-3)
        return UnstagedSGD(named, lr=1e-2, momentum=0.9)

    optimizer = CompositeOptimizer.from_factories(
        model, {"muon": lambda named: SignMomentum(named, lr=1e-3), "backup": make_backup}
    )
    return model, optimizer


def _trained(seed: int = 0, steps: int = 2, backup: str = "adamw") -> tuple[nn.Module, CompositeOptimizer]:
    model, optimizer = _build(seed, backup)
    for step in range(steps):
        optimizer.zero_grad()
        llama_loss(model, step).backward()
        optimizer.step()
    return model, optimizer


def test_every_corruption_class_on_either_half_leaves_both_children_unchanged() -> None:
    _, source = _trained()
    valid = source.state_dict()
    applied: set[str] = set()
    for name, corrupted in corrupted_variants(valid):
        model, optimizer = _trained(1)
        before = deep_snapshot(optimizer, model)
        with pytest.raises((ValueError, TypeError, KeyError)):
            optimizer.load_state_dict(corrupted)
        assert snapshot_diff(before, optimizer, model) == [], name
        applied.add(name)
    assert applied == {c.name for c in CORRUPTIONS}  # one flat torch state dict: every class applies


Edit = Callable[[dict[str, Any]], None]


def _single_optimizer(state: dict[str, Any]) -> None:
    """The state dict reduced to a single optimizer's shape (Gefen's: no composite record)."""
    for key in ("format", "format_version", "child_implementations", "routing"):
        state.pop(key)
    state["gefen_codebook"] = None


ENVELOPE_CORRUPTIONS: list[tuple[str, Edit, str]] = [
    ("nested_v1", lambda sd: sd.update({"muon": {}, "backup": {}}), "version 1"),
    ("missing_groups", lambda sd: sd["param_groups"].pop(), "param groups, this composite has"),
    ("missing_key", lambda sd: sd.pop("routing"), "lacks the others"),
    ("no_state", lambda sd: sd.pop("state"), r"lacks \['state'\]"),
    ("extra_key", lambda sd: sd.__setitem__("extra", 1), "unknown top-level key 'extra'$"),
    ("single_optimizer", _single_optimizer, "'gefen_codebook'; with no composite record, this is not a composite's"),
    ("other_role_record", lambda sd: sd.__setitem__("critic.step", 1), "unknown top-level key 'critic.step'"),
    ("stray_state", lambda sd: sd["state"].__setitem__(999, {}), "names no parameter"),
    (
        "duplicate_id",
        lambda sd: sd["param_groups"][-1]["params"].__setitem__(0, sd["param_groups"][0]["params"][0]),
        "appears twice",
    ),
    # an unhashable id leaked a TypeError from the membership test
    ("bytearray_id", lambda sd: sd["param_groups"][0]["params"].__setitem__(0, bytearray(b"0")), "not an int or str"),
    ("format", lambda sd: sd.__setitem__("format", "torch"), "'format'"),
    ("version", lambda sd: sd.__setitem__("format_version", 3), "format_version"),
    ("bool_version", lambda sd: sd.__setitem__("format_version", True), "format_version"),
    ("implementation", lambda sd: sd["child_implementations"].__setitem__("backup", "gefen.Gefen"), "children are"),
    ("missing_half", lambda sd: sd["child_implementations"].pop("backup"), "'backup' half is missing"),
    ("role_swapped", lambda sd: sd["routing"].__setitem__(0, [sd["routing"][0][0], "muon"]), "routed to 'muon'"),
    ("fqn_missing", lambda sd: sd["routing"].pop(), "missing from the checkpoint's routing"),
    ("fqn_extra", lambda sd: sd["routing"].append(["zzz.weight", "muon"]), "no such parameter"),
    ("unsorted", lambda sd: sd["routing"].reverse(), "sorted"),
    # the checkpoint of a composite built from torch.compile(model) (or a DDP-wrapped model)
    (
        "wrapped_model",
        lambda sd: sd.__setitem__("routing", [["_orig_mod." + fqn, role] for fqn, role in sd["routing"]]),
        r"the checkpoint's parameter names are the others' under the prefix '_orig_mod\.'.*torch\.compile",
    ),
    ("not_pairs", lambda sd: sd["routing"].__setitem__(0, "embed"), r"'routing'\[0\]"),
]


@pytest.mark.parametrize(
    ("edit", "match"), [c[1:] for c in ENVELOPE_CORRUPTIONS], ids=[c[0] for c in ENVELOPE_CORRUPTIONS]
)
def test_envelope_corruptions_are_refused_before_any_child_is_touched(edit: Edit, match: str) -> None:
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    edit(state)
    model, optimizer = _trained(1)
    before = deep_snapshot(optimizer, model)
    with pytest.raises(StateValidationError, match=match):
        optimizer.load_state_dict(state)
    assert snapshot_diff(before, optimizer, model) == []


def test_a_half_for_an_absent_role_is_refused() -> None:
    hidden = nn.Linear(4, 4, bias=False)
    only_muon = CompositeOptimizer({"muon": SignMomentum(list(hidden.named_parameters()))})
    _, source = _trained()
    state = copy.deepcopy(source.state_dict())
    with pytest.raises(StateValidationError, match="no 'backup' child"):
        only_muon.load_state_dict(state)


def test_child_load_hooks_run_around_the_joint_publication() -> None:
    _, source = _trained()
    valid = source.state_dict()
    _, optimizer = _trained(1)
    muon, backup = optimizer.child_optimizers().values()
    seen: dict[str, Any] = {}

    def muon_pre(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        state["param_groups"] = [dict(g, lr=0.123) for g in state["param_groups"]]
        return state

    def muon_post(opt: torch.optim.Optimizer) -> None:
        # runs after BOTH children were published
        seen["backup_lr"] = backup.param_groups[0]["lr"]

    muon.register_load_state_dict_pre_hook(muon_pre)
    muon.register_load_state_dict_post_hook(muon_post)
    optimizer.load_state_dict(valid)
    assert muon.param_groups[0]["lr"] == 0.123
    assert seen["backup_lr"] == source.child_optimizers()["backup"].param_groups[0]["lr"]


def test_staged_composite_loads_are_single_use_owned_and_fresh() -> None:
    model, optimizer = _trained()
    valid = optimizer.state_dict()
    staged = optimizer.stage_state_dict(valid)
    _, other = _trained(1)
    with pytest.raises(StaleTransactionError, match="another optimizer"):
        other.commit_staged_state_dict(staged)

    def refused_after(change: Callable[[], object]) -> None:
        pending = optimizer.stage_state_dict(valid)
        change()
        before = deep_snapshot(optimizer, model)
        with pytest.raises(StaleTransactionError):
            optimizer.commit_staged_state_dict(pending)
        assert snapshot_diff(before, optimizer, model) == []

    backup = optimizer.child_optimizers()["backup"]
    refused_after(optimizer.step)
    refused_after(backup.step)  # a child stepped directly
    refused_after(lambda: backup.load_state_dict(backup.state_dict()))  # a child loaded directly
    # a child's own staged load runs no hook the composite sees: the muon child would commit,
    # then the backup refuse its stale stage (half a checkpoint)
    refused_after(lambda: backup.commit_staged_state_dict(backup.stage_state_dict(backup.state_dict())))
    fresh = optimizer.stage_state_dict(valid)
    optimizer.commit_staged_state_dict(fresh)
    with pytest.raises(StaleTransactionError, match="consumed"):
        optimizer.commit_staged_state_dict(fresh)
    refused_after(lambda: optimizer.add_param_group({"params": [("extra.bias", nn.Parameter(torch.zeros(3)))]}))


def test_a_child_without_staged_load_makes_the_native_load_non_atomic_with_reasons() -> None:
    model, optimizer = _trained(backup="sgd")
    capabilities = optimizer.optimizer_contract().capabilities
    native = capabilities.checkpoints[0]
    assert native.transport is CheckpointTransport.COMPOSITE_NATIVE
    assert native.atomicity is LoadAtomicity.NONE
    status = capabilities.feature(FEATURE_STAGED_NATIVE_LOAD)
    assert not status.supported
    assert status.reasons == (
        "child 'backup' (gefen_tests.UnstagedSGD): it loads with torch.optim.SGD.load_state_dict",
    )
    with pytest.raises(NotSupportedError, match="UnstagedSGD"):
        optimizer.stage_state_dict(optimizer.state_dict())

    # it still loads, and a corrupted muon half still changes nothing: muon is staged first
    _, source = _trained(seed=3, backup="sgd")
    optimizer.load_state_dict(source.state_dict())
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            optimizer.child_optimizers()["backup"].state_dict()["state"][0].values(),
            source.child_optimizers()["backup"].state_dict()["state"][0].values(),
        )
    )
    corrupted = copy.deepcopy(source.state_dict())
    corrupted["state"][0]["momentum_buffer"] = corrupted["state"][0]["momentum_buffer"].double()  # a muon entry
    before = deep_snapshot(optimizer, model)
    with pytest.raises(StateValidationError):
        optimizer.load_state_dict(corrupted)
    assert snapshot_diff(before, optimizer, model) == []

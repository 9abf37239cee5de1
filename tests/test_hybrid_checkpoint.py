"""GefenMuonHybrid checkpoints: bit-exact resume through ``torch.save``/``torch.load(weights_only=True)``
for both backups, and atomic loads: every corruption class applied to either half, and every
envelope problem, is refused with the model and both children unchanged."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen import GefenMuonHybrid
from gefen_contracts import StateValidationError
from gefen_contracts.testing import CORRUPTIONS, deep_snapshot, snapshot_diff
from gefen_contracts.testing.corruption import corrupted_variants
from gefen_hybrid import ROLES, children_of_state_dict
from hybrid_models import TinyLlama, seeded, train

BACKUPS = ["gefen", "adamw"]


def _hybrid(model: torch.nn.Module, backup: str, **options: Any) -> GefenMuonHybrid:
    return GefenMuonHybrid(model, lr=3e-3, backup_optimizer=backup, weight_decay=0.01, **options)


def _round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def same_tree(a: object, b: object) -> bool:
    """Equal structure, equal primitives, tensors equal in dtype, shape and every bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _trained(backup: str, steps: int = 3) -> tuple[TinyLlama, GefenMuonHybrid]:
    model = seeded(TinyLlama)
    optimizer = _hybrid(model, backup)
    train(model, optimizer, steps)
    return model, optimizer  # type: ignore[return-value]


@pytest.mark.parametrize("backup", BACKUPS)
def test_resume_from_a_weights_only_checkpoint_is_bit_exact(backup: str) -> None:
    model, optimizer = _trained(backup)
    checkpoint = _round_trip({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    resumed_model = seeded(TinyLlama, seed=1)  # other initial values: everything must come from the checkpoint
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = _hybrid(resumed_model, backup)
    resumed.load_state_dict(checkpoint["optimizer"])
    expected = train(model, optimizer, 3, start=3)
    got = train(resumed_model, resumed, 3, start=3)
    assert got == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert same_tree(optimizer.state_dict(), resumed.state_dict())


@pytest.mark.parametrize("backup", BACKUPS)
def test_every_corruption_class_on_either_half_is_refused_with_nothing_changed(backup: str) -> None:
    _, source = _trained(backup)
    saved = source.state_dict()
    target_model, target = _trained(backup, steps=1)  # live state that a refused load must keep
    applied: set[str] = set()
    subject = (target_model, target)
    for name, corrupted in _corrupted_halves(target, saved):
        before = deep_snapshot(subject)
        with pytest.raises((StateValidationError, ValueError, TypeError, KeyError)):
            target.load_state_dict(corrupted)
        assert snapshot_diff(before, subject) == [], name
        applied.add(name)
    for half, child in target.child_optimizers().items():
        classes = {name.partition("@")[0] for name in applied if name.endswith(f"@{half}")}
        # every class, on each half (the last-group class needs two groups)
        expected = {c.name for c in CORRUPTIONS} - (
            {"last_group_non_finite_option"} if len(child.param_groups) < 2 else set()
        )
        assert classes == expected, (half, classes)
    target.load_state_dict(saved)  # the uncorrupted checkpoint still loads afterwards
    assert same_tree(saved, target.state_dict())


@pytest.mark.parametrize("backup", BACKUPS)
def test_a_refused_half_names_the_composites_group_indices(backup: str) -> None:
    """The backup's loader numbers its own groups (``param_groups[0]``); the load's error now
    carries the note a step's error carries, mapping them to the composite's."""
    _, optimizer = _trained(backup)
    saved = optimizer.state_dict()
    last = len(saved["param_groups"]) - 1
    saved["param_groups"][last]["lr"] = -1.0
    with pytest.raises(StateValidationError) as raised:
        optimizer.load_state_dict(saved)
    notes = getattr(raised.value, "__notes__", [])
    assert any("'backup' child" in n and f"this composite's param_groups[{last}..{last}]" in n for n in notes), notes


def _corrupted_halves(optimizer: GefenMuonHybrid, saved: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every corruption class applied to one child's part of the flat composite state dict at a
    time (named ``<class>@<role>``), the rest of the dict left as saved."""
    children = optimizer.child_optimizers()
    halves = children_of_state_dict(
        saved,
        implementations={role: saved["child_implementations"][role] for role in children},
        routing=optimizer.parameter_routing(),
        group_counts={role: len(child.param_groups) for role, child in children.items()},
    )
    variants = []
    for role in ROLES:
        for name, corrupted in corrupted_variants({key: halves[role][key] for key in ("state", "param_groups")}):
            state = {
                pid: entry for other, half in halves.items() if other != role for pid, entry in half["state"].items()
            }
            state.update(corrupted["state"])
            groups = [g for r in ROLES for g in (corrupted["param_groups"] if r == role else halves[r]["param_groups"])]
            variants.append((f"{name}@{role}", {**saved, "state": state, "param_groups": groups}))
    return variants


def _envelope_edits(backup: str) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    def set_key(key: str, value: object) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return lambda state: {**state, key: value}

    return {
        "empty torch layout": lambda state: {"state": {}, "param_groups": []},
        "version-1 nesting": lambda state: {**state, "muon": {}, "backup": {}},
        "muon groups missing": lambda state: {**state, "param_groups": state["param_groups"][1:]},
        "backup half missing": lambda state: {
            **state,
            "child_implementations": {"muon": state["child_implementations"]["muon"]},
        },
        "other backup implementation": lambda state: {
            **state,
            "child_implementations": {
                **state["child_implementations"],
                "backup": "gefen.Gefen" if backup == "adamw" else "gefen.ContractedAdamW",
            },
        },
        "other routing": lambda state: {**state, "routing": [[n, "backup"] for n, _ in state["routing"]]},
        "future format version": set_key("format_version", 99),
        "unknown top-level key": set_key("backup_optimizer", backup),
    }


@pytest.mark.parametrize("backup", BACKUPS)
def test_envelope_problems_are_refused_before_either_half_is_touched(backup: str) -> None:
    _, source = _trained(backup)
    saved = source.state_dict()
    target_model, target = _trained(backup, steps=1)
    subject = (target_model, target)
    for label, edit in _envelope_edits(backup).items():
        before = deep_snapshot(subject)
        with pytest.raises((StateValidationError, ValueError), match=r"."):
            target.load_state_dict(edit(dict(saved)))
        assert snapshot_diff(before, subject) == [], label


def test_a_checkpoint_of_one_backup_is_refused_by_a_hybrid_with_the_other() -> None:
    _, gefen_backed = _trained("gefen")
    model, adamw_backed = _trained("adamw", steps=1)
    subject = (model, adamw_backed)
    before = deep_snapshot(subject)
    with pytest.raises(StateValidationError, match=r"gefen\.Gefen"):
        adamw_backed.load_state_dict(gefen_backed.state_dict())
    assert snapshot_diff(before, subject) == []


def test_a_hybrid_with_one_half_round_trips_and_refuses_a_two_half_checkpoint() -> None:
    model = seeded(TinyLlama)
    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    muon_only = GefenMuonHybrid(matrices, [], lr=3e-3)
    train(model, muon_only, 2)
    muon_only.load_state_dict(_round_trip(muon_only.state_dict()))
    _, both = _trained("gefen")
    before = deep_snapshot(muon_only)
    with pytest.raises(StateValidationError):
        muon_only.load_state_dict(both.state_dict())
    assert snapshot_diff(before, muon_only) == []


@pytest.mark.parametrize("reader", ["gefen", "muon"])
def test_a_hybrid_checkpoint_loaded_into_one_optimizer_is_named_as_the_composites(reader: str) -> None:
    """The refusal named the format of the envelope's first group, one child's (loading a
    hybrid checkpoint into Gefen said it was a GefenMuon one)."""
    from gefen_core import Gefen, GefenMuon

    model, hybrid = _trained("gefen", steps=1)
    saved = hybrid.state_dict()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    single = Gefen(model.parameters()) if reader == "gefen" else GefenMuon(matrices)
    with pytest.raises(StateValidationError, match=r"the checkpoint is a 'gefen\.composite_native_state' checkpoint"):
        single.load_state_dict(saved)

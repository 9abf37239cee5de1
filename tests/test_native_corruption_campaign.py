"""Corruption campaigns over the ``torch.save`` writers: the native state dict
(``torch.save(optimizer.state_dict())``) and the portable document
(``torch.save(export_portable_state(...).materialize())``) (issue 19).

Every trial flips one bit of the saved file (random offsets, plus one bit inside every stored
state tensor's bytes), then reads it with ``torch.load(weights_only=True)`` and loads it into
a fresh optimizer. A hostile pickle in place of the file must be refused by the reader
without running. Each trial must end one of three ways: torch's reader refuses the file,
the optimizer refuses the state dict and is left unchanged (deep snapshot), or the load
restores exactly what was saved (a flip in bytes nothing reads). A load that changes the
state silently fails the campaign. Group hyperparameters (``lr``, ``betas``, ...) are outside
the digest by design (users edit them in checkpoints; ``gefen_core.native_records``): a flip
there loads the flipped value and is counted as ``hyperparameter``, with everything else
exact. ``GEFEN_CAMPAIGN_TRIALS`` sets the random trials per optimizer (default 40; the
exhaustive run uses thousands).

Covered: the native formats that carry ``gefen_state_digest`` (Gefen, GefenMuon, and the
hybrid with a Gefen backup, whose children carry theirs). ``ContractedAdamW`` writes torch's
own AdamW format, which carries no digest; it is outside this promise.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, hostile_object, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.model import kit_loss, make_kit_model
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_portable import export_portable_state, import_portable_state
from torch import nn

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

Factory = Callable[[nn.Module], torch.optim.Optimizer]
FACTORIES: dict[str, Factory] = {
    "gefen": lambda m: Gefen(m.named_parameters(), lr=1e-2, weight_decay=0.1, fused=False),
    "gefen_muon": lambda m: GefenMuon([(n, p) for n, p in m.named_parameters() if p.ndim == 2], lr=1e-2, fused=False),
    "hybrid_gefen": lambda m: GefenMuonHybrid(m.named_parameters(), lr=1e-2, fused=False),
}
TRIALS = int(os.environ.get("GEFEN_CAMPAIGN_TRIALS", "40"))
SINGLE = CheckpointProcessGroupBinding(ProcessGroupIdentity("single", ("rank:0",)), "rank:0", None, "cpu")
LIMITS = PortableStateLimits()


def test_a_hostile_pickle_in_place_of_a_checkpoint_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    (tmp_path / "optimizer.pt").write_bytes(pickle.dumps(hostile_object(marker)))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert not marker.exists()


def _saved(factory: Factory) -> tuple[dict[str, object], bytes]:
    state = _trained(factory).state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return state, buffer.getvalue()


def _tensor_offsets(state: object, data: bytes) -> list[int]:
    """One offset inside each stored state tensor's bytes (found in the file)."""
    offsets: list[int] = []

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            raw = value.detach().contiguous().view(torch.uint8).numpy().tobytes()
            at = data.find(raw) if len(raw) >= 8 else -1
            if at >= 0:
                offsets.append(at + len(raw) // 2)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)

    visit(state)
    return offsets


def test_every_flipped_bit_of_a_portable_document_is_refused_or_harmless() -> None:
    saved = _trained(FACTORIES["gefen"])
    document = export_portable_state(saved, checkpoint_process_group=SINGLE, transaction_id="save", limits=LIMITS)
    buffer = io.BytesIO()
    torch.save(document.materialize(), buffer)
    data = buffer.getvalue()
    expected = saved.state_dict()
    rng = random.Random(20)
    counts = {"trials": 0, "unreadable": 0, "refused": 0, "unchanged": 0, "exact": 0}
    for trial in range(TRIALS):
        mutated = bytearray(data)
        mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        counts["trials"] += 1
        try:
            loaded = torch.load(io.BytesIO(bytes(mutated)), weights_only=True)
        except Exception:
            counts["unreadable"] += 1
            continue
        target = FACTORIES["gefen"](make_kit_model(0))
        before = deep_snapshot(target)
        try:
            import_portable_state(target, loaded, checkpoint_process_group=SINGLE, transaction_id="load", limits=LIMITS)
        except Exception:
            counts["refused"] += 1
            assert snapshot_diff(before, target) == [], f"trial {trial}: a refused import changed the optimizer"
            counts["unchanged"] += 1
            continue
        assert_trees_equal(target.state_dict(), expected, f"portable trial {trial}")
        counts["exact"] += 1
    print(f"portable document corruption campaign: {counts} (hangs: 0)")
    assert counts["trials"] == TRIALS


_COVERED_GROUP_KEYS = ("params", "_gefen_checkpoint_metadata")


def _split_hyperparameters(state_dict: dict[str, object]) -> tuple[dict[str, object], list[object]]:
    """``state_dict`` with each group reduced to what the digest covers (its ids and record
    mirror; a hybrid's children likewise), and the group hyperparameters it left out."""
    covered: dict[str, object] = {}
    hyperparameters: list[object] = []
    for key, value in state_dict.items():
        if key == "param_groups" and isinstance(value, list):
            covered[key] = [{k: v for k, v in g.items() if k in _COVERED_GROUP_KEYS} for g in value]
            hyperparameters.extend(
                sorted((k, repr(v)) for k, v in g.items() if k not in _COVERED_GROUP_KEYS) for g in value
            )
        elif isinstance(value, dict) and "param_groups" in value:
            covered[key], inner = _split_hyperparameters(value)
            hyperparameters.extend(inner)
        else:
            covered[key] = value
    return covered, hyperparameters


def _trained(factory: Factory) -> torch.optim.Optimizer:
    model = make_kit_model(0)
    optimizer = factory(model)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        kit_loss(model, step).backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_flipped_bit_is_refused_or_harmless(name: str) -> None:
    factory = FACTORIES[name]
    saved, data = _saved(factory)
    rng = random.Random(19)
    targeted = _tensor_offsets(saved, data)
    assert len(targeted) >= 4, "the campaign must reach the stored tensors"
    positions = [*targeted, *(rng.randrange(len(data)) for _ in range(TRIALS))]
    counts = {"trials": 0, "unreadable": 0, "refused": 0, "unchanged": 0, "exact": 0, "hyperparameter": 0}
    outcomes: list[str] = []
    target_model = make_kit_model(0)
    target = factory(target_model)
    before = deep_snapshot(target)
    for trial, position in enumerate(positions):
        mutated = bytearray(data)
        mutated[position] ^= 1 << (trial % 8 if trial < len(targeted) else rng.randrange(8))
        counts["trials"] += 1
        try:
            loaded = torch.load(io.BytesIO(bytes(mutated)), weights_only=True)
        except Exception:
            counts["unreadable"] += 1
            outcomes.append("unreadable")
            continue
        try:
            target.load_state_dict(loaded)
        except Exception:
            counts["refused"] += 1
            assert snapshot_diff(before, target) == [], f"trial {trial}: a refused load changed the optimizer"
            counts["unchanged"] += 1
            outcomes.append("refused")
            continue
        restored, restored_hyperparameters = _split_hyperparameters(target.state_dict())
        expected, saved_hyperparameters = _split_hyperparameters(saved)
        assert_trees_equal(restored, expected, f"trial {trial} (bit at byte {position})")
        outcome = "exact" if restored_hyperparameters == saved_hyperparameters else "hyperparameter"
        counts[outcome] += 1
        outcomes.append(outcome)
        target = factory(make_kit_model(0))  # a fresh target for the next trial
        before = deep_snapshot(target)
    print(f"native corruption campaign [{name}]: {counts} (hangs: 0)")
    assert counts["trials"] == len(positions)
    loaded_targeted = [o for o in outcomes[: len(targeted)] if o in ("exact", "hyperparameter")]
    assert not loaded_targeted, "a flipped bit inside a stored state tensor loaded"

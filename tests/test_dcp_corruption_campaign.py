"""Corruption and hostile-input campaigns over the DCP writers, in one process (issue 19).

For ``GefenDCPState`` and ``save_portable_dcp`` (each with Gefen), every trial damages a copy
of one pristine checkpoint: a flipped bit at a random offset of a random file (``.metadata``
included), a file truncated at a random length, a file deleted, or a file replaced by a
pickle that would create a marker file when unpickled. The load into a fresh optimizer must
be refused with the optimizer unchanged (deep snapshot) or restore exactly the saved state;
the marker must never appear. Counts are printed; ``GEFEN_CAMPAIGN_TRIALS`` sets the random
trials per writer (default 96; thousands for the exhaustive run).
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from gefen import Gefen
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, hostile_object, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_contracts.testing.model import kit_loss, make_kit_model
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_dcp import (
    GefenDCPState,
    GefenFileSystemReader,
    GefenFileSystemWriter,
    GefenLoadPlanner,
    GefenSavePlanner,
    load_portable_dcp,
    save_portable_dcp,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

TRIALS = int(os.environ.get("GEFEN_CAMPAIGN_TRIALS", "96"))
SINGLE = CheckpointProcessGroupBinding(ProcessGroupIdentity("single", ("rank:0",)), "rank:0", None, "cpu")
LIMITS = PortableStateLimits()


def _optimizer() -> Gefen:
    return Gefen(make_kit_model(0).named_parameters(), lr=1e-2, weight_decay=0.1, fused=False)


def _trained() -> Gefen:
    model = make_kit_model(0)
    optimizer = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1, fused=False)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        kit_loss(model, step).backward()
        optimizer.step()
    return optimizer


def _save_native(optimizer: Gefen, path: Path) -> None:
    dcp.save(
        {"optim": GefenDCPState(optimizer)}, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner()
    )


def _load_native(optimizer: Gefen, path: Path) -> None:
    state = {"optim": GefenDCPState(optimizer)}
    dcp.load(state, storage_reader=GefenFileSystemReader(path), planner=GefenLoadPlanner())


def _save_portable(optimizer: Gefen, path: Path) -> None:
    save_portable_dcp(
        optimizer,
        checkpoint_process_group=SINGLE,
        storage_writer=GefenFileSystemWriter(path),
        transaction_id="save",
        limits=LIMITS,
    )


def _load_portable(optimizer: Gefen, path: Path) -> None:
    load_portable_dcp(
        optimizer,
        checkpoint_process_group=SINGLE,
        storage_reader=GefenFileSystemReader(path),
        transaction_id="load",
        limits=LIMITS,
    )


WRITERS: dict[str, tuple[Callable[[Gefen, Path], None], Callable[[Gefen, Path], None]]] = {
    "gefen_dcp_state": (_save_native, _load_native),
    "save_portable_dcp": (_save_portable, _load_portable),
}


def _damage(kind: str, files: list[Path], rng: random.Random, marker: Path) -> str:
    target = files[rng.randrange(len(files))]
    data = bytearray(target.read_bytes())
    if kind == "flip":
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
    elif kind == "truncate":
        target.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif kind == "delete":
        target.unlink()
    else:
        target.write_bytes(pickle.dumps(hostile_object(marker)))
    return f"{kind} {target.name}"


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_damaged_checkpoint_is_refused_or_exact(writer: str, tmp_path: Path) -> None:
    save, load = WRITERS[writer]
    saved = _trained()
    pristine = tmp_path / "pristine"
    save(saved, pristine)
    expected = saved.state_dict()
    files = sorted(p for p in pristine.rglob("*") if p.is_file())
    marker = tmp_path / "marker"
    rng = random.Random(19)
    kinds = ["hostile"] * len(files) + ["delete"] * len(files) + ["truncate", "flip"] * TRIALS
    counts = {"trials": 0, "refused": 0, "unchanged": 0, "exact": 0, "marker_created": 0}
    for trial, kind in enumerate(kinds):
        copy = tmp_path / f"trial{trial}"
        shutil.copytree(pristine, copy)
        copied = sorted(p for p in copy.rglob("*") if p.is_file())
        if kind in ("hostile", "delete"):  # every file once, in order
            copied = [copied[trial % len(files)]]
        what = _damage(kind, copied, rng, marker)
        fresh = _optimizer()
        before = deep_snapshot(fresh)
        counts["trials"] += 1
        try:
            load(fresh, copy)
        except BaseException as exc:  # DCP wraps failures in CheckpointException, a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            counts["refused"] += 1
            assert snapshot_diff(before, fresh) == [], f"{what}: a refused load changed the optimizer"
            counts["unchanged"] += 1
        else:
            assert_trees_equal(fresh.state_dict(), expected, f"{writer}: {what}")
            counts["exact"] += 1
        counts["marker_created"] += int(marker.exists())
        shutil.rmtree(copy)
    print(f"DCP corruption campaign [{writer}]: {counts} (hangs: 0)")
    assert counts["marker_created"] == 0
    assert counts["refused"] >= 2 * len(files)  # every hostile replacement and every deletion

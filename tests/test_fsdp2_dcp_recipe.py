"""torch's optimizer-checkpoint recipe under FSDP2, resharded N -> M ranks (gloo, 127.0.0.1).

``get_optimizer_state_dict`` -> ``dcp.save`` on 2 ranks, then ``get_optimizer_state_dict``
(template) -> ``dcp.load`` -> ``set_optimizer_state_dict`` on 1 and on 3 ranks, nested and
flattened, and torchtitan's FQN-keyed ``optimizer.state_dict()`` with its zero-gradient
initialising step, and ``gefen_dcp.GefenDCPState`` into a fresh optimizer (no initialising
step); and Gefen from 1 and from 3 ranks to 2. The state is shaped like the parameters (Gefen's codes, row-aligned scales,
``v_row`` sharded, ``v_col`` and the codebook replicated), so the gathered state after the load
equals the gathered state at the save bit for bit, and training continues like the
uninterrupted run (same batches; the world size changes only reduction order), far closer
than a run that drops the state. Rank functions: tests/fsdp2_recipe_ranks.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsdp2_recipe_ranks as ranks
import pytest
import torch
from gefen_contracts.testing import GlooWorld
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal

pytestmark = pytest.mark.distributed

#: Relative parameter gap (L2, over all parameters' movement since the save) between the resumed
#: and the uninterrupted run, and the factor by which dropping the state must do worse. Another
#: world size sums the row-sharded columns of ``v_col`` in another order; the last-bit difference
#: enters the preconditioned momentum before it is quantised and flips an occasional codeword
#: (hybrid with a Gefen backup, 2 -> 3: 2.5e-3, against 2.2 for a dropped state).
RESUME_BOUND = 1e-2
DROPPED_FACTOR = 10.0


@pytest.fixture(scope="module")
def world1() -> Iterator[GlooWorld]:
    with GlooWorld(1) as world:
        yield world


def _gap(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(params[n] - reference[n]).reshape(-1) for n in reference]).norm()
    moved = torch.cat([(reference[n] - start[n]).reshape(-1) for n in reference]).norm()
    return float(diff / moved)


def _comparable(state: dict[str, Any], name: str) -> dict[str, Any]:
    """What must survive the reshard bit for bit. Distributed GefenMuon's owner manifest (and so
    its mirrors and layout digest) follows the live world size, so its state entries, codebook
    and step count are compared."""
    if name != "gefen_muon_distributed":
        return state
    return {key: state[key] for key in ("state", "gefen_codebook", "gefen_global_step")}


#: Distributed GefenMuon keeps each matrix's state on its owner: the flattened recipe is refused
#: (below) and GefenDCPState's parameter-shaped state does not apply (README). The AdamW composite
#: executes the composite's claim of torch's recipe on DTensors (its other paths are the
#: hybrids' code with other children).
_ONLY = {"gefen_muon_distributed": ("nested", "fqn_native"), "composite_adamw": ("nested", "flattened")}
CASES = [
    (name, mode)
    for name in sorted(ranks.FACTORIES)
    for mode in ("nested", "flattened", "fqn_native", "gefen_dcp_state")
    if mode in _ONLY.get(name, (mode,))
]


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_the_recipe_reshards_two_ranks_to_one_and_three_bit_exactly(
    tmp_path: Path, world1: GlooWorld, world2: GlooWorld, world3: GlooWorld, name: str, mode: str
) -> None:
    path = str(tmp_path / "ckpt")
    saved = world2.run(ranks.save, name, path, mode)[0]
    checkpoint_weights = world1.run(ranks.checkpoint_params, path)[0]
    for label, world in (("2->1", world1), ("2->3", world3)):
        loaded = world.run(ranks.load, name, path, mode)[0]
        assert loaded["template_step_moved_nothing"], label
        assert_trees_equal(_comparable(saved["state"], name), _comparable(loaded["state"], name), f"{label} state")
        gap = _gap(loaded["params"], saved["params"], checkpoint_weights)
        dropped = _gap(loaded["dropped_params"], saved["params"], checkpoint_weights)
        assert gap <= RESUME_BOUND, f"{label}: resumed run {gap:.2e} away from the uninterrupted one"
        assert dropped >= DROPPED_FACTOR * max(gap, 1e-6), f"{label}: dropping the state gives {dropped:.2e}"


@pytest.mark.parametrize("mode", ["nested", "gefen_dcp_state"])
@pytest.mark.parametrize("source", [1, 3], ids=["1->2", "3->2"])
def test_gefen_reshards_from_one_and_three_ranks_to_two(
    tmp_path: Path, world1: GlooWorld, world2: GlooWorld, world3: GlooWorld, source: int, mode: str
) -> None:
    path = str(tmp_path / "ckpt")
    saving = world1 if source == 1 else world3
    saved = saving.run(ranks.save, "gefen", path, mode)[0]
    checkpoint_weights = world2.run(ranks.checkpoint_params, path)[0]
    loaded = world2.run(ranks.load, "gefen", path, mode)[0]
    assert_trees_equal(saved["state"], loaded["state"], f"{source}->2 state")
    gap = _gap(loaded["params"], saved["params"], checkpoint_weights)
    assert gap <= RESUME_BOUND, f"{source}->2: resumed run {gap:.2e} away from the uninterrupted one"


@pytest.mark.parametrize("source", [2, 1], ids=["2->2", "1->2"])
def test_distributed_muon_state_refuses_the_flattened_recipe(
    tmp_path: Path, world1: GlooWorld, world2: GlooWorld, source: int
) -> None:
    """``sharded_mode="distributed"`` keeps each matrix's state on its owner rank only; torch's
    flattened recipe rebuilds every entry from this rank's live state, so the entries of the
    matrices other ranks own arrive empty. That load is refused naming the recipe (it was blamed
    on the owner manifest, and a one-process checkpoint's on a corrupted digest)."""
    flattened = str(tmp_path / "flattened")
    (world1 if source == 1 else world2).run(ranks.save, "gefen_muon_distributed", flattened, "flattened")
    outcomes = world2.run_outcomes(ranks.load, "gefen_muon_distributed", flattened, "flattened")
    for outcome in outcomes:
        assert not outcome.ok and outcome.error_type == "StateValidationError", outcome
        assert "cannot go through torch's flattened recipe" in outcome.message

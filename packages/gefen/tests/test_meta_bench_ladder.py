"""The quality ladder's instrument: its all-exact rung is AdamW, its all-default rung is Gefen."""

from __future__ import annotations

import pytest
import torch
from gefen.bench.ladder import GEFEN_APPROXIMATIONS, LADDER_RUNGS, Approximations, LadderAdamW
from gefen.bench.optimizers import BACKUP_LADDER_RUNGS, HYBRID_BACKUP_SUBSTRINGS, build_optimizer
from gefen_core import Gefen
from gefen_hybrid import RoutingRules


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 96),
        torch.nn.GELU(),
        torch.nn.Linear(96, 64),
    )


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (8, 16), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 64), ids.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_exact_rung_is_adamw() -> None:
    reference, instrument = _model(), _model()
    adamw = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
    ladder = LadderAdamW(instrument.parameters(), Approximations(), lr=3e-3, weight_decay=0.01)
    _train(reference, adamw, 6)
    _train(instrument, ladder, 6)
    torch.testing.assert_close(_parameters(instrument), _parameters(reference), rtol=1e-5, atol=1e-6)
    assert ladder.state_bytes_per_element() == 8.0  # m and v in fp32


def test_the_gefen_rung_follows_gefen() -> None:
    reference, instrument = _model(), _model()
    gefen = Gefen(list(reference.named_parameters()), lr=3e-3, weight_decay=0.01, fused=False)
    ladder = LadderAdamW(instrument.parameters(), GEFEN_APPROXIMATIONS, lr=3e-3, weight_decay=0.01)
    start = _parameters(reference)
    _train(reference, gefen, 6)
    _train(instrument, ladder, 6)
    moved = (_parameters(reference) - start).norm()
    # Same approximations, different rounding order: a code may flip, the trajectory stays put.
    assert (_parameters(instrument) - _parameters(reference)).norm() < 1e-3 * moved
    assert gefen.codebook is not None and ladder.codebook is not None
    torch.testing.assert_close(ladder.codebook, gefen.codebook)
    for p_ref, p_ins in zip(reference.parameters(), instrument.parameters()):
        assert gefen.state[p_ref]["m_codes"].shape[1] == ladder.state[p_ins]["period"]


@pytest.mark.parametrize("rung", sorted(LADDER_RUNGS))
def test_every_rung_trains(rung: str) -> None:
    model = _model()
    optimizer = build_optimizer(f"ladder-{rung}", list(model.named_parameters()), lr=3e-3, weight_decay=0.01)
    losses = _train(model, optimizer, 8)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_bad_switches_are_refused() -> None:
    with pytest.raises(ValueError, match="factored"):
        Approximations(v_1d="factored")
    with pytest.raises(ValueError, match="refresh_every"):
        Approximations(codebook="relearned")
    with pytest.raises(ValueError, match="block_cap"):
        Approximations(block_cap=-1)


def test_the_backup_ladder_changes_only_the_backup() -> None:
    """``muon-ladder-<rung>``: torch Muon for the hidden matrices, the rung for the rest. With
    the exact rung the backup is AdamW (so the arm follows ``muon-adamw`` closely), and the
    Muon half is the same in every arm (the hidden matrix moves identically whatever the rung)."""
    runs = {}
    for name in ("muon-adamw", "muon-gefen", *(f"muon-ladder-{rung}" for rung in BACKUP_LADDER_RUNGS)):
        model = _model()
        optimizer = build_optimizer(name, list(model.named_parameters()), lr=3e-3, weight_decay=0.01)
        losses = _train(model, optimizer, 1)
        assert all(torch.isfinite(torch.tensor(losses))), name
        runs[name] = model
    rules = RoutingRules(backup_substrings=HYBRID_BACKUP_SUBSTRINGS)
    hidden = [n for n, p in _model().named_parameters() if rules.role_for(n, p) == "muon"]
    assert hidden and len(hidden) < len(list(_model().parameters()))  # both halves hold parameters
    reference = dict(runs["muon-adamw"].named_parameters())
    for name, model in runs.items():
        params = dict(model.named_parameters())
        for key in hidden:
            assert torch.equal(params[key], reference[key]), f"{name}: the Muon half differs ({key})"
    exact = dict(runs["muon-ladder-exact"].named_parameters())
    for key, value in reference.items():
        torch.testing.assert_close(exact[key], value, rtol=1e-5, atol=1e-6)


def test_adam_order_codes_decode_with_the_denominator_they_were_stored_with() -> None:
    """``quantize="preconditioned-adam"``: with exact momentum it is AdamW (Adam's order);
    quantised, its stored codes times the stored denominator are what the update applies."""
    reference, instrument = _model(), _model()
    adamw = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
    exact = LadderAdamW(instrument.parameters(), Approximations(quantize="preconditioned-adam"), lr=3e-3)
    _train(reference, adamw, 6)
    _train(instrument, exact, 6)
    torch.testing.assert_close(_parameters(instrument), _parameters(reference), rtol=1e-5, atol=1e-6)
    model = _model()
    # every matrix factored: this model's are narrower than Gefen's default bound of 128
    rung = LADDER_RUNGS["gefen-adam-order"].but(min_dim_size_to_factor=0)
    quantised = LadderAdamW(model.parameters(), rung, lr=3e-3)
    _train(model, quantised, 3)
    for p in model.parameters():
        state = quantised.state[p]
        assert "codes" in state and state["stored_unit"].shape == state["codes"].shape
    assert quantised.state_bytes_per_element() < 1.5  # the instrument's copy of V is not counted

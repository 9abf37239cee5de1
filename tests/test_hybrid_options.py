"""GefenMuonHybrid's options: what goes to which child, the reference's defaults, validation,
and that the hybrid steps bit-identically to its two children built by hand."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
from gefen import ContractedAdamW, Gefen, GefenMuon, GefenMuonHybrid
from gefen_core.newton_schulz import DEFAULT_COEFFICIENTS
from gefen_hybrid import CompositeOptimizer
from hybrid_models import TinyLlama, seeded, train

LR = 3e-3


def _split(model: TinyLlama) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.nn.Parameter]]]:
    matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [(n, p) for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    return matrices, rest


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.extend(v.clone() for v in optimizer.state[p].values() if isinstance(v, torch.Tensor))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_muon_child_gets_torch_muons_update_with_an_adamw_scale_learning_rate() -> None:
    # Since issue 18 the hybrid's Muon half runs torch Muon's update (5 standard Newton-Schulz
    # steps, no NorMuon): the reference's tuned3 + NorMuon cost 1.0-1.3 % of held-out loss.
    optimizer = GefenMuonHybrid(seeded(TinyLlama), lr=LR)
    group = optimizer.muon.param_groups[0]  # type: ignore[union-attr]
    assert group["ns_schedule"] is None and group["ns_steps"] == 5 and group["ns_coefficients"] == DEFAULT_COEFFICIENTS
    assert group["normuon"] is False and group["adjust_lr_fn"] == "match_rms_adamw"
    assert group["weight_decay"] == 0.0  # the hybrid's default; GefenMuon alone defaults to 0.1
    assert (group["momentum"], group["nesterov"], group["eps"], group["sharded_mode"]) == (0.95, True, 1e-7, "exact")
    assert (group["normuon_beta2"], group["normuon_eps"], group["cautious"], group["batched_ns"]) == (
        0.95,
        1e-8,
        False,
        False,
    )
    backup = optimizer.backup
    assert isinstance(backup, Gefen)
    # Gefen's own defaults (the reference pinned block-shared v, measured worse on matrices).
    assert backup.param_groups[0]["factored_v_2d"] is True
    assert backup.param_groups[0]["force_1d_period_one"] is False
    assert (backup.param_groups[0]["betas"], backup.param_groups[0]["eps"]) == ((0.9, 0.999), 1e-8)
    assert optimizer.backup_optimizer == "gefen"
    assert optimizer.optimizer_contract().implementation == "gefen.GefenMuonHybrid"
    assert isinstance(optimizer, CompositeOptimizer)


def test_per_half_rates_decay_groups_and_child_keywords_reach_their_child() -> None:
    optimizer = GefenMuonHybrid(
        seeded(TinyLlama),
        lr=1e-3,
        muon_lr=2e-2,
        weight_decay=0.1,
        backup_weight_decay=0.05,
        no_decay_substrings=("NORM",),
        betas=(0.8, 0.99),
        muon_kwargs={"eps": 1e-6},
        backup_kwargs={"factored_v_2d": True, "codebook_refresh_every": 10},
        fused=False,
    )
    muon, backup = optimizer.muon, optimizer.backup
    assert muon is not None and backup is not None
    assert (muon.param_groups[0]["lr"], muon.param_groups[0]["weight_decay"], muon.param_groups[0]["eps"]) == (
        2e-2,
        0.1,
        1e-6,
    )
    decayed, exempt = backup.param_groups
    assert decayed["param_names"] == ["model.embed_tokens.weight"] and decayed["weight_decay"] == 0.05
    assert all("norm" in name for name in exempt["param_names"]) and exempt["weight_decay"] == 0.0
    assert decayed["lr"] == exempt["lr"] == 1e-3 and decayed["betas"] == (0.8, 0.99)
    assert decayed["factored_v_2d"] is True
    assert muon._dispatch.fused is False and backup._dispatch.fused is False  # type: ignore[attr-defined]


def test_adamw_backup_takes_torchs_own_flags_through_backup_kwargs() -> None:
    optimizer = GefenMuonHybrid(
        seeded(TinyLlama), lr=LR, backup_optimizer="adamw", backup_kwargs={"fused": True, "amsgrad": True}
    )
    backup = optimizer.backup
    assert isinstance(backup, ContractedAdamW) and optimizer.backup_optimizer == "adamw"
    assert backup.param_groups[0]["fused"] is True and backup.param_groups[0]["amsgrad"] is True
    assert (
        backup.param_groups[0]["param_names"] == sorted(backup.param_groups[0]["param_names"], key=lambda n: n) or True
    )


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"backup_optimizer": "sgd"}, ValueError, "backup_optimizer must be one of"),
        ({"backup_optimizer": "adamw", "backup_1d_period_one": True}, ValueError, "Gefen backup only"),
        ({"backup_optimizer": "adamw", "backup_2d_period_one": True}, ValueError, "Gefen backup only"),
        ({"backup_kwargs": {"lr": 1.0}}, TypeError, "'backup_lr'"),
        ({"backup_kwargs": {"fused": True}}, TypeError, "'fused'"),
        ({"backup_optimizer": "adamw", "backup_kwargs": {"weight_decay": 0.1}}, TypeError, "'backup_weight_decay'"),
        ({"muon_kwargs": {"ns_schedule": "tuned4"}}, TypeError, "'ns_schedule'"),
        ({"muon_kwargs": {"weight_decay": 0.1}}, TypeError, "'muon_weight_decay'"),
        ({"muon_kwargs": [("eps", 1e-6)]}, TypeError, "muon_kwargs must be a mapping"),
        ({"no_decay_substrings": "bias"}, TypeError, "not a single str"),
        ({"backup_substrings": "embed"}, TypeError, "not a single str"),  # was split into 'e', 'm', 'b', ...
        ({"backup_substrings": 5}, TypeError, "not a single str"),
        ({"backup_optimizer": "adamw", "betas": (0.9,)}, ValueError, "betas must be a pair"),
        ({"deterministic": 1}, TypeError, "deterministic must be a bool"),
        ({"capturable": True}, ValueError, "capturable=True is not implemented for GefenMuon"),
        ({"ns_schedule": "tuned9"}, ValueError, "tuned9"),
    ],
)
def test_bad_options_raise_errors_that_name_them(options: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GefenMuonHybrid(seeded(TinyLlama), lr=LR, **options)


def test_no_decay_substrings_are_checked_when_nothing_goes_to_the_backup() -> None:
    only_matrices = torch.nn.Linear(8, 8, bias=False)
    with pytest.raises(TypeError, match="not a single str"):
        GefenMuonHybrid(only_matrices, lr=LR, no_decay_substrings="bias")


def test_lr_is_required_and_muon_native_scaling_warns() -> None:
    with pytest.raises(TypeError, match="lr"):
        GefenMuonHybrid(seeded(TinyLlama))  # type: ignore[call-arg]
    for adjust in (None, "original", "spectral_unclamped"):
        with pytest.warns(UserWarning, match="mis-scales an AdamW-scale learning rate"):
            GefenMuonHybrid(seeded(TinyLlama), lr=LR, adjust_lr_fn=adjust)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GefenMuonHybrid(seeded(TinyLlama), lr=LR)
        # No Muon half, nothing to mis-scale.
        GefenMuonHybrid([], list(seeded(TinyLlama).named_parameters()), lr=LR, adjust_lr_fn=None)


def test_from_model_works_and_from_factories_points_to_the_composite() -> None:
    model = seeded(TinyLlama)
    assert (
        GefenMuonHybrid.from_model(model, lr=LR).parameter_routing()
        == GefenMuonHybrid(model, lr=LR).parameter_routing()
    )
    with pytest.raises(TypeError, match=r"nn\.Module"):
        GefenMuonHybrid.from_model(list(model.named_parameters()), lr=LR)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"CompositeOptimizer\.from_factories"):
        GefenMuonHybrid.from_factories(model, {})


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_the_hybrid_steps_bit_identically_to_its_children_built_by_hand(backup: str) -> None:
    model, twin = seeded(TinyLlama), seeded(TinyLlama)
    hybrid = GefenMuonHybrid(
        model, lr=LR, backup_optimizer=backup, weight_decay=0.1, backup_weight_decay=0.2, no_decay_substrings=("norm",)
    )
    matrices, rest = _split(twin)  # type: ignore[arg-type]
    decayed = [(n, p) for n, p in rest if "norm" not in n]
    exempt = [(n, p) for n, p in rest if "norm" in n]
    groups: list[dict[str, Any]] = [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]
    muon = GefenMuon(matrices, lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    other: torch.optim.Optimizer
    if backup == "gefen":
        other = Gefen(groups, lr=LR, weight_decay=0.2)  # Gefen's own defaults
    else:
        other = torch.optim.AdamW(groups, lr=LR, weight_decay=0.2)  # torch's own AdamW, not the contracted one
    for step in range(4):
        train(model, hybrid, 1, start=step)
        for optimizer in (muon, other):
            optimizer.zero_grad()
        twin.loss(step).backward()
        muon.step()
        other.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert _same(_state(hybrid.muon), _state(muon))  # type: ignore[arg-type]
    assert _same(_state(hybrid.backup), _state(other))  # type: ignore[arg-type]


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_copies_and_pickles_continue_exactly_like_the_original(backup: str) -> None:
    model = seeded(TinyLlama)
    optimizer = GefenMuonHybrid(model, lr=LR, backup_optimizer=backup)
    train(model, optimizer, 2)
    clone_model, clone = copy.deepcopy((model, optimizer))
    pickled_model, pickled = pickle.loads(pickle.dumps((model, optimizer)))
    assert isinstance(clone, GefenMuonHybrid) and clone.backup_optimizer == backup
    for m, o in ((model, optimizer), (clone_model, clone), (pickled_model, pickled)):
        train(m, o, 2, start=2)
    for other in (clone_model, pickled_model):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert _same(_state(optimizer), _state(clone)) and _same(_state(optimizer), _state(pickled))

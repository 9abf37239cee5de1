"""GefenMuon's native checkpoints: bit-exact resume, atomic staged loads, a golden vector."""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts import StaleTransactionError, StateValidationError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_core import Gefen, GefenMuon
from gefen_core_test_support import edit_mirror, edit_mirrors, mirror_of, single_threaded_torch  # noqa: F401  (autouse fixture)

GOLDEN = Path(__file__).parent / "golden" / "muon_native_state_v7.pt"


def _named(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"attn.weight": (16, 24), "mlp.up": (48, 16), "mlp.down": (16, 48)}
    return [(name, torch.nn.Parameter(torch.randn(*s, generator=generator).to(dtype))) for name, s in shapes.items()]


def _train(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]], start: int, steps: int) -> None:
    for index in range(start, start + steps):
        generator = torch.Generator().manual_seed(100 + index)
        for _, p in named:
            p.grad = (torch.randn(p.shape, generator=generator) + 0.2).to(p.dtype)
        opt.step()


def _roundtrip(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "normuon": {"normuon": True},
    "stochastic_round": {"stochastic_round": True},
    "tuned3_match_rms": {"ns_schedule": "tuned3", "adjust_lr_fn": "match_rms_adamw"},
    "plain_momentum_cautious": {"nesterov": False, "cautious": True},
    "deterministic_batched": {"deterministic": True, "batched_ns": True},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resume_is_bit_exact(name: str) -> None:
    options = {"lr": 1e-2, "fused": False, **CONFIGS[name]}
    straight = _named()
    opt = GefenMuon(straight, **options)
    _train(opt, straight, 0, 4)
    halves = _named()
    first = GefenMuon(halves, **options)
    _train(first, halves, 0, 2)
    saved = _roundtrip(first.state_dict())
    resumed = GefenMuon(halves, **options)
    resumed.load_state_dict(saved)
    _train(resumed, halves, 2, 2)
    for (name_a, a), (_, b) in zip(straight, halves):
        assert torch.equal(a, b), name_a
    assert_trees_equal(opt.state_dict(), resumed.state_dict())


def test_bf16_resume_and_hooks() -> None:
    straight, halves = _named(torch.bfloat16), _named(torch.bfloat16)
    opt = GefenMuon(straight, lr=1e-2, normuon=True)
    _train(opt, straight, 0, 3)
    first = GefenMuon(halves, lr=1e-2, normuon=True)
    _train(first, halves, 0, 1)
    calls: list[str] = []
    first.register_state_dict_pre_hook(lambda _: calls.append("save-pre"))
    saved = _roundtrip(first.state_dict())
    resumed = GefenMuon(halves, lr=1e-2, normuon=True)
    resumed.register_load_state_dict_post_hook(lambda _: calls.append("load-post"))
    reference = _roundtrip(saved)
    resumed.load_state_dict(saved)
    assert_trees_equal(saved, reference, "the caller's dict after load")
    _train(resumed, halves, 1, 2)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(straight, halves)) and calls == ["save-pre", "load-post"]
    assert resumed.state[halves[0][1]]["m_magnitude"].dtype is torch.float32


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    named = _named()
    opt = GefenMuon([{"params": named[:2], "normuon": True}, {"params": named[2:], "lr": 5e-3}], lr=1e-2, fused=False)
    _train(opt, named, 0, 2)
    return _roundtrip(opt.state_dict())


def _state(index: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda sd: sd["state"][index]


def _set(where: Callable[[dict[str, Any]], Any], key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda sd: where(sd).__setitem__(key, value)


def _codebook(mutate: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        sd["gefen_codebook"] = mutate(sd["gefen_codebook"])
        edit_mirrors(sd, codebook=sd["gefen_codebook"])

    return apply


def _no_codebook(sd: dict[str, Any]) -> None:
    sd["gefen_codebook"] = None


BAD: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "period_not_dividing": (_set(_state(0), "m_codes", torch.zeros(1, 7, dtype=torch.uint8)), "holds blocks of 7"),
    "stored_period": (_set(_state(0), "automatic_period", 4), "undeclared keys"),
    "fractional_step": (_set(_state(0), "step", 1.5), "must be an int"),
    "step_beyond_global": (_set(_state(0), "step", 99), "exceeds the global step"),
    "half_normuon": (lambda sd: sd["state"][0].pop("normuon_step"), "missing authoritative fields"),
    "normuon_step_beyond_step": (_set(_state(0), "normuon_step", 5), "exceeds step"),
    "normuon_rows": (_set(_state(0), "normuon_v", torch.zeros(3, 1)), r"shape \(16, 1\)"),
    "negative_magnitude": (lambda sd: sd["state"][2]["m_magnitude"].sub_(10.0), ">= 0"),
    "undeclared_key": (_set(_state(2), "momentum_buffer", torch.zeros(16, 48)), "undeclared"),
    "unsorted_codebook": (_codebook(lambda c: c.flip(0)), "sorted"),
    "missing_codebook": (_no_codebook, "float32 tensor of 256 entries"),
    "bad_schedule": (_set(lambda sd: sd["param_groups"][1], "ns_steps", 0), "ns_steps"),
    "bad_mode": (_set(lambda sd: sd["param_groups"][1], "sharded_mode", "fsdp"), "sharded_mode"),
    "missing_option": (lambda sd: sd["param_groups"][0].pop("normuon_eps"), "lacks options"),
    "renamed_parameter": (lambda sd: sd["param_groups"][0]["param_names"].__setitem__(0, "x"), "param_names differ"),
    "owner_manifest_without_distributed": (
        lambda sd: [sd.__setitem__("gefen_muon_owners", {"ownership": "x"})] + [edit_mirrors(sd, gefen_muon_owners=1)],
        "unexpected keys",
    ),
    "mirrors_disagree": (
        lambda sd: edit_mirror(sd["param_groups"][1], global_step=7),
        "disagree on global_step",
    ),
    "deterministic_mismatch": (
        lambda sd: [sd.__setitem__("gefen_deterministic", True)] + [edit_mirrors(sd, deterministic=True)],
        "deterministic=True",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_corrupted_checkpoints_are_refused_without_mutation(name: str, trained: dict[str, Any]) -> None:
    named = _named()
    opt = GefenMuon([{"params": named[:2], "normuon": True}, {"params": named[2:], "lr": 5e-3}], lr=1e-2, fused=False)
    _train(opt, named, 0, 1)
    corrupted = copy.deepcopy(trained)
    apply, message = BAD[name]
    apply(corrupted)
    before = deep_snapshot(opt, *[p for _, p in named])
    with pytest.raises(StateValidationError, match=message):
        opt.load_state_dict(corrupted)
    assert not snapshot_diff(before, opt, *[p for _, p in named])
    opt.load_state_dict(trained)


def test_a_gefen_checkpoint_is_not_a_muon_checkpoint() -> None:
    named = _named()
    gefen = Gefen(named, lr=1e-2)
    _train(gefen, named, 0, 1)
    muon = GefenMuon(named, lr=1e-2)
    with pytest.raises(StateValidationError):
        muon.load_state_dict(_roundtrip(gefen.state_dict()))


def test_staged_loads_are_single_use_and_refuse_stale_commits() -> None:
    named = _named()
    opt = GefenMuon(named, lr=1e-2)
    _train(opt, named, 0, 2)
    saved = _roundtrip(opt.state_dict())
    staged = opt.stage_state_dict(saved)
    _train(opt, named, 2, 1)
    with pytest.raises(StaleTransactionError):
        opt.commit_staged_state_dict(staged)
    fresh = opt.stage_state_dict(saved)
    opt.commit_staged_state_dict(fresh)
    assert opt.global_step == 2
    with pytest.raises(StaleTransactionError):
        opt.commit_staged_state_dict(fresh)


def _golden_scenario() -> dict[str, Any]:
    named = _named()
    opt = GefenMuon(
        [{"params": named[:1], "normuon": True}, {"params": named[1:], "ns_schedule": "tuned3"}],
        lr=1e-2,
        weight_decay=0.05,
        fused=False,
    )
    _train(opt, named, 0, 2)
    return opt.state_dict()


def test_golden_native_state_dict() -> None:
    """The committed vector pins the format (keys, types, dtypes, shapes) and its values.

    Regenerate deliberately with ``GEFEN_REGEN_GOLDEN=1`` when the format version changes.
    """
    produced = _roundtrip(_golden_scenario())
    if os.environ.get("GEFEN_REGEN_GOLDEN") == "1":
        torch.save(produced, GOLDEN)
    golden = torch.load(GOLDEN, weights_only=True)
    assert golden["gefen_format_version"] == 7 and golden["gefen_muon_owners"] is None
    assert mirror_of(golden["param_groups"][0])["format"] == "gefen.muon_native_state"
    assert_trees_equal(produced, golden, "golden muon native state dict")
    named = _named()
    resumed = GefenMuon(
        [{"params": named[:1], "normuon": True}, {"params": named[1:], "ns_schedule": "tuned3"}],
        lr=1e-2,
        weight_decay=0.05,
    )
    resumed.load_state_dict(golden)
    assert resumed.global_step == 2 and set(resumed.state[named[0][1]]) >= {"normuon_v", "normuon_step"}


def test_a_state_saved_for_a_matrix_of_another_shape_with_as_many_elements_is_refused() -> None:
    torch.manual_seed(0)
    wide = torch.nn.Parameter(torch.randn(16, 32))
    opt = GefenMuon([wide], lr=0.02, fused=False)
    wide.grad = torch.randn(16, 32)
    opt.step()
    tall = torch.nn.Parameter(torch.randn(32, 16))
    target = GefenMuon([tall], lr=0.02, fused=False)
    before = deep_snapshot(target, tall)
    # blocks of 32 divide 512 elements, but a (32, 16) matrix's state has blocks of 16: the
    # momentum would be read in another layout at the next step
    with pytest.raises(StateValidationError, match=r"holds blocks of 32, but a \[32, 16\] matrix"):
        target.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert not snapshot_diff(before, deep_snapshot(target, tall))

"""``torch.amp.GradScaler`` around Gefen, GefenMuon and the composite: exact unscaling, an
overflow skipping the whole step, the scaler's optimizer protocol for fp16 gradients passed
through a composite to its children, and no scale left behind by a refused step."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gefen import GefenMuon
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from hybrid_models import (
    OPTIMIZERS,
    TinyLlama,
    build_hybrid,
    seeded,
    single_threaded_torch,  # noqa: F401  (an autouse fixture: one thread per module)
    train,
)
from torch import nn


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_grad_scaler_unscales_exactly_and_an_overflow_skips_the_whole_step(name: str) -> None:
    model, twin = seeded(TinyLlama), seeded(TinyLlama)
    optimizer, reference = OPTIMIZERS[name](model), OPTIMIZERS[name](twin)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(model.loss(step)).backward()
        scaler.step(optimizer)
        scaler.update()
        train(twin, reference, 1, start=step)
    # A power-of-two scale unscales exactly: the scaled run is the unscaled run, bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))

    optimizer.zero_grad()
    scaler.scale(model.loss(3)).backward()
    optimizer.param_groups[-1]["params"][0].grad.reshape(-1)[0] = math.inf  # in the last half that steps
    parameters = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(optimizer.state_dict())
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters()))
    assert _same(state, optimizer.state_dict())  # neither half stepped


def _scaled_fp16_step(model: nn.Module, step: int, scaler: torch.amp.GradScaler) -> None:
    for parameter in model.parameters():
        parameter.grad = None
    scaler.scale(model.loss(step).float()).backward()


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_the_hybrid_takes_the_scalers_protocol_on_fp16_gradients_as_its_halves_do(backup: str) -> None:
    # GradScaler refuses to unscale fp16 gradients itself: Gefen and GefenMuon take its optimizer
    # protocol instead, and so must a hybrid of them (it refused every fp16 step)
    model = seeded(TinyLlama).half()
    twin = copy.deepcopy(model)
    hybrid, control = build_hybrid(model, backup), build_hybrid(twin, backup)
    scaler, control_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2))
    if backup == "adamw":  # ContractedAdamW (unfused) does not take it: refused before either half steps
        _scaled_fp16_step(model, 0, scaler)
        parameters = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=r"unscale FP16 gradients.*'backup'"):
            scaler.step(hybrid)
        assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters()))
        return
    for step in range(3):  # the control steps each half through one scaler, as two optimizers
        _scaled_fp16_step(model, step, scaler)
        scaler.step(hybrid)
        scaler.update()
        _scaled_fp16_step(twin, step, control_scaler)
        for child in control.child_optimizers().values():
            control_scaler.step(child)
        control_scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    _scaled_fp16_step(model, 3, scaler)
    next(iter(hybrid.child_optimizers()["backup"].param_groups[0]["params"])).grad.reshape(-1)[0] = math.inf
    parameters = [p.detach().clone() for p in model.parameters()]
    scaler.step(hybrid)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters()))  # neither half stepped
    assert scaler.get_scale() == 2.0**9


def test_an_overflow_at_the_hybrids_first_step_is_skipped_as_its_halves_skip_it() -> None:
    """A first gradient that is not finite is refused by GefenMuon's preflight, but under the
    scaler's overflow no half steps: the composite skipped its children's preflight too late
    and raised instead of skipping (the default ``init_scale`` overflows fp16 at the first step)."""
    model = seeded(TinyLlama).half()
    hybrid = build_hybrid(model, "gefen")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _scaled_fp16_step(model, 0, scaler)
    next(iter(hybrid.child_optimizers()["muon"].param_groups[0]["params"])).grad.reshape(-1)[0] = math.inf
    parameters = [p.detach().clone() for p in model.parameters()]
    scaler.step(hybrid)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(parameters, model.parameters()))
    assert not any(child.state for child in hybrid.child_optimizers().values())
    assert scaler.get_scale() == 2.0**9
    _scaled_fp16_step(model, 1, scaler)  # and the next, finite, step trains
    scaler.step(hybrid)
    assert not all(torch.equal(a, b) for a, b in zip(parameters, model.parameters()))


Halves = tuple[list[nn.Parameter], list[nn.Parameter], GefenMuon, ContractedAdamW]


def _fp16_muon_fp32_adamw() -> Halves:
    # fp16 matrices (GefenMuon takes the scaler's protocol) and fp32 vectors (unfused AdamW does not)
    torch.manual_seed(0)
    matrices = [nn.Parameter(torch.randn(8, 8).half()) for _ in range(2)]
    vectors = [nn.Parameter(torch.randn(8)) for _ in range(2)]
    named_m = [(f"m{i}", p) for i, p in enumerate(matrices)]
    named_v = [(f"v{i}", p) for i, p in enumerate(vectors)]
    return matrices, vectors, GefenMuon(named_m, lr=1e-2), ContractedAdamW(named_v, lr=1e-2)


def _scaled_gradients(halves: Halves, scaler: torch.amp.GradScaler, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    scale = scaler.scale(torch.ones(())).item()
    for parameter in [*halves[0], *halves[1]]:
        parameter.grad = (torch.randn(parameter.shape, generator=generator) * scale).to(parameter.dtype)


def test_a_child_outside_the_scalers_protocol_is_unscaled_by_the_composite_as_the_scaler_would() -> None:
    # the composite does for the AdamW half what GradScaler does for it as its own optimizer
    mine, control = _fp16_muon_fp32_adamw(), _fp16_muon_fp32_adamw()
    composite = CompositeOptimizer({"muon": mine[2], "backup": mine[3]})
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    for step in range(3):
        _scaled_gradients(mine, scalers[0], step)
        _scaled_gradients(control, scalers[1], step)
        scalers[0].step(composite)
        scalers[1].step(control[2])
        scalers[1].step(control[3])
        for scaler in scalers:
            scaler.update()
    assert all(torch.equal(a, b) for a, b in zip([*mine[0], *mine[1]], [*control[0], *control[1]]))


def test_a_refused_scaled_step_leaves_no_scale_behind_for_the_retry() -> None:
    # GradScaler removes grad_scale/found_inf only after step() returns and multiplies a leftover
    # grad_scale into the next step's: a refused composite step must drop them
    refused, clean = _fp16_muon_fp32_adamw(), _fp16_muon_fp32_adamw()
    optimizers = [CompositeOptimizer({"muon": h[2], "backup": h[3]}) for h in (refused, clean)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8) for _ in range(2)]
    _scaled_gradients(refused, scalers[0], 0)
    refused[3].param_groups[0]["lr"] = None  # the preflight refuses the step, nothing changes
    with pytest.raises(TypeError, match="lr"):
        scalers[0].step(optimizers[0])
    assert not hasattr(optimizers[0], "grad_scale") and not hasattr(optimizers[0], "found_inf")
    refused[3].param_groups[0]["lr"] = 1e-2
    scalers[1].scale(torch.ones(()))  # the clean run's scaler starts where the refused one did
    for halves, optimizer, scaler in zip((refused, clean), optimizers, scalers):
        scaler.update(2.0**8)  # the same scale for both (and a fresh per-optimizer state)
        _scaled_gradients(halves, scaler, 1)
        scaler.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip([*refused[0], *refused[1]], [*clean[0], *clean[1]]))


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("name", ["gefen", "gefen-muon"])
def test_a_lone_optimizer_refusing_a_scaled_step_leaves_no_scale_behind(name: str) -> None:
    # fp16 parameters: Gefen and GefenMuon take the scaler's protocol; a step refused for a bad
    # rate, retried once the rate is mended, must equal a run whose rate was never bad
    from gefen_core import Gefen

    def run(refuse: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 4, bias=False)).half()
        optimizer = (Gefen if name == "gefen" else GefenMuon)(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for step in range(3):
            inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).half()
            optimizer.zero_grad()
            scaler.scale(model(inputs).float().square().mean()).backward()
            if refuse and step == 1:
                optimizer.param_groups[0]["lr"] = -1.0
                with pytest.raises(ValueError, match="learning rate"):
                    scaler.step(optimizer)
                assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
                optimizer.param_groups[0]["lr"] = 1e-2
            scaler.step(optimizer)
            scaler.update()
        return [p.detach() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))

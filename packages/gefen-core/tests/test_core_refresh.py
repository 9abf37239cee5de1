"""``codebook_refresh_every``: relearning the codebook and re-expressing every index, atomically."""

from __future__ import annotations

import gefen_core.gefen_step as gefen_module
import pytest
import torch
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_core import Gefen
from gefen_core.codebook import codebook_from_counts, requantize
from gefen_core.reference_ops import HISTOGRAM_BINS
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(64))]


def _feed(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in params:
        # The gradient's distribution drifts, so a relearned codebook differs.
        p.grad = torch.randn(p.shape, generator=generator) ** (1 + 2 * (step >= 2))


def test_refresh_relearns_at_multiples_and_preserves_decoded_momentum() -> None:
    params = _params()
    opt = Gefen(params, lr=1e-2, codebook_refresh_every=2, fused=False)
    _feed(params, 0)
    opt.step()
    _feed(params, 1)
    opt.step()
    learned = opt.codebook
    assert learned is not None
    indices = {id(p): opt.state[p]["m_codes"].clone() for p in params}
    magnitudes = {id(p): opt.state[p]["m_magnitude"].clone() for p in params}
    recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    original = gefen_module.update_parameters

    def spy(works: list, group: dict, stats: object, **options: object) -> None:
        for work in works:
            state = opt.state[work.param]
            recorded[id(work.param)] = (state["m_codes"].clone(), state["m_magnitude"].clone())
        original(works, group, stats, **options)  # type: ignore[arg-type]

    _feed(params, 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gefen_module, "update_parameters", spy)
        opt.step()  # global step 2: refresh before the update
    refreshed = opt.codebook
    assert refreshed is not None and not torch.equal(refreshed, learned)
    for p in params:
        seen_indices, seen_magnitude = recorded[id(p)]
        assert torch.equal(seen_indices, requantize(indices[id(p)], learned, refreshed))
        assert torch.equal(seen_magnitude, magnitudes[id(p)])  # scales are untouched by a refresh
    _feed(params, 3)
    opt.step()
    assert torch.equal(opt.codebook, refreshed)  # type: ignore[arg-type]


@pytest.mark.parametrize("fused", [False, None], ids=["reference", "kernels"])
def test_a_refresh_over_all_zero_gradients_keeps_the_codebook(fused: bool | None) -> None:
    """From zeros alone a refresh would learn three codewords (-1, about 0, +1) and requantise
    every live momentum into them until the next refresh. It keeps the codebook instead: the
    run equals one that never refreshes, bit for bit."""
    params = _params()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    refreshing = Gefen(params, lr=1e-2, codebook_refresh_every=2, fused=fused)
    plain = Gefen(twins, lr=1e-2, fused=fused)
    for step in range(4):  # global step 2 is a refresh step, and its gradients are all zero
        for group, optimizer in ((params, refreshing), (twins, plain)):
            _feed(group, step)
            if step == 2:
                for p in group:
                    p.grad = torch.zeros_like(p)
            optimizer.step()
    assert torch.equal(refreshing.codebook, plain.codebook)  # type: ignore[arg-type]
    assert len(refreshing.codebook.unique()) > 3  # type: ignore[union-attr]
    for p, twin in zip(params, twins, strict=True):
        assert torch.equal(p, twin)
        for key, value in refreshing.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(plain.state[twin][key])), key


def test_a_histogram_of_zeros_alone_learns_no_codebook() -> None:
    """Every all-zero block lands in zero's bin; any other block puts its maximum in an end bin."""
    zeros = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    zeros[HISTOGRAM_BINS // 2] = 1000
    assert codebook_from_counts(zeros) is None
    with_shape = zeros.clone()
    with_shape[HISTOGRAM_BINS - 1] = 1
    assert codebook_from_counts(with_shape) is not None


def test_refresh_stages_every_index_before_committing() -> None:
    params = _params()
    opt = Gefen(params, lr=1e-2, codebook_refresh_every=1, fused=False)
    _feed(params, 0)
    opt.step()
    _feed(params, 2)
    calls = {"count": 0}
    original = gefen_module.requantize

    def failing(indices: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        calls["count"] += 1
        if calls["count"] == 2:
            raise RuntimeError("injected failure on the second parameter")
        return original(indices, old, new)

    before = deep_snapshot(opt, *params)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gefen_module, "requantize", failing)
        with pytest.raises(RuntimeError, match="injected"):
            opt.step()
    assert calls["count"] == 2
    assert not snapshot_diff(before, opt, *params)


def test_refresh_keeps_training_on_cpu() -> None:
    params = _params()
    opt = Gefen(params, lr=1e-2, codebook_refresh_every=2, fused=False)
    for step in range(6):
        _feed(params, step)
        opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.codebook is not None and opt.codebook.device.type == "cpu"
    assert all(opt.state[p]["m_codes"].device.type == "cpu" for p in params)


@pytest.mark.parametrize("fused", [False, None])
def test_a_non_finite_gradient_at_a_refresh_is_refused_before_anything_changes(fused: bool | None) -> None:
    """A refresh learns the codebook from every gradient's histogram: a NaN crashed the
    reference's ``bincount`` (an opaque error) and skewed the kernels' counts into a new codebook
    (silently); both paths refuse it now, as the first step refuses a non-finite gradient."""
    from gefen_core import GradientError

    params = _params()
    opt = Gefen(params, lr=1e-2, codebook_refresh_every=2, fused=fused)
    for step in range(2):
        _feed(params, step)
        opt.step()
    _feed(params, 2)
    params[1].grad[3] = float("nan")  # type: ignore[index]
    before = deep_snapshot(opt, *params)
    with pytest.raises(GradientError, match="not finite at a codebook refresh"):
        opt.step()
    assert snapshot_diff(before, opt, *params) == []


@pytest.mark.parametrize("fused", [False, None])
def test_a_non_finite_gradient_is_refused_while_the_codebook_is_unlearned(fused: bool | None) -> None:
    """All-zero first gradients start states but learn no codebook; the next step learns it
    from every gradient, so a NaN there is refused like on a first step (it crashed the
    reference's ``bincount`` and, through the kernels, froze a codebook from skewed counts)."""
    from gefen_core import GradientError

    params = _params()
    opt = Gefen(params, lr=1e-2, fused=fused)
    for param in params:
        param.grad = torch.zeros_like(param)
    opt.step()
    assert opt.codebook is None and all(opt.state[p] for p in params)
    _feed(params, 1)
    params[1].grad[3] = float("nan")  # type: ignore[index]
    before = deep_snapshot(opt, *params)
    with pytest.raises(GradientError, match="while the codebook is unlearned"):
        opt.preflight_step()
    with pytest.raises(GradientError, match="while the codebook is unlearned"):
        opt.step()
    assert snapshot_diff(before, opt, *params) == []


def _staged(
    cls: type[torch.optim.Optimizer], fused: bool | None
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """A model unfrozen in stages: a 1 x 2 gate trained alone for a step, then a 32 x 48 matrix
    added; and a twin that had both from the start (same gradients at the second step)."""
    torch.manual_seed(0)
    gate, matrix = torch.nn.Parameter(torch.randn(1, 2)), torch.nn.Parameter(torch.randn(32, 48))
    staged = cls([gate], lr=1e-2, fused=fused)
    gate.grad = torch.tensor([[0.5, -0.25]])
    staged.step()
    staged.add_param_group({"params": [matrix]})
    twin_gate, twin_matrix = torch.nn.Parameter(gate.detach().clone()), torch.nn.Parameter(matrix.detach().clone())
    twin = cls([twin_gate, twin_matrix], lr=1e-2, fused=fused)
    for g, m in ((gate, matrix), (twin_gate, twin_matrix)):
        generator = torch.Generator().manual_seed(1)
        g.grad, m.grad = torch.randn(1, 2, generator=generator), torch.randn(32, 48, generator=generator)
    staged.step()
    twin.step()
    return staged, twin


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "reference"])
@pytest.mark.parametrize("name", ["gefen", "gefen-muon"])
def test_parameters_outnumbering_those_that_learned_the_codebook_relearn_it(name: str, fused: bool | None) -> None:
    """A codebook learned from one tiny parameter's first gradient kept its three codewords for
    the rest of training (a 40 % worse loss on a small MLP unfrozen in stages). When the
    parameters starting at a step outnumber those holding state, the step relearns it from
    every gradient, as a twin that had them all from the first step learned it; the tiny
    one's momentum is re-expressed in the new codebook."""
    from gefen_core import GefenMuon

    cls = {"gefen": Gefen, "gefen-muon": GefenMuon}[name]
    staged, twin = _staged(cls, fused)
    assert torch.equal(staged.codebook, twin.codebook)  # type: ignore[attr-defined]
    assert staged.codebook.unique().numel() > 200  # type: ignore[attr-defined]


def test_a_parameter_smaller_than_those_holding_state_keeps_the_codebook() -> None:
    torch.manual_seed(0)
    matrix, small = torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.randn(8))
    opt = Gefen([matrix], lr=1e-2)
    matrix.grad = torch.randn(32, 48)
    opt.step()
    learned = opt.codebook
    opt.add_param_group({"params": [small]})
    matrix.grad, small.grad = torch.randn(32, 48), torch.randn(8)
    opt.step()
    assert torch.equal(opt.codebook, learned)  # type: ignore[arg-type]

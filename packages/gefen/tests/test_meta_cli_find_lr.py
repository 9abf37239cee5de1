"""``gefen find-lr``: the ramp, the suggestion rule, stopping, weight restore, and the command end to end."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen.bench.schema import read_report, validate_report
from gefen.cli.main import main
from gefen.find_lr import RangeTestOptions, load_target, lr_range_test, ramp, suggest_lr
from gefen.find_lr.target import TargetError


def _regression_batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 1, generator=generator)
    while True:
        x = torch.randn(32, 6, generator=generator)
        yield x, x @ weight


def _mse(model: torch.nn.Module, batch: object) -> torch.Tensor:
    x, y = batch  # type: ignore[misc]
    return torch.nn.functional.mse_loss(model(x), y)


def regression_target() -> tuple[torch.nn.Module, Iterator[tuple[torch.Tensor, torch.Tensor]], object]:
    """A user target for the command line: linear regression (module-level, importable by name)."""
    torch.manual_seed(0)
    return torch.nn.Linear(6, 1), _regression_batches(), _mse


class _LossModel(torch.nn.Module):
    """Its output is the loss itself (no loss function needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return ((self.weight - batch) ** 2).sum()


def scalar_output_target() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    return _LossModel(), [torch.zeros(3)] * 50


def not_a_model_target() -> tuple[str, list[int]]:
    return "model", [1]


def test_ramp_is_geometric_between_the_ends() -> None:
    rates = ramp(RangeTestOptions(start_lr=1e-4, end_lr=1e-1, num_iter=4))
    assert rates == pytest.approx([1e-4, 1e-3, 1e-2, 1e-1])


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("start_lr", 0.0, "start_lr must be a positive finite number"),
        ("end_lr", 1e-7, "end_lr (1e-07) must exceed start_lr"),
        ("num_iter", 1, "num_iter must be an int >= 2"),
        ("smooth_beta", 1.0, "smooth_beta must be in [0, 1)"),
        ("diverge_factor", 1.0, "diverge_factor must exceed 1"),
    ],
)
def test_options_name_the_bad_field(field: str, value: float, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        RangeTestOptions(**{field: value})  # type: ignore[arg-type]


def test_suggestion_is_the_centre_of_the_steepest_descent() -> None:
    lrs = [10 ** (-6 + i * 0.1) for i in range(51)]  # 1e-6 .. 1e-1
    # flat until 1e-4, a steep drop between 1e-4 and 1e-3, then flat, then a blow-up after 1e-2
    smoothed = [
        5.0 if lr < 1e-4 else 5.0 - 4.0 * (math.log10(lr) + 4) if lr < 1e-3 else 1.0 if lr < 1e-2 else 1.0 + 100 * lr
        for lr in lrs
    ]
    suggested, at_minimum, rule = suggest_lr(lrs, smoothed)
    assert 1e-4 < suggested < 1e-3 and "steepest descent" in rule
    assert 1e-3 <= at_minimum < 1e-2


def test_suggestion_without_a_descent_is_a_tenth_of_the_minimum() -> None:
    lrs = [1e-3, 1e-2, 1e-1]
    suggested, at_minimum, rule = suggest_lr(lrs, [1.0, 2.0, 3.0])
    assert (suggested, at_minimum) == pytest.approx((1e-4, 1e-3)) and "a tenth" in rule
    with pytest.raises(ValueError, match="no finite loss"):
        suggest_lr([1e-3], [math.nan])


def _sgd(named: list[tuple[str, torch.nn.Parameter]], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named], lr=lr)


def test_range_test_restores_weights_and_stops_on_divergence() -> None:
    model, batches, loss_fn = regression_target()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = lr_range_test(
        model,
        batches,
        _sgd,
        loss_fn,
        RangeTestOptions(start_lr=1e-3, end_lr=1e3, num_iter=60),  # type: ignore[arg-type]
    )
    assert result.stopped in {"diverged", "non-finite loss"} and len(result.lrs) < 60
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert result.lrs == tuple(ramp(RangeTestOptions(start_lr=1e-3, end_lr=1e3, num_iter=60))[: len(result.lrs)])
    assert 1e-3 <= result.suggested_lr < 1.0  # SGD on this regression diverges beyond lr ~ 1


def test_range_test_without_restore_trains_and_runs_out_of_batches() -> None:
    model, batches = scalar_output_target()
    options = RangeTestOptions(start_lr=1e-3, end_lr=1e-1, num_iter=100, restore=False)
    result = lr_range_test(model, batches, _sgd, lambda m, b: m(b), options)
    assert result.stopped == "out of batches" and len(result.lrs) == 50
    assert float(model.weight.detach().abs().max()) < 2.0  # trained towards zero, not restored
    assert result.losses[0] == pytest.approx(12.0)


def test_targets_are_loaded_and_checked() -> None:
    target = load_target(f"{__name__}:scalar_output_target")
    assert isinstance(target.model, _LossModel) and float(target.loss_fn(target.model, torch.zeros(3)).detach()) == 12.0
    with pytest.raises(TargetError, match="must be MODULE:FUNCTION"):
        load_target("no_colon")
    with pytest.raises(TargetError, match="cannot load"):
        load_target(f"{__name__}:absent")
    with pytest.raises(TargetError, match=r"expected a torch\.nn\.Module"):
        load_target(f"{__name__}:not_a_model_target")


def test_cli_on_a_user_target_writes_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["find-lr", f"{__name__}:regression_target", "--optimizer", "adamw", "--start-lr", "1e-4", "--end-lr", "10",
         "--steps", "30", "--threads", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    for suffix in ("json", "txt", "png"):
        assert (tmp_path / f"find-lr.{suffix}").stat().st_size > 0
    validate_report(json.loads((tmp_path / "find-lr.json").read_text()))
    report = read_report(tmp_path / "find-lr.json")
    suggested = report.row("lr/suggested", "learning_rate")
    assert suggested.baseline == "lr/min-loss" and 1e-4 <= suggested.value <= 10
    assert report.config["optimizer"] == "adamw" and report.config["num_iter"] == 30
    assert "suggested lr" in capsys.readouterr().out


def test_cli_default_target_is_the_demo_decoder(tmp_path: Path) -> None:
    assert main(["find-lr", "--steps", "3", "--threads", "1", "--out", str(tmp_path)]) == 0
    report = read_report(tmp_path / "find-lr.json")
    assert report.config["target"] == "gefen.find_lr.target:demo_target" and report.config["optimizer"] == "gefen"
    assert len([row for row in report.rows if row.metric == "loss"]) == 3


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fragment in (
        (["find-lr", "nowhere_module:f"], "cannot load nowhere_module:f"),
        (["find-lr", "--start-lr", "1", "--end-lr", "0.5"], "must exceed start_lr"),
        (["find-lr", f"{__name__}:regression_target", "--optimizer", "nope"], "nope"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert fragment in capsys.readouterr().err


def vector_output_target() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """No loss function, and a model whose output is not a scalar loss."""
    return torch.nn.Linear(3, 2), [torch.zeros(3)] * 10


def test_a_target_whose_output_is_no_loss_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Found at the first step, inside the range test: it was a traceback and exit 1."""
    with pytest.raises(SystemExit) as exit_info:
        main(["find-lr", f"{__name__}:vector_output_target", "--steps", "5", "--optimizer", "adamw"])
    assert exit_info.value.code == 2
    assert "must be a scalar loss tensor" in capsys.readouterr().err


def vector_loss_target() -> tuple[torch.nn.Module, list[torch.Tensor], Any]:
    """A target's own loss function that returns one loss per example."""
    return torch.nn.Linear(3, 2), [torch.zeros(3)] * 10, lambda model, batch: model(batch)


def test_a_loss_function_returning_no_scalar_is_a_usage_error_naming_its_shape(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was a ``TypeError`` traceback naming the type ("got Tensor"), not the shape."""
    with pytest.raises(SystemExit) as exit_info:
        main(["find-lr", f"{__name__}:vector_loss_target", "--steps", "5", "--optimizer", "adamw"])
    assert exit_info.value.code == 2
    assert "the loss function must return a one-element tensor, got shape (2,)" in capsys.readouterr().err


def empty_target() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    return _LossModel(), []


class _NegativeLossModel(_LossModel):
    """A loss that is negative and falls (an ELBO-style objective): -20 plus a squared error."""

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return super().forward(batch) - 20.0


def negative_loss_target() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    return _NegativeLossModel(), [torch.zeros(3)] * 40


def test_a_negative_loss_does_not_count_as_divergence() -> None:
    """``current > factor * best`` holds at the first step when ``best < 0``: the test stopped
    there and suggested a rate below its own start."""
    model, batches = negative_loss_target()
    options = RangeTestOptions(start_lr=1e-4, end_lr=1e-2, num_iter=40)
    result = lr_range_test(model, batches, _sgd, lambda m, b: m(b), options)
    assert result.stopped == "completed" and len(result.lrs) == 40
    assert result.suggested_lr >= options.start_lr


def test_no_finite_loss_is_a_usage_error_naming_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["find-lr", f"{__name__}:empty_target", "--steps", "5", "--optimizer", "adamw"])
    assert exit_info.value.code == 2
    assert "no finite loss: the batches ran out before the first step" in capsys.readouterr().err

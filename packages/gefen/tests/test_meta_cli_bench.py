"""The ``gefen`` command line: help everywhere, and one tiny smoke run per command (schema-checked)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gefen.bench.schema import read_report, validate_report
from gefen.cli.main import main


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """In-process training runs use one thread (fast and steady on a shared 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


COMMANDS = [[], ["demo"], ["bench"], ["bench", "memory"], ["bench", "quality"], ["bench", "dp"], ["conformance"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "gefen")
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gefen") and len(out) > 200


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--lr", "adamw"])
    assert exit_info.value.code == 2
    assert "NAME=LR" in capsys.readouterr().err


def _check_files(out: Path, stem: str) -> dict[str, object]:
    for suffix in ("json", "txt", "png"):
        assert (out / f"{stem}.{suffix}").stat().st_size > 0
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document: dict[str, object] = json.loads((out / f"{stem}.json").read_text())
    validate_report(document)
    return document


@pytest.mark.slow
def test_demo_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["demo", "--steps", "4", "--model-size", "tiny", "--batch-size", "4", "--threads", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "gefen" in out and "adamw" in out and "state_bytes_per_param" in out
    _check_files(tmp_path, "demo")
    report = read_report(tmp_path / "demo.json")
    assert report.benchmark == "demo"
    gefen = report.row("gefen", "state_bytes_per_param")
    assert gefen.baseline == "adamw" and gefen.ratio is not None and gefen.ratio < 0.25
    assert report.row("adamw", "peak_rss_over_start").value > 0


@pytest.mark.slow
def test_bench_memory_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "memory",
            "--models",
            "tiny",
            "--optimizers",
            "adamw,gefen",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    document = _check_files(tmp_path, "memory")
    assert printed == document
    report = read_report(tmp_path / "memory.json")
    adamw = report.row("tiny/adamw", "state_bytes_per_param")
    assert 8.0 <= adamw.value < 8.01
    gefen = report.row("tiny/gefen", "state_bytes_per_param")
    assert gefen.baseline == "tiny/adamw" and gefen.value < 2.0
    assert {row.metric for row in report.rows} == {
        "state_bytes_per_param",
        "step_peak_bytes_per_param",
        "first_step_peak_bytes_per_param",
    }


@pytest.mark.slow
def test_bench_quality_smoke(tmp_path: Path) -> None:
    code = main(
        [
            "bench", "quality", "--tasks", "char-tiny", "--optimizers", "adamw,gefen", "--lr-grid", "1e-3,1e-2",
            "--seeds", "2", "--steps", "3", "--workers", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    _check_files(tmp_path, "quality")
    report = read_report(tmp_path / "quality.json")
    loss = report.row("char-tiny/gefen", "test_loss")
    assert loss.baseline == "char-tiny/adamw"
    assert len(loss.detail["per_seed"]) == 2  # type: ignore[arg-type]
    assert set(loss.detail["valid_by_lr"]) == {"0.001", "0.01"}  # type: ignore[arg-type]
    best = report.row("char-tiny/gefen", "best_lr")
    assert best.value in (1e-3, 1e-2) and best.ratio is not None
    assert any("gefen mean test loss" in note for note in report.notes)


@pytest.mark.slow
def test_bench_dp_smoke(tmp_path: Path) -> None:
    code = main(
        ["bench", "dp", "--repeats", "1", "--elements", "65536", "--bruteforce-bins", "256", "--out", str(tmp_path)]
    )
    assert code == 0
    _check_files(tmp_path, "dp")
    report = read_report(tmp_path / "dp.json")
    fast = report.row("full-256/fast", "solve_s")
    assert fast.baseline == "full-256/bruteforce" and fast.ratio is not None
    assert fast.detail["identical_to_bruteforce"] is True
    assert {row.name for row in report.rows} >= {"gaussian-4096/fast", "student-t-4096/fast", "full-4096/fast"}

"""One tiny smoke run of tools/bench_guard.py (no timings are asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_guard_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_guard_tool", ROOT / "tools" / "bench_guard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "guard.json"
    args = ["--tensors", "6", "--numel", "16", "--steps", "2", "--repeats", "1", "--json", str(out)]
    args += ["--collective-ranks", "0"]  # the gloo count is exercised by packages/gefen-core/tests/test_core_scope.py
    assert module.main(args) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "gefen.bench" and report["benchmark"] == "guard"
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["guard/pass"]["unit"] == "us/tensor" and rows["guard/pass"]["value"] > 0
    share = rows["guard/per-step"]
    assert share["baseline"] == "contracted-adamw/step-bound"
    assert share["ratio"] == pytest.approx(share["value"] / rows["contracted-adamw/step-bound"]["value"])
    gefen = rows["gefen/guard-per-step"]
    assert gefen["baseline"] == "gefen/step-bound" and rows["gefen/guard-passes-per-step"]["value"] >= 1
    assert rows["gefen/guard-per-step-with-closure"]["value"] > gefen["value"]  # the closure adds a pass
    out_text = capsys.readouterr().out
    assert "µs per parameter tensor per pass" in out_text and "gefen:" in out_text

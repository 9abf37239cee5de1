"""One tiny smoke run of tools/bench_dp.py (no timings are asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_dp_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_dp_tool", ROOT / "tools" / "bench_dp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "dp.json"
    assert module.main(["--repeats", "1", "--oracle-bins", "260", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [row["name"] for row in report["rows"]]
    assert names == ["dp/full-4096", "dp/gaussian-4096", "dp/bruteforce-260", "dp/divide-and-conquer-260"]
    assert report["rows"][-1]["baseline"] == "dp/bruteforce-260" and report["rows"][-1]["detail"]["identical_codebook"]
    assert "dp/full-4096" in capsys.readouterr().out

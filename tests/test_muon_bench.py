"""One tiny smoke run of tools/bench_muon.py (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_bench_muon_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_muon_tool", ROOT / "tools" / "bench_muon.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "muon.json"
    assert module.main(["--tiny", "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "gefen.bench" and report["schema_version"] == 1 and report["benchmark"] == "muon"
    rows = {(row["name"], row["metric"]): row for row in report["rows"]}
    for schedule in ("standard", "tuned3", "tuned4"):
        step = rows[(f"muon/gefen-{schedule}-reference", "step_time")]
        assert step["baseline"] == "muon/torch-ns5" and step["ratio"] == pytest.approx(
            step["value"] / rows[("muon/torch-ns5", "step_time")]["value"]
        )
        assert rows[(f"ns/gefen-{schedule}", "ns_time")]["baseline"] == "ns/torch-ns5"
        assert rows[(f"ns/gefen-{schedule}@64x256", "orthogonality_error")]["value"] > 0
    assert rows[("muon/torch-ns5", "state_bytes_per_param")]["value"] == 4.0
    assert 1.0 < rows[("muon/gefen-tuned3-reference", "state_bytes_per_param")]["value"] < 1.1
    assert set(report) == {
        "schema",
        "schema_version",
        "benchmark",
        "created_utc",
        "machine",
        "libraries",
        "config",
        "notes",
        "rows",
    }
    assert "muon/gefen-tuned3-reference" in capsys.readouterr().out
    if not torch.cuda.is_available():  # the fp8 device check says it cannot run here and succeeds
        assert module.main(["--device-check"]) == 0
        assert "device check skipped" in capsys.readouterr().out

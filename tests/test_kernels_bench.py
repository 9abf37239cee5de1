"""One tiny smoke run of tools/bench_step.py: every arm runs and the JSON rows are well formed."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_step


def test_the_step_benchmark_runs_tiny_and_writes_ratio_rows(tmp_path: Path) -> None:
    target = tmp_path / "step.json"
    assert bench_step.main(["--tiny", "--threads", "1", "--json", str(target)]) == 0
    report = json.loads(target.read_text())
    assert report["schema"] == "gefen.bench" and report["schema_version"] == 1
    rows = {row["name"]: row for row in report["rows"]}
    for name in (
        "adamw-fused",
        "adamw-default",
        "copy-14B",
        "gefen-reference",
        "gefen-fused",
        "gefenmuon-momentum-fused",
    ):
        assert name in rows, name
    base = rows["adamw-fused"]["value"]
    for row in report["rows"]:
        assert set(row) == {"name", "metric", "value", "unit", "baseline", "ratio", "detail"}
        assert row["metric"] == "step_time" and row["unit"] == "ms" and row["value"] > 0
        if row["name"] != "adamw-fused":
            assert row["baseline"] == "adamw-fused"
            assert math.isclose(row["ratio"], row["value"] / base, rel_tol=1e-9)
    assert report["config"]["kernels"]["cpu_available"] is True

"""One tiny run of ``tools/bench_dcp.py`` (both arms, one rank): the report's shape and ratios."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[3] / "tools" / "bench_dcp.py"


@pytest.mark.slow
def test_bench_dcp_smoke(tmp_path: Path) -> None:
    out = tmp_path / "dcp.json"
    completed = subprocess.run(
        [sys.executable, str(TOOL), "--model", "tiny", "--ranks", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "gefen.bench" and report["schema_version"] == 1 and report["benchmark"] == "dcp"
    rows = {(r["name"], r["metric"]): r for r in report["rows"]}
    metrics = {f"{op}_{kind}" for op in ("save", "async_save", "load") for kind in ("seconds", "peak_bytes_per_param")}
    for arm in ("torch_dcp_adamw", "gefen_dcp"):
        assert {m for (n, m) in rows if n == f"tiny/1ranks/{arm}"} == metrics
    for (name, metric), row in rows.items():
        assert math.isfinite(row["value"])
        assert row["value"] >= 0 or "peak" in metric  # a peak can read slightly negative when memory was freed
        if name.endswith("gefen_dcp"):
            base = rows[(row["baseline"], metric)]
            assert (
                row["ratio"] is None if base["value"] == 0 else math.isclose(row["ratio"], row["value"] / base["value"])
            )
    assert "gefen_dcp" in completed.stdout and "vs baseline" in completed.stdout

"""The shared benchmark schema: building, validating, round-tripping and rendering reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from gefen.bench.schema import (
    SCHEMA_NAME,
    SCHEMA_VERSION,
    BenchmarkRow,
    BenchmarkSchemaError,
    ReportBuilder,
    read_report,
    render_pivot,
    render_table,
    report_to_json,
    validate_report,
    write_report,
)

MACHINE = {"cpu": "test", "cpu_count": 2}
LIBRARIES = {"torch": "2.15.0", "torchao": None}


def _report() -> dict[str, object]:
    builder = ReportBuilder("memory", config={"steps": 3})
    builder.add("m/adamw", "state_bytes_per_param", 8.0, "B/param")
    builder.add(
        "m/gefen", "state_bytes_per_param", 1.016, "B/param", baseline="m/adamw", detail={"by_kind": {"m_codes": 10}}
    )
    builder.add("m/adamw", "step_peak_bytes_per_param", 0.5, "B/param")
    builder.note("a caveat")
    return report_to_json(builder.build(machine=MACHINE, libraries=LIBRARIES))


def test_builder_computes_ratio_against_the_named_baseline() -> None:
    document = _report()
    validate_report(document)
    rows = document["rows"]
    assert isinstance(rows, list)
    gefen = next(row for row in rows if row["name"] == "m/gefen")
    assert gefen["baseline"] == "m/adamw"
    assert gefen["ratio"] == pytest.approx(1.016 / 8.0)
    assert document["schema"] == SCHEMA_NAME and document["schema_version"] == SCHEMA_VERSION


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    document = _report()
    path = tmp_path / "sub" / "memory.json"
    from gefen.bench.schema import report_from_json

    write_report(report_from_json(document), path)
    again = read_report(path)
    assert report_to_json(again) == document
    assert json.loads(path.read_text())["rows"] == document["rows"]


def test_baseline_must_exist_before_it_is_used() -> None:
    builder = ReportBuilder("memory")
    with pytest.raises(BenchmarkSchemaError, match="add the baseline row first"):
        builder.add("m/gefen", "state_bytes_per_param", 1.0, "B/param", baseline="m/adamw")


def test_duplicate_rows_are_rejected() -> None:
    builder = ReportBuilder("memory")
    builder.add("m/adamw", "x", 1.0, "B")
    with pytest.raises(BenchmarkSchemaError, match="duplicate"):
        builder.add("m/adamw", "x", 2.0, "B")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema="other"), "schema must be"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.pop("machine"), "missing field"),
        (lambda d: d.update(extra=1), "unknown field"),
        (lambda d: d.update(created_utc="yesterday"), "ISO-8601"),
        (lambda d: d["rows"][1].update(ratio=0.5), "ratio is 0.5"),
        (lambda d: d["rows"][1].update(baseline="m/nothing"), "has no row"),
        (lambda d: d["rows"][1].update(ratio=None), "ratio is missing"),
        (lambda d: d["rows"][0].update(ratio=1.0), "needs a baseline"),
        (lambda d: d["rows"][0].update(value=math.nan), "finite"),
        (lambda d: d["rows"][0].update(value="8"), "must be a number"),
        (lambda d: d["rows"][0].update(name=""), "must not be empty"),
        (lambda d: d["rows"][0].pop("detail"), "exactly the fields"),
        (lambda d: d["rows"][1]["detail"].update(bad={1, 2}), "JSON-primitive"),
        (lambda d: d["rows"][1].update(unit="B"), "differs from its baseline"),
        (lambda d: d["config"].update(x=math.inf), "finite"),
        (lambda d: d.update(notes="x"), "notes must be a list"),
    ],
)
def test_invalid_documents_name_the_field(mutate: object, message: str) -> None:
    document = json.loads(json.dumps(_report()))
    mutate(document)  # type: ignore[operator]
    with pytest.raises(BenchmarkSchemaError, match=message):
        validate_report(document)


def test_rows_are_frozen_and_validated() -> None:
    row = BenchmarkRow("a", "m", 1, "u")
    assert row.value == 1.0 and isinstance(row.value, float)
    with pytest.raises(AttributeError):
        row.value = 2.0  # type: ignore[misc]
    with pytest.raises(BenchmarkSchemaError, match="must be a number"):
        BenchmarkRow("a", "m", True, "u")


def test_tables_show_every_row_and_ratio() -> None:
    from gefen.bench.schema import report_from_json

    report = report_from_json(_report())
    table = render_table(report)
    assert "m/gefen" in table and "0.127x" in table and "note: a caveat" in table
    lines = table.splitlines()
    # rows of one metric stay together even when added out of order
    metrics = [line.split()[0] for line in lines[3:] if line and not line.startswith("note")]
    assert metrics == ["state_bytes_per_param", "state_bytes_per_param", "step_peak_bytes_per_param"]
    pivot = render_pivot(report, ["state_bytes_per_param", "step_peak_bytes_per_param"])
    gefen_line = next(line for line in pivot.splitlines() if line.startswith("m/gefen"))
    assert "1.016 (0.13x)" in gefen_line and gefen_line.rstrip().endswith("-")


def test_a_zero_baseline_keeps_the_reference_but_has_no_ratio() -> None:
    builder = ReportBuilder("memory")
    builder.add("m/adamw", "step_peak", 0.0, "B/param")
    row = builder.add("m/gefen", "step_peak", 2.0, "B/param", baseline="m/adamw")
    assert row.baseline == "m/adamw" and row.ratio is None
    document = report_to_json(builder.build(machine=MACHINE, libraries=LIBRARIES))
    validate_report(document)
    document["rows"][1]["ratio"] = 1.0  # type: ignore[index]
    with pytest.raises(BenchmarkSchemaError, match="must be null"):
        validate_report(document)


def test_without_matplotlib_a_report_is_written_without_a_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plots are the ``gefen[plots]`` extra: without it JSON and text are written and the hint printed."""
    import io

    from gefen.bench import output
    from gefen.bench.plot import Panel, Series

    builder = ReportBuilder("memory", config={})
    builder.add("m/adamw", "state_bytes_per_param", 8.0, "B/param")
    report = builder.build(machine=MACHINE, libraries=LIBRARIES)
    panels = [Panel("state", "x", "B/param", (Series("adamw", (0,), (8.0,)),))]
    monkeypatch.setattr(output, "plots_available", lambda: False)
    stream = io.StringIO()
    files = output.emit(report, out=tmp_path, stem="memory", panels=panels, stream=stream)
    assert files.plot is None and not (tmp_path / "memory.png").exists()
    assert files.json.exists() and files.table.exists()
    assert "pip install 'gefen[plots]'" in stream.getvalue()


def test_machine_info_records_the_cpu_vector_features() -> None:
    """Two VMs with one CPU model name ran the kernels at different speeds: the features say why."""
    from gefen.bench.machine import VECTOR_FLAGS, machine_info

    flags = machine_info()["cpu_vector_flags"]
    assert isinstance(flags, list) and set(flags) <= set(VECTOR_FLAGS)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        line = next((x for x in cpuinfo.read_text().splitlines() if x.startswith(("flags", "Features"))), "")
        assert flags == [flag for flag in VECTOR_FLAGS if flag in line.split(":", 1)[-1].split()]

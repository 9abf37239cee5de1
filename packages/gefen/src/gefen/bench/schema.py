"""The one JSON schema every ``gefen bench`` sub-command (and ``gefen demo``) emits.

A report is one benchmark run: its name, the schema name and version, when and where it
ran (machine and library versions), the configuration it ran with, free-text notes, and a
flat list of rows. A row is one measurement::

    {"name": "decoder-50m/gefen", "metric": "state_bytes_per_param", "value": 1.012,
     "unit": "B/param", "baseline": "decoder-50m/adamw", "ratio": 0.1265, "detail": {...}}

``baseline`` names another row of the same report with the same metric and unit, and
``ratio`` is ``value / baseline value`` (``null`` exactly when the baseline's value is 0):
comparisons are always against a baseline measured in the same run, never against a
number remembered from elsewhere. ``detail`` carries
JSON-primitive extras (per-seed values, spreads, chosen learning rates).

:func:`validate_report` checks a decoded document completely (types, finiteness,
baseline references, ratios) and raises :class:`BenchmarkSchemaError` naming the field.
:class:`ReportBuilder` is the easy way to write rows with baselines; :func:`render_table`
and :func:`write_report` produce the table and the JSON file.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeAlias

__all__ = [
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "BenchmarkReport",
    "BenchmarkRow",
    "BenchmarkSchemaError",
    "JSONValue",
    "ReportBuilder",
    "read_report",
    "render_pivot",
    "render_table",
    "report_from_json",
    "require_distinct",
    "report_to_json",
    "validate_report",
    "write_report",
]

SCHEMA_NAME = "gefen.bench"
SCHEMA_VERSION = 1

#: Relative tolerance of the ``ratio == value / baseline value`` check.
_RATIO_RTOL = 1e-9

JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None

_TOP_KEYS = frozenset(
    {"schema", "schema_version", "benchmark", "created_utc", "machine", "libraries", "config", "notes", "rows"}
)
_ROW_KEYS = frozenset({"name", "metric", "value", "unit", "baseline", "ratio", "detail"})


class BenchmarkSchemaError(ValueError):
    """A benchmark report does not follow the schema; the message names the field."""


def _freeze_json(value: Any, where: str) -> JSONValue:
    """Check that ``value`` is JSON-primitive (finite floats only) and copy it."""
    if value is None or type(value) in (bool, int, str):
        return value  # type: ignore[no-any-return]
    if type(value) is float:
        if not math.isfinite(value):
            raise BenchmarkSchemaError(f"{where} must be finite, got {value!r}")
        return value
    if isinstance(value, Mapping):
        out: dict[str, JSONValue] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise BenchmarkSchemaError(f"{where} keys must be str, got {type(key).__name__}")
            out[key] = _freeze_json(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_freeze_json(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise BenchmarkSchemaError(f"{where} must be JSON-primitive, got {type(value).__name__}")


def _require_str(value: Any, where: str, *, allow_empty: bool = False) -> str:
    if type(value) is not str:
        raise BenchmarkSchemaError(f"{where} must be a str, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BenchmarkSchemaError(f"{where} must not be empty")
    return value


def _require_number(value: Any, where: str) -> float:
    if type(value) not in (int, float):
        raise BenchmarkSchemaError(f"{where} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise BenchmarkSchemaError(f"{where} must be finite, got {value!r}")
    return number


def _require_mapping(value: Any, where: str) -> dict[str, JSONValue]:
    if not isinstance(value, Mapping):
        raise BenchmarkSchemaError(f"{where} must be an object, got {type(value).__name__}")
    frozen = _freeze_json(value, where)
    assert isinstance(frozen, dict)
    return frozen


@dataclass(frozen=True, slots=True)
class BenchmarkRow:
    """One measurement. ``ratio`` is set only with a ``baseline`` (and left ``None`` when the
    baseline's value is 0); the report checks it against the baseline row."""

    name: str
    metric: str
    value: float
    unit: str
    baseline: str | None = None
    ratio: float | None = None
    detail: Mapping[str, JSONValue] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        _require_str(self.name, "row.name")
        _require_str(self.metric, f"row {self.name!r}.metric")
        _require_str(self.unit, f"row {self.name!r}.unit")
        object.__setattr__(self, "value", _require_number(self.value, f"row {self.name!r}.value"))
        if self.baseline is None and self.ratio is not None:
            raise BenchmarkSchemaError(f"row {self.name!r}: a ratio needs a baseline")
        if self.baseline is not None:
            _require_str(self.baseline, f"row {self.name!r}.baseline")
        if self.ratio is not None:
            object.__setattr__(self, "ratio", _require_number(self.ratio, f"row {self.name!r}.ratio"))
        detail = _require_mapping(self.detail, f"row {self.name!r}.detail")
        object.__setattr__(self, "detail", MappingProxyType(detail))

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "name": self.name,
            "metric": self.metric,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "detail": dict(self.detail),
        }


@dataclass(frozen=True, slots=True)
class BenchmarkReport:
    """One run of one benchmark; construct it with :class:`ReportBuilder` or :func:`report_from_json`."""

    benchmark: str
    rows: tuple[BenchmarkRow, ...]
    machine: Mapping[str, JSONValue]
    libraries: Mapping[str, JSONValue]
    config: Mapping[str, JSONValue]
    notes: tuple[str, ...] = ()
    created_utc: str = ""

    def __post_init__(self) -> None:
        _require_str(self.benchmark, "benchmark")
        object.__setattr__(self, "rows", tuple(self.rows))
        object.__setattr__(self, "notes", tuple(self.notes))
        for key in ("machine", "libraries", "config"):
            object.__setattr__(self, key, MappingProxyType(_require_mapping(getattr(self, key), key)))
        if not self.created_utc:
            stamp = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
            object.__setattr__(self, "created_utc", stamp)
        _check_rows(self.rows)

    def row(self, name: str, metric: str) -> BenchmarkRow:
        """The row with this name and metric (``KeyError`` if absent)."""
        for row in self.rows:
            if row.name == name and row.metric == metric:
                return row
        raise KeyError(f"no row named {name!r} with metric {metric!r} in benchmark {self.benchmark!r}")


def require_distinct(values: Sequence[object], what: str) -> None:
    """Row names are unique, so a list that names rows (models, optimizers, tasks, ranks, arms)
    must not repeat an entry: ``ValueError`` before anything runs, not after all the work."""
    repeated = sorted({str(value) for value in values if values.count(value) > 1})
    if repeated:
        raise ValueError(f"{what} lists {', '.join(repr(value) for value in repeated)} more than once")


def _check_rows(rows: Sequence[BenchmarkRow]) -> None:
    seen: dict[tuple[str, str], BenchmarkRow] = {}
    for row in rows:
        if not isinstance(row, BenchmarkRow):
            raise BenchmarkSchemaError(f"rows must hold BenchmarkRow, got {type(row).__name__}")
        key = (row.name, row.metric)
        if key in seen:
            raise BenchmarkSchemaError(f"rows: duplicate row name {row.name!r} for metric {row.metric!r}")
        seen[key] = row
    for row in rows:
        if row.baseline is None:
            continue
        base = seen.get((row.baseline, row.metric))
        if base is None:
            raise BenchmarkSchemaError(
                f"row {row.name!r}.baseline names {row.baseline!r}, which has no row with metric {row.metric!r}"
            )
        if base.unit != row.unit:
            raise BenchmarkSchemaError(f"row {row.name!r}: unit {row.unit!r} differs from its baseline's {base.unit!r}")
        if base.value == 0.0:
            if row.ratio is not None:
                raise BenchmarkSchemaError(
                    f"row {row.name!r}.ratio must be null: baseline {row.baseline!r} has value 0"
                )
            continue
        expected = row.value / base.value
        if row.ratio is None:
            raise BenchmarkSchemaError(f"row {row.name!r}.ratio is missing (value / baseline value is {expected!r})")
        if not math.isclose(row.ratio, expected, rel_tol=_RATIO_RTOL, abs_tol=1e-15):
            raise BenchmarkSchemaError(
                f"row {row.name!r}.ratio is {row.ratio!r} but value / baseline value is {expected!r}"
            )


class ReportBuilder:
    """Collects rows for one report; ``add(..., baseline=NAME)`` computes the ratio.

    The baseline row (same metric) must have been added first, so a ratio is always taken
    against a value measured in the same run.
    """

    def __init__(self, benchmark: str, *, config: Mapping[str, Any] | None = None) -> None:
        self.benchmark = _require_str(benchmark, "benchmark")
        self._config: dict[str, JSONValue] = _require_mapping(config or {}, "config")
        self._rows: list[BenchmarkRow] = []
        self._index: dict[tuple[str, str], BenchmarkRow] = {}
        self._notes: list[str] = []

    def add(
        self,
        name: str,
        metric: str,
        value: float,
        unit: str,
        *,
        baseline: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> BenchmarkRow:
        """Add a row; with ``baseline`` the ratio to that row (same metric) is filled in
        (left ``None`` when the baseline's value is 0)."""
        ratio: float | None = None
        if baseline is not None:
            base = self._index.get((baseline, metric))
            if base is None:
                raise BenchmarkSchemaError(
                    f"baseline {baseline!r} has no row with metric {metric!r} yet; add the baseline row first"
                )
            ratio = float(value) / base.value if base.value != 0.0 else None
        row = BenchmarkRow(name, metric, value, unit, baseline, ratio, MappingProxyType(dict(detail or {})))
        key = (row.name, row.metric)
        if key in self._index:
            raise BenchmarkSchemaError(f"duplicate row name {name!r} for metric {metric!r}")
        self._rows.append(row)
        self._index[key] = row
        return row

    def note(self, text: str) -> None:
        """Add a free-text note (caveats, what was unavailable and why)."""
        self._notes.append(_require_str(text, "note"))

    def build(
        self, *, machine: Mapping[str, Any] | None = None, libraries: Mapping[str, Any] | None = None
    ) -> BenchmarkReport:
        """The finished report; machine and library versions are collected here unless given."""
        from .machine import library_versions, machine_info

        return BenchmarkReport(
            benchmark=self.benchmark,
            rows=tuple(self._rows),
            machine=machine if machine is not None else machine_info(),
            libraries=libraries if libraries is not None else library_versions(),
            config=self._config,
            notes=tuple(self._notes),
        )


def report_to_json(report: BenchmarkReport) -> dict[str, JSONValue]:
    """The report as a JSON-primitive document (keys in schema order)."""
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "benchmark": report.benchmark,
        "created_utc": report.created_utc,
        "machine": dict(report.machine),
        "libraries": dict(report.libraries),
        "config": dict(report.config),
        "notes": list(report.notes),
        "rows": [row.to_json() for row in report.rows],
    }


def report_from_json(document: Any) -> BenchmarkReport:
    """Validate a decoded document and build the report (:class:`BenchmarkSchemaError` if invalid)."""
    if not isinstance(document, Mapping):
        raise BenchmarkSchemaError(f"a report must be an object, got {type(document).__name__}")
    missing = sorted(_TOP_KEYS - document.keys())
    if missing:
        raise BenchmarkSchemaError(f"report is missing field(s) {', '.join(missing)}")
    unknown = sorted(set(document.keys()) - _TOP_KEYS)
    if unknown:
        raise BenchmarkSchemaError(f"report has unknown field(s) {', '.join(unknown)}")
    if document["schema"] != SCHEMA_NAME:
        raise BenchmarkSchemaError(f"schema must be {SCHEMA_NAME!r}, got {document['schema']!r}")
    version = document["schema_version"]
    if type(version) is not int or version != SCHEMA_VERSION:
        raise BenchmarkSchemaError(f"schema_version must be {SCHEMA_VERSION}, got {version!r}")
    created = _require_str(document["created_utc"], "created_utc")
    try:
        _dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError as exc:
        raise BenchmarkSchemaError(f"created_utc must be an ISO-8601 timestamp, got {created!r}") from exc
    notes = document["notes"]
    if not isinstance(notes, list):
        raise BenchmarkSchemaError(f"notes must be a list, got {type(notes).__name__}")
    raw_rows = document["rows"]
    if not isinstance(raw_rows, list):
        raise BenchmarkSchemaError(f"rows must be a list, got {type(raw_rows).__name__}")
    rows = []
    for index, raw in enumerate(raw_rows):
        if not isinstance(raw, Mapping):
            raise BenchmarkSchemaError(f"rows[{index}] must be an object, got {type(raw).__name__}")
        if set(raw.keys()) != _ROW_KEYS:
            raise BenchmarkSchemaError(f"rows[{index}] must have exactly the fields {', '.join(sorted(_ROW_KEYS))}")
        rows.append(
            BenchmarkRow(
                raw["name"], raw["metric"], raw["value"], raw["unit"], raw["baseline"], raw["ratio"], raw["detail"]
            )
        )
    return BenchmarkReport(
        benchmark=document["benchmark"],
        rows=tuple(rows),
        machine=document["machine"],
        libraries=document["libraries"],
        config=document["config"],
        notes=tuple(_require_str(note, f"notes[{i}]") for i, note in enumerate(notes)),
        created_utc=created,
    )


def validate_report(document: Any) -> None:
    """Raise :class:`BenchmarkSchemaError` unless ``document`` is a valid report."""
    report_from_json(document)


def write_report(report: BenchmarkReport, path: str | Path) -> Path:
    """Write the report as indented JSON (parents created) and return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report_to_json(report), indent=2) + "\n", encoding="utf-8")
    return target


def read_report(path: str | Path) -> BenchmarkReport:
    """Read and validate a report written by :func:`write_report`."""
    return report_from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def _format_number(value: float) -> str:
    if value == 0.0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1e6 or magnitude < 1e-3:
        return f"{value:.3e}"
    if magnitude >= 100:
        return f"{value:,.1f}"
    return f"{value:.5g}"


def render_table(report: BenchmarkReport, *, rows: Iterable[BenchmarkRow] | None = None) -> str:
    """A plain-text table: one line per row, grouped by metric, ratios against the named baseline."""
    selected = list(report.rows if rows is None else rows)
    metric_order: dict[str, int] = {}
    for row in selected:
        metric_order.setdefault(row.metric, len(metric_order))
    selected.sort(key=lambda row: metric_order[row.metric])  # stable: insertion order within a metric
    header = ("metric", "name", "value", "unit", "vs baseline", "ratio")
    lines: list[tuple[str, ...]] = []
    for row in selected:
        lines.append(
            (
                row.metric,
                row.name,
                _format_number(row.value),
                row.unit,
                row.baseline or "",
                "" if row.ratio is None else f"{row.ratio:.3f}x",
            )
        )
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) if lines else len(header[i]) for i in range(6)]
    numeric = {2, 5}

    def fmt(cells: tuple[str, ...]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(cells)
        ).rstrip()

    out = [f"{report.benchmark} ({SCHEMA_NAME} v{SCHEMA_VERSION}, {report.created_utc})", fmt(header)]
    out.append("  ".join("-" * width for width in widths))
    previous_metric = None
    for line in lines:
        if previous_metric is not None and line[0] != previous_metric:
            out.append("")
        out.append(fmt(line))
        previous_metric = line[0]
    out.extend(f"note: {note}" for note in report.notes)
    return "\n".join(out)


def render_pivot(report: BenchmarkReport, metrics: Sequence[str] | None = None, *, show_ratio: bool = True) -> str:
    """A wide table: one line per row name, one column per metric (``value unit (ratio)``)."""
    chosen = list(metrics) if metrics is not None else list(dict.fromkeys(row.metric for row in report.rows))
    names = list(dict.fromkeys(row.name for row in report.rows if row.metric in chosen))
    cells: dict[tuple[str, str], str] = {}
    units: dict[str, str] = {}
    for row in report.rows:
        if row.metric not in chosen:
            continue
        units.setdefault(row.metric, row.unit)
        text = _format_number(row.value)
        if show_ratio and row.ratio is not None:
            text += f" ({row.ratio:.2f}x)"
        cells[(row.name, row.metric)] = text
    header = ["name", *(f"{metric} [{units.get(metric, '')}]" for metric in chosen)]
    body = [[name, *(cells.get((name, metric), "-") for metric in chosen)] for name in names]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def fmt(line: list[str]) -> str:
        return "  ".join(cell.ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(line))

    out = [fmt(header), "  ".join("-" * width for width in widths), *(fmt(line) for line in body)]
    return "\n".join(out)

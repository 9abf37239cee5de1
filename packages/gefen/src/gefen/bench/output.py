"""What every ``gefen bench`` sub-command (and ``gefen demo``) does with its report.

Each writes ``<out>/<stem>.json`` (the shared schema), ``<out>/<stem>.png`` (a plot) and
``<out>/<stem>.txt`` (the table), then prints the table, or the JSON with ``--json``.
A new sub-command calls :func:`add_output_options` on its parser and :func:`emit` at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .plot import PLOTS_HINT, Panel, plots_available, save_panels
from .schema import BenchmarkReport, render_table, report_to_json, write_report

__all__ = ["EmittedFiles", "add_output_options", "emit"]


@dataclass(frozen=True, slots=True)
class EmittedFiles:
    """Paths of the files one report produced."""

    json: Path
    table: Path
    plot: Path | None


def _output_folder(text: str) -> Path:
    """``--out``: made at parse time, and refused when it, or one of its folders, is a file or
    nothing can be written there (the run would fail on writing, after all its work). A file is
    written and removed to know: permissions alone miss a read-only file system, and root."""
    path = Path(text)
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be a folder{where}" if where else f"{text!r} is a file, not a folder"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: nothing can be written there ({exc.strerror})") from None
    return path


def add_output_options(parser: argparse.ArgumentParser, *, default_out: str = "gefen-bench") -> None:
    """``--out DIR`` and ``--json``, with the same meaning on every sub-command."""
    parser.add_argument(
        "--out",
        type=_output_folder,
        default=Path(default_out),
        metavar="DIR",
        help=f"folder for the JSON, PNG and table (default ./{default_out}/)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")


def emit(
    report: BenchmarkReport,
    *,
    out: Path,
    stem: str,
    panels: Sequence[Panel] = (),
    plot_title: str | None = None,
    table: str | None = None,
    as_json: bool = False,
    stream: TextIO | None = None,
) -> EmittedFiles:
    """Write the report's JSON, table and plot (with matplotlib, the ``plots`` extra) under ``out``; print the
    table (or JSON) to ``stream``."""
    text = table if table is not None else render_table(report)
    json_path = write_report(report, out / f"{stem}.json")
    table_path = out / f"{stem}.txt"
    table_path.write_text(text + "\n", encoding="utf-8")
    drawn = bool(panels) and plots_available()
    plot_path = save_panels(out / f"{stem}.png", panels, title=plot_title) if drawn else None
    target = stream if stream is not None else sys.stdout
    if as_json:
        target.write(json.dumps(report_to_json(report), indent=2) + "\n")
    else:
        target.write(text + "\n")
        written = ", ".join(str(p) for p in (json_path, plot_path) if p is not None)
        target.write(f"\nwrote {written}\n")
        if panels and not drawn:
            target.write(f"no plot: matplotlib is not installed ({PLOTS_HINT} for PNG plots)\n")
    target.flush()
    return EmittedFiles(json_path, table_path, plot_path)

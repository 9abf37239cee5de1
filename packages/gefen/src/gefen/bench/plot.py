"""The one plotting helper of the benchmarks: panels of line or bar series saved as a PNG.

It draws with matplotlib's Agg canvas directly (no ``pyplot`` global state, no display
needed), so it works headless and never changes the caller's matplotlib backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .schema import BenchmarkReport

__all__ = ["PLOTS_HINT", "Panel", "Series", "bar_panel", "plots_available", "save_panels"]

#: What to install for PNG plots (matplotlib is the ``plots`` extra of the meta-package).
PLOTS_HINT = "pip install 'gefen[plots]'"


def plots_available() -> bool:
    """Whether matplotlib is installed (the ``gefen[plots]`` extra)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


@dataclass(frozen=True, slots=True)
class Series:
    """One line (or one group of bars): ``x`` and ``y`` of equal length, optional symmetric ``yerr``."""

    label: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    yerr: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "x", tuple(float(v) for v in self.x))
        object.__setattr__(self, "y", tuple(float(v) for v in self.y))
        if len(self.x) != len(self.y):
            raise ValueError(f"series {self.label!r}: x has {len(self.x)} points but y has {len(self.y)}")
        if self.yerr is not None:
            object.__setattr__(self, "yerr", tuple(float(v) for v in self.yerr))
            if len(self.yerr) != len(self.y):
                raise ValueError(f"series {self.label!r}: yerr has {len(self.yerr)} points but y has {len(self.y)}")


@dataclass(frozen=True, slots=True)
class Panel:
    """One subplot.

    ``kind="line"`` draws each series as a line over its ``x``. ``kind="bar"`` draws grouped
    bars: ``categories`` label the groups and ``series.y[i]`` is that series' bar in group
    ``i`` (its ``x`` is ignored); without categories each series is one bar of its own.
    """

    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    kind: Literal["line", "bar"] = "line"
    log_x: bool = False
    log_y: bool = False
    categories: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "series", tuple(self.series))
        object.__setattr__(self, "categories", tuple(self.categories))
        if self.kind not in ("line", "bar"):
            raise ValueError(f"panel {self.title!r}: kind must be 'line' or 'bar', got {self.kind!r}")
        if self.kind == "bar":
            groups = len(self.categories) or 1
            for series in self.series:
                if len(series.y) != groups:
                    raise ValueError(
                        f"panel {self.title!r}: bar series {series.label!r} has {len(series.y)} values for {groups} group(s)"
                    )


def bar_panel(
    report: BenchmarkReport, metric: str, *, title: str | None = None, names: Sequence[str] | None = None
) -> Panel:
    """Bars of ``metric`` for every row (or the rows in ``names``), error bars from ``detail["std"]``."""
    rows = [row for row in report.rows if row.metric == metric and (names is None or row.name in names)]
    if not rows:
        raise ValueError(f"benchmark {report.benchmark!r} has no row with metric {metric!r}")
    series = []
    for row in rows:
        std = row.detail.get("std")
        yerr = (float(std),) if isinstance(std, (int, float)) and not isinstance(std, bool) else None
        series.append(Series(row.name, (0.0,), (row.value,), yerr))
    return Panel(title or metric, "", f"{metric} ({rows[0].unit})", tuple(series), kind="bar")


def _zoom(axes: object, heights: Sequence[float], panel: Panel) -> None:
    """Zoom the y axis in when all bars are close, so their differences stay visible."""
    from matplotlib.axes import Axes

    assert isinstance(axes, Axes)
    finite = [h for h in heights if math.isfinite(h)]
    if panel.log_y or not finite or min(finite) <= 0:
        return
    low, high = min(finite), max(finite)
    if low > 0.5 * high:
        margin = max(high - low, 0.05 * high)
        axes.set_ylim(max(0.0, low - margin), high + 0.5 * margin)


def _draw(axes: object, panel: Panel) -> None:
    from matplotlib.axes import Axes

    assert isinstance(axes, Axes)
    if panel.kind == "line":
        for series in panel.series:
            if series.yerr is not None:
                axes.errorbar(series.x, series.y, yerr=series.yerr, label=series.label, marker="o", capsize=3)
            else:
                axes.plot(series.x, series.y, label=series.label, marker="o" if len(series.x) <= 12 else None)
    elif not panel.categories:
        labels = [series.label for series in panel.series]
        single = [series.y[0] for series in panel.series]
        errors = [series.yerr[0] if series.yerr else 0.0 for series in panel.series]
        positions = list(range(len(labels)))
        axes.bar(positions, single, yerr=errors, capsize=4, color=[f"C{i % 10}" for i in positions])
        axes.set_xticks(positions, labels, rotation=20, ha="right", fontsize=8)
        _zoom(axes, single, panel)
    else:
        width = 0.8 / max(1, len(panel.series))
        heights: list[float] = []
        for index, series in enumerate(panel.series):
            offset = (index - (len(panel.series) - 1) / 2) * width
            centres = [group + offset for group in range(len(panel.categories))]
            spread = list(series.yerr) if series.yerr else None
            axes.bar(centres, series.y, width=width, yerr=spread, capsize=3, label=series.label, color=f"C{index % 10}")
            heights.extend(series.y)
        axes.set_xticks(list(range(len(panel.categories))), list(panel.categories), fontsize=8)
        axes.legend(fontsize=8)
        _zoom(axes, heights, panel)
    if panel.log_x:
        axes.set_xscale("log")
    if panel.log_y:
        axes.set_yscale("log")
    axes.set_title(panel.title, fontsize=10)
    axes.set_xlabel(panel.xlabel)
    axes.set_ylabel(panel.ylabel)
    axes.grid(True, alpha=0.3)
    if panel.kind == "line" and panel.series:
        axes.legend(fontsize=8)


def save_panels(
    path: str | Path, panels: Sequence[Panel], *, title: str | None = None, columns: int | None = None
) -> Path:
    """Draw ``panels`` in a grid and write a PNG to ``path`` (parents created)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        raise ValueError("save_panels needs at least one panel")
    ncols = columns or min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    figure = Figure(figsize=(5.0 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(nrows, ncols, squeeze=False)
    for index, panel in enumerate(panels):
        _draw(grid[index // ncols][index % ncols], panel)
    for index in range(len(panels), nrows * ncols):
        grid[index // ncols][index % ncols].set_visible(False)
    if title:
        figure.suptitle(title)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    return target

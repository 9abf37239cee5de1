"""A plain left-aligned text table, as the CLI prints parameter listings."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header, a rule and one line per row, columns two spaces apart, trailing blanks cut."""
    widths = [max([len(title), *(len(row[i]) for row in rows)]) for i, title in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    return [line(header), "  ".join("-" * width for width in widths), *(line(row) for row in rows)]

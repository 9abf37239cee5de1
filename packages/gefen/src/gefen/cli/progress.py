"""The progress bar every long-running sub-command shows on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(total: int | None, description: str, unit: str) -> Iterator[Callable[[str], None]]:
    """A tqdm bar on stderr; the yielded ``advance(label)`` moves it one step and shows ``label``."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    with tqdm(total=total, desc=description, unit=unit, file=sys.stderr, dynamic_ncols=True) as bar:

        def advance(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        yield advance

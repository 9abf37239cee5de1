"""The shared oracle of refusal checks: raised, and changed nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..snapshot import deep_snapshot, snapshot_diff

__all__ = ["expect_refusal"]


def expect_refusal(
    problems: list[str],
    label: str,
    roots: tuple[Any, ...],
    action: Callable[[], object],
    error: type[BaseException] = Exception,
) -> None:
    """Run ``action``: it must raise ``error`` and leave a deep snapshot of ``roots`` unchanged.

    Each violation is appended to ``problems`` (labelled), so a check reports all of them.
    """
    before = deep_snapshot(*roots)
    try:
        action()
    except error:
        pass
    except Exception as exc:
        problems.append(f"{label}: raised {type(exc).__name__} ({exc}), expected {error.__name__}")
    else:
        problems.append(f"{label}: was accepted")
        return
    diffs = snapshot_diff(before, *roots)
    if diffs:
        problems.append(f"{label}: changed the optimizer although refused: " + "; ".join(diffs[:3]))

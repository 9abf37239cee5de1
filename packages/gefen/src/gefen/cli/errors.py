"""Errors a sub-command's handler raises for bad input (exit status 2, like argparse)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(ValueError):
    """A value the parser accepted but the command cannot use; ``gefen`` prints it and exits 2."""

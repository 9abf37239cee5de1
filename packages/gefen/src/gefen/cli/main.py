"""Entry point of the ``gefen`` command: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, conformance, demo, find_lr, inspect_checkpoint
from .errors import UsageError

__all__ = ["build_parser", "main"]

_COMMANDS = (demo, bench, conformance, inspect_checkpoint, find_lr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gefen",
        description="Gefen: ~1 byte/param optimizers for PyTorch and the convention that makes them shardable.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in _COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status is the command's (2 for a usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.handler(args)
    except UsageError as exc:
        parser.exit(2, f"gefen {args.command}: error: {exc}\n")
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Entry point of the ``gefen`` command: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import bench, conformance, demo

__all__ = ["build_parser", "main"]

_COMMANDS = (demo, bench, conformance)


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
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

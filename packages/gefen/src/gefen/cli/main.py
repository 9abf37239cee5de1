"""Entry point of the ``gefen`` command: one sub-command per module of this package."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import sys
from collections.abc import Sequence

from . import bench, conformance, demo, find_lr, inspect_checkpoint, routing
from .errors import UsageError
from .lazy_parsers import LazySubParsers

__all__ = ["build_parser", "main", "versions"]

_COMMANDS = (demo, bench, conformance, inspect_checkpoint, find_lr, routing)


def versions() -> str:
    """``gefen`` and every ``gefen-*`` distribution it requires, with installed versions, then torch's."""
    import re
    from importlib.metadata import PackageNotFoundError, requires, version

    required = [re.split(r"[\[<>=!~;\s]", spec, maxsplit=1)[0] for spec in requires("gefen") or ()]
    names = ["gefen", *dict.fromkeys(n for n in required if n.startswith("gefen-")), "torch"]
    lines = []
    for name in names:
        try:
            found = version(name)
        except PackageNotFoundError:
            found = "not installed"
        lines.append(f"{name} {found}")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    """``--version``: print :func:`versions` and exit (computed only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print every Gefen package's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(versions())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gefen",
        description="Gefen: ~1 byte/param optimizers for PyTorch and the convention that makes them shardable.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=LazySubParsers)
    for command in _COMMANDS:
        command.register(sub)
    return parser


def _with_flags(message: str, parser: argparse.ArgumentParser | None) -> str:
    """``message`` with the option fields it names (``StepOptions.repeats``, or a field that
    opens it) written as the command's flags (``--repeats``), where the command has one."""
    if parser is None:
        return message
    flags = {action.dest: max(action.option_strings, key=len) for action in parser._actions if action.option_strings}
    message = re.sub(r"\b[A-Z]\w*Options\.(\w+)", lambda match: flags.get(match[1], match[0]), message)
    return re.sub(r"^\w+\b", lambda match: flags.get(match[0], match[0]), message)


#: The most torch threads a command accepts: 4 per CPU (100,000 segfaulted in OpenMP, 20,000
#: failed to create them).
_MAX_THREADS = 4 * (os.cpu_count() or 1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit status is the command's (2 for a usage error, 130 when
    interrupted by Ctrl-C or SIGTERM).

    ``MODULE:FUNCTION`` arguments resolve through ``gefen_contracts.testing.import_attribute``,
    which makes the current directory importable (a module next to the user's script is found
    without ``PYTHONPATH=.``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:  # (building a command's parser imports torch: seconds, in which a Ctrl-C also lands)
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        named = " ".join(itertools.takewhile(lambda word: not word.startswith("-"), words[:2]))
        print(f"gefen{' ' + named if named else ''}: interrupted", file=sys.stderr)
        return 130
    command = " ".join(c for c in (args.command, getattr(args, "benchmark", None)) if c)  # "bench dcp"
    threads = getattr(args, "threads", None)
    if type(threads) is int and threads > _MAX_THREADS:  # OpenMP fails to start them, or segfaults
        parser.exit(
            2,
            f"gefen {command}: error: --threads {threads} is more than {_MAX_THREADS} (4 x this machine's "
            f"{os.cpu_count() or 1} CPUs)\n",
        )
    if argv is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        # as the command (not called in-process): `kill` and `timeout` stop it as Ctrl-C does; the
        # processes it measures in run in a session of their own, and only this one, unwinding, stops them
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result: int = args.handler(args)
    except UsageError as exc:
        parser.exit(2, f"gefen {command}: error: {_with_flags(str(exc), getattr(args, 'command_parser', None))}\n")
    except KeyboardInterrupt:  # Ctrl-C: the measuring processes are stopped with this one
        print(f"gefen {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `gefen inspect --json ... | head`: the reader left, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet
        return 141
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

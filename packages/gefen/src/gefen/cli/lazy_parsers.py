"""Sub-commands whose arguments are added only when the sub-command is chosen.

Most commands read their defaults and choices from modules that import torch (option
dataclasses, model presets, optimizer registries): about 3.5 s before ``gefen --help`` could
print a line. :class:`LazySubParsers` registers each such command with its name and one-line
help only; the function that adds its arguments runs when argparse meets the command's name,
just before it parses the command's own arguments (its ``--help`` included). The parser of
the innermost command chosen is left in the namespace as ``command_parser`` (``gefen`` names
its flags in usage errors).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LazySubParsers"]

AddArguments = Callable[[argparse.ArgumentParser], None]


class LazySubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """``add_subparsers(action=LazySubParsers)``: adds :meth:`add_lazy_parser`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, AddArguments] = {}

    def add_lazy_parser(self, name: str, add_arguments: AddArguments, **kwargs: Any) -> argparse.ArgumentParser:
        """``add_parser(name, **kwargs)``; ``add_arguments(parser)`` runs once, when ``name`` is chosen."""
        parser: argparse.ArgumentParser = self.add_parser(name, **kwargs)
        self._pending[name] = add_arguments
        return parser

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        # values: the command's name, then its arguments; argparse has checked the name already
        name = values[0] if isinstance(values, list) and values else None
        if isinstance(name, str) and name in self._pending:
            self._pending.pop(name)(self._name_parser_map[name])
        if isinstance(name, str) and name in self._name_parser_map:  # (a nested command's comes later, and wins)
            namespace.command_parser = self._name_parser_map[name]
        super().__call__(parser, namespace, values, option_string)

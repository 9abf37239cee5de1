"""The workspace's layering rule, as data and a checker (used by tests/test_layering.py).

A package imports a sibling only through the sibling's public API and only along the
allowed edges. Imports are found in every ``.py`` file of a package (source and its
tests): module-level and function-level ``import`` / ``from ... import`` statements and
``importlib.import_module("...")`` / ``__import__("...")`` calls with literal names.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: distribution directory -> import name
PACKAGES: dict[str, str] = {
    "packages/gefen-contracts": "gefen_contracts",
    "packages/gefen-core": "gefen_core",
    "packages/gefen-kernels": "gefen_kernels",
    "packages/gefen-portable": "gefen_portable",
    "packages/gefen-dcp": "gefen_dcp",
    "packages/gefen-hybrid": "gefen_hybrid",
    "packages/gefen": "gefen",
    "docs/examples/contracted-sgd": "gefen_example_sgd",
}

#: import name -> workspace packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "gefen_contracts": frozenset(),
    "gefen_core": frozenset({"gefen_contracts"}),
    "gefen_kernels": frozenset({"gefen_contracts"}),
    "gefen_portable": frozenset({"gefen_contracts"}),
    "gefen_dcp": frozenset({"gefen_contracts", "gefen_portable"}),
    "gefen_hybrid": frozenset({"gefen_contracts"}),
    "gefen": frozenset(
        {"gefen_contracts", "gefen_core", "gefen_kernels", "gefen_portable", "gefen_dcp", "gefen_hybrid"}
    ),
    "gefen_example_sgd": frozenset({"gefen_contracts"}),
}

#: import name -> submodules siblings may import: the public API its README documents.
#: A submodule is public when the package's README names it as ``package.submodule``;
#: gefen-contracts' extras are listed explicitly as well.
EXPLICIT_PUBLIC: dict[str, frozenset[str]] = {
    "gefen_contracts": frozenset({"testing", "torch_support", "validation"}),
}


def _documented_submodules() -> dict[str, frozenset[str]]:
    found: dict[str, set[str]] = {name: set(EXPLICIT_PUBLIC.get(name, ())) for name in PACKAGES.values()}
    pattern = re.compile(r"\b(gefen_[a-z_]+|gefen)\.([a-z_][a-z0-9_]*)\b")
    for directory, name in PACKAGES.items():
        readme = ROOT / directory / "README.md"
        if readme.exists():
            for package, submodule in pattern.findall(readme.read_text()):
                if package == name:
                    found[name].add(submodule)
    return {name: frozenset(subs) for name, subs in found.items()}


PUBLIC_SUBMODULES: dict[str, frozenset[str]] = _documented_submodules()

#: third-party modules gefen_contracts may import, and where
CONTRACTS_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "torch": ("torch_support", "testing"),
    "pytest": ("testing",),
    "hypothesis": (),
}

WORKSPACE_NAMES = frozenset(PACKAGES.values())


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def imported_modules(source: str) -> Iterator[tuple[int, str]]:
    """``(line, dotted module name)`` for every absolute import in ``source``."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _is_module(package: str, dotted: str) -> bool:
    """Whether ``package.dotted`` names a module/package (not an attribute)."""
    directory = next(d for d, name in PACKAGES.items() if name == package)
    base = ROOT / directory / "src" / package
    path = base.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def check_file(path: Path, owner: str | None) -> list[Violation]:
    rel = str(path.relative_to(ROOT))
    violations: list[Violation] = []
    seen: set[tuple[int, str]] = set()
    for line, module in imported_modules(path.read_text()):
        top, _, rest = module.partition(".")
        if top in WORKSPACE_NAMES and top != owner:
            if owner is not None and top not in ALLOWED[owner]:
                violations.append(Violation(rel, line, f"{owner} must not import {top} (layering rule)"))
                continue
            if rest:
                first = rest.split(".")[0]
                private = _is_module(top, first) and first not in PUBLIC_SUBMODULES.get(top, frozenset())
                if private and (line, f"{top}.{first}") not in seen:
                    seen.add((line, f"{top}.{first}"))
                    violations.append(Violation(rel, line, f"{top}.{first} is not public API of {top}"))
        if owner == "gefen_contracts" and (top in CONTRACTS_THIRD_PARTY or top == "numpy"):
            allowed_dirs = CONTRACTS_THIRD_PARTY.get(top, ())
            parts = path.relative_to(ROOT / "packages/gefen-contracts").parts
            inside = parts[0] == "src" and len(parts) > 3 and parts[2] in allowed_dirs
            if parts[0] == "src" and not inside:
                violations.append(Violation(rel, line, f"gefen_contracts may import {top} only in {allowed_dirs}"))
    return violations


def check_workspace() -> list[Violation]:
    violations: list[Violation] = []
    for directory, name in PACKAGES.items():
        base = ROOT / directory
        for path in sorted(base.rglob("*.py")):
            if ".venv" in path.parts:
                continue
            violations.extend(check_file(path, name))
    for extra in ("tests", "tools"):
        for path in sorted((ROOT / extra).rglob("*.py")):
            violations.extend(check_file(path, None))
    return violations


if __name__ == "__main__":
    found = check_workspace()
    for violation in found:
        print(violation)
    raise SystemExit(1 if found else 0)

"""What ``gefen inspect`` says about a checkpoint: an immutable description and its rendering.

A :class:`CheckpointDescription` names the checkpoint's kind and format with its version, the
implementation that wrote it, its parameters (name, shape, state variant, state bytes), the
facts worth knowing (global step, codebook, world size, digests), what was verified, and
every :class:`Problem` found, each naming *where* (a key, a parameter, a chunk) and *what*
is wrong. Composite checkpoints and DCP folders hold child descriptions. ``ok`` is true only
when neither the description nor any child has a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..text_table import text_table

__all__ = ["CheckpointDescription", "ParameterSummary", "Problem", "format_bytes"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing that is wrong: ``where`` (a key path, parameter or chunk) and ``message``."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass(frozen=True, slots=True)
class ParameterSummary:
    """One parameter: name, (global) shape when known, state variant, state bytes, notes."""

    name: str
    shape: tuple[int, ...] | None
    variant: str
    state_bytes: int
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": None if self.shape is None else list(self.shape),
            "variant": self.variant,
            "state_bytes": self.state_bytes,
            "detail": self.detail,
        }


@dataclass(frozen=True, slots=True)
class CheckpointDescription:
    """A described (and, where the format allows, verified) checkpoint (module docstring)."""

    path: str
    kind: str
    format: str
    format_version: int | None
    implementation: str | None = None
    parameters: tuple[ParameterSummary, ...] = ()
    facts: tuple[tuple[str, str], ...] = ()
    verified: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = ()
    children: tuple[CheckpointDescription, ...] = ()
    file_bytes: int | None = None
    tensor_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``False`` when gefen does not know the format: nothing could be verified (``status``
    #: ``"UNKNOWN FORMAT"``); ``facts`` then say what was recognised.
    recognised: bool = True

    @property
    def ok(self) -> bool:
        """Recognised, verified as far as the format allows, and no problem found (children too)."""
        return self.status == "OK"

    @property
    def status(self) -> str:
        """``"CORRUPT"`` (a problem anywhere), ``"UNKNOWN FORMAT"`` (nothing recognised to verify)
        or ``"OK"``."""
        if self.all_problems():
            return "CORRUPT"
        if not self.recognised or any(child.status == "UNKNOWN FORMAT" for child in self.children):
            return "UNKNOWN FORMAT"
        return "OK"

    def all_problems(self) -> list[Problem]:
        """Problems of this description and every child (children's ``where`` prefixed)."""
        found = list(self.problems)
        for child in self.children:
            found.extend(Problem(f"{child.path}: {p.where}", p.message) for p in child.all_problems())
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "format": self.format,
            "format_version": self.format_version,
            "implementation": self.implementation,
            "ok": self.ok,
            "status": self.status,
            "recognised": self.recognised,
            "file_bytes": self.file_bytes,
            "tensor_bytes": self.tensor_bytes,
            "parameters": [p.to_json() for p in self.parameters],
            "facts": dict(self.facts),
            "verified": list(self.verified),
            "problems": [{"where": p.where, "message": p.message} for p in self.problems],
            "children": [child.to_json() for child in self.children],
        }

    def format_text(self, *, indent: str = "", max_parameters: int = 40) -> str:
        """A readable report: header, facts, a parameter table, verification and problems."""
        version = "" if self.format_version is None else f" v{self.format_version}"
        lines = [f"{indent}{self.path}: {self.kind} ({self.format}{version})"]
        facts: list[tuple[str, str]] = []
        if self.implementation:
            facts.append(("implementation", self.implementation))
        if self.file_bytes is not None:
            facts.append(("size on disk", format_bytes(self.file_bytes)))
        facts.append(("tensor bytes", format_bytes(self.tensor_bytes)))
        if self.parameters or not self.children:
            facts.append(("parameters", str(len(self.parameters))))
        facts.extend(self.facts)
        width = max(len(key) for key, _ in facts)
        lines.extend(f"{indent}  {key.ljust(width)}  {value}" for key, value in facts)
        if self.parameters:
            lines.append("")
            lines.extend(indent + "  " + line for line in _parameter_table(self.parameters, max_parameters))
        for child in self.children:
            lines.append("")
            lines.append(child.format_text(indent=indent + "  ", max_parameters=max_parameters))
        if self.verified:
            lines.append("")
            lines.extend(f"{indent}  verified: {item}" for item in self.verified)
        if self.problems:
            lines.append("")
            lines.extend(f"{indent}  PROBLEM {problem}" for problem in self.problems)
        if not indent:
            lines.append("")
            status = self.status
            if status == "OK":
                lines.append("OK: no problem found")
            elif status == "CORRUPT":
                lines.append(f"CORRUPT: {len(self.all_problems())} problem(s) found")
            else:
                lines.append(
                    "UNKNOWN FORMAT: not a checkpoint gefen can verify (the facts above say what was recognised)"
                )
        return "\n".join(lines)


def _parameter_table(parameters: tuple[ParameterSummary, ...], limit: int) -> list[str]:
    header = ("parameter", "shape", "variant", "state", "detail")
    rows = [
        (
            p.name,
            "?" if p.shape is None else "x".join(str(d) for d in p.shape) or "scalar",
            p.variant,
            format_bytes(p.state_bytes),
            p.detail,
        )
        for p in parameters[:limit]
    ]
    out = text_table(header, rows)
    if len(parameters) > limit:
        out.append(f"... and {len(parameters) - limit} more (--json lists all)")
    return out


def format_bytes(count: int) -> str:
    """``1234567`` -> ``"1.18 MiB (1,234,567 B)"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{count:,} B" if unit == "B" else f"{value:.2f} {unit} ({count:,} B)"
        value /= 1024
    raise AssertionError("unreachable")

"""The conformance kit: executable checks for every claim an optimizer's contract makes.

Importing this package loads no torch (the pytest plugin is registered for every pytest
run and must stay inert); the public names below are resolved lazily.

* :func:`run_conformance` runs every check against a :class:`ConformanceTarget` and returns
  a :class:`ConformanceReport`; a claim the kit cannot execute is ``UNVERIFIED`` and fails
  the run unless waived by name, and a run that executed zero checks fails.
* :func:`deep_snapshot` / :func:`snapshot_diff` are the "changed nothing" oracle.
* :class:`GlooWorld` spawns a reusable gloo process group for multi-process checks.
* Packages contribute checks for the claims they own through the ``gefen.conformance``
  entry-point group (see :class:`ConformanceCheck`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CONFORMANCE_ENTRY_POINT_GROUP",
    "CORRUPTIONS",
    "CheckContext",
    "CheckResult",
    "CheckStatus",
    "ConformanceCheck",
    "ConformanceReport",
    "ConformanceTarget",
    "GlooWorld",
    "RankFailure",
    "Unverifiable",
    "assert_conformant",
    "deep_snapshot",
    "enumerate_claims",
    "load_target",
    "run_conformance",
    "snapshot_diff",
]

_LAZY = {
    "CONFORMANCE_ENTRY_POINT_GROUP": "runner",
    "CORRUPTIONS": "corruption",
    "CheckContext": "context",
    "CheckResult": "report",
    "CheckStatus": "report",
    "ConformanceCheck": "context",
    "ConformanceReport": "report",
    "ConformanceTarget": "target",
    "GlooWorld": "gloo",
    "RankFailure": "gloo",
    "Unverifiable": "context",
    "assert_conformant": "report",
    "deep_snapshot": "snapshot",
    "enumerate_claims": "claims",
    "load_target": "target",
    "run_conformance": "runner",
    "snapshot_diff": "snapshot",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)

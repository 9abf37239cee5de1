"""The conformance kit: executable checks for every claim an optimizer's contract makes.

Importing this package loads no torch (the pytest plugin is registered for every pytest
run and must stay inert); the public names below are resolved lazily.

* :func:`run_conformance` runs every check against a :class:`ConformanceTarget` and returns
  a :class:`ConformanceReport`; a claim the kit cannot execute is ``UNVERIFIED`` and fails
  the run unless waived by name, and a run that executed zero checks fails.
* :func:`deep_snapshot` / :func:`snapshot_diff` are the "changed nothing" oracle.
* :class:`GlooWorld` starts a reusable gloo process group for multi-process checks.
* :func:`replicated_copy_plan` / :func:`flattened_plan` build the ``post_sharding`` requests the
  identity checks use (an adopter's own tests may reuse them), with :func:`install_parameters`,
  :func:`gather_flat` and :func:`scatter_flat_grads` to drive a simulated flattened layout.
* Packages contribute checks for the claims they own through the ``gefen.conformance``
  entry-point group (see :class:`ConformanceCheck`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "CONFORMANCE_ENTRY_POINT_GROUP",
    "CORRUPTIONS",
    "FLAT_GROUP",
    "CheckContext",
    "CheckResult",
    "CheckStatus",
    "ConformanceCheck",
    "ConformanceReport",
    "ConformanceTarget",
    "GlooWorld",
    "RankFailure",
    "ShardingPlan",
    "Unverifiable",
    "assert_conformant",
    "deep_snapshot",
    "enumerate_claims",
    "flat_slices",
    "flattened_plan",
    "gather_flat",
    "hostile_object",
    "install_parameters",
    "import_attribute",
    "load_target",
    "replicated_copy_plan",
    "run_conformance",
    "scatter_flat_grads",
    "snapshot_diff",
]

_LAZY = {
    "CONFORMANCE_ENTRY_POINT_GROUP": "runner",
    "CORRUPTIONS": "corruption",
    "hostile_object": "corruption",
    "FLAT_GROUP": "checks.plans",
    "CheckContext": "context",
    "CheckResult": "report",
    "CheckStatus": "report",
    "ConformanceCheck": "context",
    "ConformanceReport": "report",
    "ConformanceTarget": "target",
    "GlooWorld": "gloo",
    "RankFailure": "gloo",
    "ShardingPlan": "checks.plans",
    "Unverifiable": "context",
    "assert_conformant": "report",
    "deep_snapshot": "snapshot",
    "enumerate_claims": "claims",
    "flat_slices": "checks.plans",
    "flattened_plan": "checks.plans",
    "gather_flat": "checks.plans",
    "install_parameters": "checks.plans",
    "import_attribute": "target",
    "load_target": "target",
    "replicated_copy_plan": "checks.plans",
    "run_conformance": "runner",
    "scatter_flat_grads": "checks.plans",
    "snapshot_diff": "snapshot",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)

"""Run a measurement in a fresh interpreter: ``python -m MODULE SPEC.json RESULT.json``.

Peak memory is a per-process quantity, so every measurement that reports one runs in its
own process. The child's stderr (progress bars, errors) is passed through; its stdout is
discarded; its result comes back as a JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["FreshProcessError", "run_fresh"]


class FreshProcessError(RuntimeError):
    """The child process failed or wrote no result."""


def run_fresh(
    module: str, spec: Mapping[str, Any], *, env: Mapping[str, str] | None = None, label: str = ""
) -> dict[str, Any]:
    """Run ``module`` on ``spec`` in a new interpreter and return the JSON object it wrote."""
    with tempfile.TemporaryDirectory(prefix="gefen-fresh-") as scratch:
        spec_path = Path(scratch) / "spec.json"
        result_path = Path(scratch) / "result.json"
        spec_path.write_text(json.dumps(dict(spec)), encoding="utf-8")
        child_env = dict(os.environ)
        child_env.update(env or {})
        # a session of its own: a terminal's Ctrl-C reaches this process only, which stops
        # the child (subprocess.run kills it on any exception) instead of both printing tracebacks
        completed = subprocess.run(
            [sys.executable, "-m", module, str(spec_path), str(result_path)],
            check=False,
            stdout=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
        )
        if completed.returncode != 0 or not result_path.exists():
            raise FreshProcessError(
                f"{label or module} failed in its own process with exit code {completed.returncode} "
                "(its error is printed above)"
            )
        result: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
    return result

"""Golden vectors of the canonical documents: a document as JSON (tensors spelled out) plus
its canonical digest. Regenerate intentionally with
``GEFEN_REGEN_GOLDEN=1 uv run pytest packages/gefen-hybrid/tests`` after a deliberate format
change (and bump the format version)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts.torch_support import tensor_digest

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("GEFEN_REGEN_GOLDEN") == "1"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_json(value: Any) -> Any:
    """A document as JSON: tensors become ``{"tensor": dtype, "shape": [...], "values": [...]}``."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return {"tensor": dtype, "shape": list(value.shape), "values": value.reshape(-1).tolist()}
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_json(item) for item in value]
    return value


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json`."""
    if isinstance(value, dict) and set(value) == {"tensor", "shape", "values"}:
        return torch.tensor(value["values"], dtype=_DTYPES[value["tensor"]]).reshape(value["shape"])
    if isinstance(value, dict):
        return {key: from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_json(item) for item in value]
    return value


def check_golden(name: str, document: dict[str, Any]) -> dict[str, Any]:
    """Compare ``document`` (JSON form and digest) with ``golden/<name>``; return the golden document."""
    actual = {"digest": tensor_digest(document), "document": to_json(document)}
    path = GOLDEN / name
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
    if not path.exists():
        pytest.fail(f"golden vector {path} is missing; run with GEFEN_REGEN_GOLDEN=1 to create it")
    expected = json.loads(path.read_text())
    assert actual["document"] == expected["document"], f"{name}: the document format drifted from its golden vector"
    assert actual["digest"] == expected["digest"], f"{name}: the document digest drifted from its golden vector"
    return from_json(expected["document"])  # type: ignore[no-any-return]

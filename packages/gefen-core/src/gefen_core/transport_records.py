"""The optimizer-wide records ``Gefen`` and ``GefenMuon`` put into transports, and their checks.

Portable documents (``gefen_portable``):

* ``policy``: ``{"schema_version": 2, "deterministic": bool}``. An import requires the
  target's ``deterministic`` to be the same, as native loads do (the reference adopted the
  source's flag silently);
* ``common``: ``{"global_step": int, "codebook": fp32[256] | None}``, identical on every
  member of the checkpoint group.

Dense-shard checkpoints (``gefen_dcp.GefenDCPState``): ``common`` is
``{"schema_version": 2, "global_step": int, "deterministic": bool}``; the codebook does not
travel (each rank learns its own without a codebook scope, so each learns one on load).

Schema 2 (both records): Gefen's ``momentum`` field is the EMA of the preconditioned gradient
``g / (sqrt(V) + eps)`` (native format v4); under schema 1 it was the EMA of ``g``. The two are
different quantities, so a schema-1 record is refused, not converted. GefenMuon's fields did not
change; its records carry the same version because the records are shared.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gefen_contracts import StateValidationError

from .codebook import validate_codebook

__all__ = [
    "POLICY_SCHEMA_VERSION",
    "check_common",
    "check_policy",
    "portable_common",
    "portable_policy",
]

#: Version of the portable policy and common records.
POLICY_SCHEMA_VERSION = 2
_MAX_STEP = 1 << 53


def portable_policy(deterministic: bool) -> dict[str, Any]:
    return {"schema_version": POLICY_SCHEMA_VERSION, "deterministic": deterministic}


def portable_common(global_step: int, codebook: torch.Tensor | None) -> dict[str, Any]:
    """The common record, with a fresh host copy of the codebook."""
    copy = None if codebook is None else codebook.detach().to("cpu", copy=True)
    return {"global_step": global_step, "codebook": copy}


def _step(value: object, where: str) -> int:
    if type(value) is not int or not 0 <= value < _MAX_STEP:
        raise StateValidationError(f"{where} must be an int in [0, 2**53), got {value!r}")
    return value


def _deterministic(value: object, live: bool, who: str) -> None:
    if type(value) is not bool:
        raise StateValidationError(f"{who}: deterministic must be a bool, got {type(value).__name__}")
    if value != live:
        raise StateValidationError(
            f"{who}: the state was produced with deterministic={value} but this optimizer has deterministic={live}; "
            "construct the optimizer with the state's policy"
        )


def check_policy(policy: Mapping[str, Any], deterministic: bool, who: str) -> None:
    """A portable policy record of this version that keeps ``deterministic``."""
    if set(policy) != {"schema_version", "deterministic"}:
        raise StateValidationError(
            f"{who}: policy must hold exactly schema_version and deterministic, got {sorted(policy)}"
        )
    if type(policy["schema_version"]) is not int or policy["schema_version"] != POLICY_SCHEMA_VERSION:
        raise StateValidationError(
            f"{who}: policy schema_version {policy['schema_version']!r} is not {POLICY_SCHEMA_VERSION}"
        )
    _deterministic(policy["deterministic"], deterministic, who)


def check_common(common: Mapping[str, Any], who: str) -> tuple[int, torch.Tensor | None]:
    """``(global_step, codebook copy)`` of a portable common record."""
    if set(common) != {"global_step", "codebook"}:
        raise StateValidationError(f"{who}: common must hold exactly global_step and codebook, got {sorted(common)}")
    step = _step(common["global_step"], f"{who}: common global_step")
    codebook = common["codebook"]
    if codebook is not None:
        codebook = validate_codebook(codebook, f"{who}: common codebook").clone()
    return step, codebook

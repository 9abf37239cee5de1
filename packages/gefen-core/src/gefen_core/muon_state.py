"""GefenMuon's per-parameter state: its keys, creation, and checks against the live parameter.

A matrix has no state until its first gradient (zero or not). Then it holds the quantized momentum
(the same codec as Gefen's first moment) and, while its group uses NorMuon, the row statistics:

* ``step`` (int, updates so far);
* ``m_codes``: uint8 ``[B, P]`` codeword indices (their width is the block period ``P``) and ``m_magnitude``: fp32 ``[B, 1]`` block
  scales, ``B * P`` the number of elements the state describes;
* ``normuon_v``: fp32 ``[R, 1]`` EMA of the squared row norms over the column count, and
  ``normuon_step`` (int), both or neither.

Which elements the state describes depends on the mode (:mod:`gefen_core.muon_sharding`): the
whole matrix for plain tensors and for ``"exact"`` DTensors (on every rank), the local rows for
``"approx"``, the whole matrix on the owner only for ``"distributed"`` (non-owners keep no
state). That makes the state about ``1 + 4/P`` bytes per element (``+ 4/C`` with NorMuon).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ParameterError
from .param_state import INDICES, MAGNITUDE, STEP, period_of

__all__ = [
    "MUON_KEYS",
    "NORMUON_KEYS",
    "NORMUON_STEP",
    "NORMUON_V",
    "check_muon_state",
    "new_muon_state",
]

NORMUON_V = "normuon_v"
NORMUON_STEP = "normuon_step"

MUON_KEYS = (STEP, INDICES, MAGNITUDE)
NORMUON_KEYS = (NORMUON_V, NORMUON_STEP)


def new_muon_state(numel: int, period: int, device: torch.device) -> dict[str, Any]:
    """Zero momentum state for ``numel`` elements in blocks of ``period`` (codes decode to 0)."""
    if period < 1 or numel % period:
        raise ValueError(f"period {period} does not divide {numel} elements")
    blocks = numel // period
    return {
        STEP: 0,
        INDICES: torch.zeros(blocks, period, dtype=torch.uint8, device=device),
        MAGNITUDE: torch.zeros(blocks, 1, dtype=torch.float32, device=device),
    }


def check_muon_state(state: dict[str, Any], numel: int, where: str) -> None:
    """A live state must still describe ``numel`` elements (``ParameterError`` otherwise)."""
    period = period_of(state)
    indices = state[INDICES]
    if period < 1 or numel % period or tuple(indices.shape) != (numel // period, period):
        raise ParameterError(
            f"{where}: the optimizer state was created for {indices.numel()} elements in blocks of {period}, "
            f"but the parameter now needs {numel}; the parameter was replaced or resized after its first step"
        )

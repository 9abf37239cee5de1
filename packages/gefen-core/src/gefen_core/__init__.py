"""gefen-core: ``Gefen`` (AdamW) and ``GefenMuon`` (Muon) at about one byte of optimizer state
per parameter.

Public API: :class:`Gefen`, :class:`GefenMuon`, their error types, and the documented
building blocks they share (:mod:`gefen_core.periods`, :mod:`gefen_core.exact_dp`,
:mod:`gefen_core.momentum_codec`, :mod:`gefen_core.codebook`, :mod:`gefen_core.ops`,
:mod:`gefen_core.reference_ops`, :mod:`gefen_core.step_scalars`).
"""

from __future__ import annotations

from ._version import __version__
from .contract import IMPLEMENTATION
from .errors import (
    CaptureError,
    GefenOptionError,
    GefenOptionTypeError,
    GradientError,
    ParameterError,
    ShardAgreementError,
)
from .gefen import Gefen
from .muon import GefenMuon

__all__ = [
    "IMPLEMENTATION",
    "CaptureError",
    "Gefen",
    "GefenMuon",
    "GefenOptionError",
    "GefenOptionTypeError",
    "GradientError",
    "ParameterError",
    "ShardAgreementError",
    "__version__",
]

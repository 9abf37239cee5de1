"""gefen-core: ``Gefen``, AdamW at about one byte of optimizer state per parameter.

Public API: :class:`Gefen`, its error types, and the documented building blocks that later
optimizers reuse (:mod:`gefen_core.periods`, :mod:`gefen_core.exact_dp`,
:mod:`gefen_core.momentum_codec`, :mod:`gefen_core.codebook`, :mod:`gefen_core.ops`,
:mod:`gefen_core.reference_ops`, :mod:`gefen_core.step_scalars`).
"""

from __future__ import annotations

from ._version import __version__
from .contract import IMPLEMENTATION
from .errors import CaptureError, GefenOptionError, GefenOptionTypeError, GradientError, ParameterError
from .gefen import Gefen

__all__ = [
    "IMPLEMENTATION",
    "CaptureError",
    "Gefen",
    "GefenOptionError",
    "GefenOptionTypeError",
    "GradientError",
    "ParameterError",
    "__version__",
]

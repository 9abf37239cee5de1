"""Reference adopters for gefen-dcp's tests, conformance self-checks and benchmark.

:class:`Int8MomentumSGD` is a small optimizer that is not Gefen but keeps a compact state
(int8 codes with per-row scales for matrices, DTensors placed like DTensor parameters) and
implements :class:`gefen_contracts.protocols.ParameterShapedState`, so every code path of
:class:`gefen_dcp.GefenDCPState` can be exercised on CPU.
"""

from __future__ import annotations

from .int8_momentum import IMPLEMENTATION, Int8MomentumSGD, conformance_factory

__all__ = ["IMPLEMENTATION", "Int8MomentumSGD", "conformance_factory"]

"""Gefen's specific exception types.

Each subclasses the built-in a torch optimizer user would catch (``ValueError``,
``TypeError``, ``RuntimeError``) and its message names the argument, group, parameter or
state field that was wrong. Checkpoint problems raise
:class:`gefen_contracts.StateValidationError` (a ``ValueError``); a missing kernel raises
:class:`gefen_contracts.KernelUnavailableError`.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "GefenOptionError",
    "GefenOptionTypeError",
    "GradientError",
    "ParameterError",
    "ShardAgreementError",
]


class GefenOptionError(ValueError):
    """A hyperparameter or option has an invalid value, or options are incompatible."""


class GefenOptionTypeError(TypeError):
    """A hyperparameter or option has the wrong type (``bool`` is never a number)."""


class ParameterError(ValueError):
    """A parameter cannot be optimized (complex or integer dtype, unsupported DTensor layout,
    a state that no longer fits the parameter)."""


class GradientError(RuntimeError):
    """A gradient cannot be used: sparse or non-strided layout, complex, or a shape, dtype or
    device different from its parameter's, or non-finite where periods and the codebook are
    learned from it."""


class CaptureError(RuntimeError):
    """A step was captured in a CUDA graph without ``capturable=True``, or needs host work
    (codebook learning, first state of a parameter, refresh) that cannot be captured."""


class ShardAgreementError(RuntimeError):
    """Members of a process group disagree about a step they must take together: which sharded
    parameters have gradients, their names, order, shapes or dtypes, or the gradient scaler's
    state. Every member raises the same message (they all see the same gathered data)."""

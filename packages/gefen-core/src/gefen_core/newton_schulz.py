"""Newton-Schulz orthogonalisation: coefficient schedules and the bf16 iteration.

Muon replaces a momentum matrix ``M`` by an approximation of its orthogonal polar factor
``U V^T`` (``M = U S V^T``). Each Newton-Schulz step with coefficients ``(a, b, c)`` maps
``X -> a X + (b A + c A^2) X`` with ``A = X X^T``, which applies the odd quintic
``p(s) = a s + b s^3 + c s^5`` to every singular value of ``X``. The input is first scaled by
its Frobenius norm (so every singular value is at most 1), and a wide orientation is used
(``rows <= cols``) so the Gram matrix is the smaller one::

    X = bf16(M) ; X = X^T if rows > cols ; X = X / max(||X||_F, eps)    (norm of the bf16 X)
    for (a, b, c) in schedule:  A = X X^T ;  B = b A + c A A ;  X = a X + B X
    return X^T if transposed else X                                    (bf16)

With the ``"standard"`` schedule this is op for op the iteration of ``torch.optim.Muon``
(tested bit for bit). Schedules (``NS_SCHEDULES``; coefficients exactly the reference
implementation's):

* ``"standard"``: the classic quintic ``(3.4445, -4.7750, 2.0315)`` repeated ``ns_steps``
  times (5 by default);
* ``"tuned3"``: three fitted steps, robust on singular values in ``[1e-2, 1]`` with peak
  ``|p| <= 1.15``, slightly worse than NS5 on the smallest singular values; about 3/5 of
  NS5's cost (the iteration is GEMM-bound);
* ``"tuned4"``: four fitted steps, robust on ``[1e-2, 1]`` with peak ``|p| <= 1.01``, closer
  to orthogonal than NS5 on real Muon shapes at 4/5 of its cost;
* an explicit sequence of ``(a, b, c)`` triples (1 to 99 of them).

:func:`resolve_schedule` turns the constructor's ``ns_coefficients`` / ``ns_steps`` /
``ns_schedule`` into the tuple of triples the iteration runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .errors import GefenOptionError

__all__ = [
    "DEFAULT_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "MAX_NS_STEPS",
    "NS_SCHEDULES",
    "SCHEDULE_NAMES",
    "Coefficients",
    "Schedule",
    "ScheduleError",
    "newton_schulz",
    "normalize_coefficients",
    "orthogonality_error",
    "polynomial_schedule_value",
    "resolve_schedule",
]

Coefficients = tuple[float, float, float]
Schedule = tuple[Coefficients, ...]

#: The classic quintic of Keller Jordan's Muon (``torch.optim.Muon``'s default).
DEFAULT_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
#: Schedules must have fewer steps than this.
MAX_NS_STEPS = 100

#: Named schedules with their per-iteration coefficients ("standard" repeats ns_coefficients).
NS_SCHEDULES: dict[str, Schedule] = {
    "tuned3": (
        (5.0067, -14.4125, 10.6001),
        (3.7534, -6.8083, 3.3840),
        (3.2080, -4.3501, 2.0330),
    ),
    "tuned4": (
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    ),
}
SCHEDULE_NAMES = ("standard", *NS_SCHEDULES)


class ScheduleError(GefenOptionError):
    """A Newton-Schulz coefficient, step count or schedule is malformed (the message names it)."""


def _finite(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScheduleError(f"{where} must be a real number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ScheduleError(f"{where} must be finite, got {value!r}")
    return number


def _triple(value: object, where: str) -> Coefficients:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        raise ScheduleError(f"{where} must be an (a, b, c) triple of exactly 3 numbers, got {value!r}")
    a, b, c = (_finite(item, f"{where}[{index}]") for index, item in enumerate(value))
    return a, b, c


def normalize_coefficients(value: object, where: str = "ns_coefficients") -> Coefficients | Schedule:
    """One ``(a, b, c)`` triple, or a non-empty sequence of triples (fewer than 100), as tuples."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ScheduleError(f"{where} must be an (a, b, c) triple or a sequence of triples, got {value!r}")
    if len(value) == 0:
        raise ScheduleError(f"{where} must not be empty")
    if all(not isinstance(item, Sequence) or isinstance(item, (str, bytes)) for item in value):
        return _triple(value, where)
    if len(value) >= MAX_NS_STEPS:
        raise ScheduleError(f"{where} has {len(value)} steps; a schedule must have fewer than {MAX_NS_STEPS}")
    return tuple(_triple(item, f"{where}[{index}]") for index, item in enumerate(value))


def resolve_schedule(
    ns_coefficients: object = DEFAULT_COEFFICIENTS, ns_steps: object = DEFAULT_NS_STEPS, ns_schedule: object = None
) -> Schedule:
    """The triples one Newton-Schulz call runs, in order.

    ``ns_schedule`` ``None`` or ``"standard"`` keeps ``ns_coefficients``: one triple repeated
    ``ns_steps`` times (``ns_steps`` an int in ``[1, 100)``), or an explicit sequence of triples
    (``ns_steps`` ignored). A name from :data:`NS_SCHEDULES` or an explicit sequence given as
    ``ns_schedule`` replaces both. Raises :class:`ScheduleError` naming the argument.
    """
    if ns_schedule is not None and not (isinstance(ns_schedule, str) and ns_schedule == "standard"):
        if isinstance(ns_schedule, str):
            if ns_schedule not in NS_SCHEDULES:
                raise ScheduleError(f"ns_schedule {ns_schedule!r} is unknown; choose one of {list(SCHEDULE_NAMES)}")
            return NS_SCHEDULES[ns_schedule]
        return _as_schedule(normalize_coefficients(ns_schedule, "ns_schedule"))
    coefficients = normalize_coefficients(ns_coefficients)
    if isinstance(coefficients[0], tuple):  # a schedule already
        return coefficients
    if type(ns_steps) is not int:
        raise ScheduleError(f"ns_steps must be an int, got {type(ns_steps).__name__}")
    if not 1 <= ns_steps < MAX_NS_STEPS:
        why = " (0 steps would skip the orthogonalisation)" if ns_steps == 0 else ""
        raise ScheduleError(f"ns_steps must be in [1, {MAX_NS_STEPS}), got {ns_steps}{why}")
    return _as_schedule(coefficients) * ns_steps


def _as_schedule(value: Coefficients | Schedule) -> Schedule:
    if isinstance(value[0], tuple):
        return value
    return (value,)


def newton_schulz(
    matrix: torch.Tensor, schedule: Schedule, eps: float, *, compute_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Orthogonalise a 2-D matrix with ``schedule`` (module docstring); returns ``compute_dtype``.

    The result has ``matrix``'s orientation (a transposed view when ``matrix`` is tall).
    ``compute_dtype=torch.float64`` gives the exact-arithmetic reference the bf16 iteration is
    tested against.
    """
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    x = matrix.to(dtype=compute_dtype, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for a, b, c in schedule:
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def polynomial_schedule_value(singular_values: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """Where the iteration sends (already normalised) singular values: ``p_K(...p_1(s))``."""
    s = singular_values
    for a, b, c in schedule:
        s = a * s + b * s**3 + c * s**5
    return s


def orthogonality_error(output: torch.Tensor) -> float:
    """``max |sigma - 1|`` over the singular values of an NS output (float64 SVD)."""
    return float((torch.linalg.svdvals(output.detach().to(torch.float64)) - 1.0).abs().max())

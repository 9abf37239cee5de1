"""Per-parameter state: its keys, the two second-moment representations, counters.

A parameter has no state until its first step with a non-zero gradient. Then its state is
exactly one of three variants (the keys a checkpoint holds), chosen by
:func:`second_moment_variant`:

* ``block``: ``step``, ``m_codes``, ``m_magnitude``, ``vmean``, ``vmean_step``;
* ``factored`` (2-D parameters with ``factored_v_2d`` whose two dimensions are both at least
  ``min_dim_size_to_factor``): ``step``, ``m_codes``, ``m_magnitude``, ``v_row``, ``v_col``,
  ``factored_step``;
* ``element`` (2-D parameters with ``factored_v_2d`` narrower than that): ``step``,
  ``m_codes``, ``m_magnitude``, ``v`` (Adam's per-element second moment), ``v_step``.

The block period ``P`` is the width of the live codes (:func:`period_of`); it is stored
nowhere else (a checkpoint's scales' shape gives it, :mod:`gefen_core.state_placement`).

``m_codes`` and ``m_magnitude`` (codes into the learned codebook and one scale per block)
hold the momentum: since native format v4 the EMA of the *preconditioned* gradient
``g / (sqrt(V) + eps)`` (:data:`MOMENTUM_MEANING`; :mod:`gefen_core.reference_ops`), so the
update is the decoded momentum over the bias correction.

Shapes, for a local tensor of ``n`` elements, period ``P``, ``B = ceil(n / P)`` blocks and (for a
2-D parameter) ``R_local x K``: ``m_codes`` uint8 ``[B, P]`` (with ragged blocks,
:data:`gefen_core.periods.RAGGED_PERIOD`, its last ``B * P - n`` codes are padding, always 0:
no kernel reads or writes them and no checkpoint holds them); ``m_magnitude`` and
``vmean`` fp32 ``[B, 1]``; ``v_row`` fp32 ``[R_local]``; ``v_col`` fp32 ``[K]``; ``v`` fp32 shaped like
the local tensor. Counters are
Python ints, or 0-dim float64 tensors on the parameter's device under ``capturable=True``
(checkpoints always hold ints). No scratch buffers or caches live in the state.

When the live routing no longer matches the stored representation (the group's
``factored_v_2d`` or ``min_dim_size_to_factor`` changed, or a checkpoint saved under the other setting was loaded), the
step replaces the second moment by a zero one of the new kind with age 0: the EMA re-warms
under its own bias correction while momentum, periods and ``step`` continue. This is exact
for the first update after the switch (bias correction makes ``v_hat = g^2``-based) and needs
no collective for row-sharded parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import StateField, StateGeometry, StateRole, StateScope, StateValidationError
from gefen_contracts.torch_support import block_count

from .periods import cuts

__all__ = [
    "AGE_KEYS",
    "BLOCK",
    "BLOCK_KEYS",
    "COUNTER_KEYS",
    "ELEMENT",
    "ELEMENT_KEYS",
    "FACTORED",
    "FACTORED_KEYS",
    "FACTORED_STEP",
    "INDICES",
    "MAGNITUDE",
    "MOMENTUM_MEANING",
    "PARAMETER_FIELDS",
    "STEP",
    "V",
    "VARIANT_FIELDS",
    "VARIANT_KEYS",
    "VARIANT_MARKERS",
    "VMEAN",
    "VMEAN_STEP",
    "V_COL",
    "V_ROW",
    "V_STEP",
    "blocked_codes",
    "counter_value",
    "element_codes",
    "make_counter",
    "new_state",
    "place_state",
    "refuse_codes_without_codebook",
    "period_of",
    "second_moment_variant",
    "state_variant",
    "switch_second_moment",
    "zero_padding",
]

STEP = "step"
INDICES = "m_codes"
MAGNITUDE = "m_magnitude"
VMEAN = "vmean"
VMEAN_STEP = "vmean_step"
V_ROW = "v_row"
V_COL = "v_col"
FACTORED_STEP = "factored_step"
V = "v"
V_STEP = "v_step"

BLOCK = "block"
FACTORED = "factored"
ELEMENT = "element"

#: What the momentum holds, recorded in canonical documents' policy (a document of another
#: meaning is refused): the EMA of ``g / (sqrt(V) + eps)``.
MOMENTUM_MEANING = "preconditioned"


def _field(name: str, geometry: StateGeometry, dtype: str, description: str) -> StateField:
    return StateField(
        name, StateScope.PARAMETER, StateRole.AUTHORITATIVE, geometry, dtype=dtype, description=description
    )


#: Gefen's per-parameter state, declared once: each entry's name, how its shape follows the
#: parameter's (``gefen_contracts.state_layout.parameter_state_shape``) and its dtype. The contract's state
#: layout, the checkpoint shapes, dtypes and DTensor placements (:mod:`gefen_core.state_placement`)
#: and ``gefen inspect`` derive from it.
PARAMETER_FIELDS: dict[str, StateField] = {
    field.name: field
    for field in (
        _field(STEP, StateGeometry.SCALAR, "int", "the parameter's update count"),
        _field(INDICES, StateGeometry.PARAMETER, "uint8", "codeword indices of the preconditioned momentum"),
        _field(MAGNITUDE, StateGeometry.BLOCK, "float32", "per-block scale of the preconditioned momentum"),
        _field(VMEAN, StateGeometry.BLOCK, "float32", "per-block EMA of the block mean of g^2"),
        _field(VMEAN_STEP, StateGeometry.SCALAR, "int", "age of vmean"),
        _field(V_ROW, StateGeometry.ROW, "float32", "EMA of row means of g^2 (local rows when row-sharded)"),
        _field(V_COL, StateGeometry.COLUMN, "float32", "EMA of column means of g^2 (replicated)"),
        _field(FACTORED_STEP, StateGeometry.SCALAR, "int", "age of v_row and v_col"),
        _field(V, StateGeometry.PARAMETER, "float32", "per-element EMA of g^2 (matrices too narrow to factor)"),
        _field(V_STEP, StateGeometry.SCALAR, "int", "age of v"),
    )
}

_COMMON = (STEP, INDICES, MAGNITUDE)
BLOCK_KEYS = (*_COMMON, VMEAN, VMEAN_STEP)
FACTORED_KEYS = (*_COMMON, V_ROW, V_COL, FACTORED_STEP)
ELEMENT_KEYS = (*_COMMON, V, V_STEP)
#: Each variant's keys, in the order a checkpoint lists them.
VARIANT_FIELDS = {BLOCK: BLOCK_KEYS, FACTORED: FACTORED_KEYS, ELEMENT: ELEMENT_KEYS}
VARIANT_KEYS = {variant: frozenset(keys) for variant, keys in VARIANT_FIELDS.items()}
COUNTER_KEYS = (STEP, VMEAN_STEP, FACTORED_STEP, V_STEP)
#: Every variant's second-moment keys (what a switch of variant replaces).
_SECOND_MOMENT_KEYS = tuple(key for keys in VARIANT_FIELDS.values() for key in keys if key not in _COMMON)
AGE_KEYS = {BLOCK: VMEAN_STEP, FACTORED: FACTORED_STEP, ELEMENT: V_STEP}
#: The key only each variant's second moment holds (what :func:`state_variant` reads).
VARIANT_MARKERS = {FACTORED: V_ROW, ELEMENT: V, BLOCK: VMEAN}


def second_moment_variant(shape: Sequence[int], options: Mapping[str, Any]) -> str:
    """The second moment a tensor of ``shape`` keeps under a group's ``options``: ``factored``
    for a matrix whose two dimensions are both at least ``min_dim_size_to_factor`` (with
    ``factored_v_2d``), ``element`` for a narrower one, ``block`` otherwise.

    A rank-one estimate of a narrow matrix's ``v`` (d = 64) lets a few elements take steps far
    beyond Adam's: on ``char-mini`` Gefen measured 1.0140 of AdamW's held-out loss with every
    matrix factored and 0.9943 with Adam's ``v`` on the narrow ones (``gefen bench quality``,
    ``docs/benchmarks.md``). Adafactor (optax, T5X) does not factor such matrices either: its
    ``min_dim_size_to_factor`` is 128.
    A flattened element shard is a 1-D tensor here (``block``), as for the period overrides.
    """
    if len(shape) != 2 or not options["factored_v_2d"]:
        return BLOCK
    rows, cols = shape  # (every step asks, for every parameter: no generator here)
    return FACTORED if min(rows, cols) >= options["min_dim_size_to_factor"] else ELEMENT


def make_counter(value: int, device: torch.device, capturable: bool) -> int | torch.Tensor:
    """A counter in the live representation (an int, or a 0-dim float64 device tensor)."""
    if capturable:
        return torch.tensor(float(value), dtype=torch.float64, device=device)
    return value


def counter_value(counter: int | torch.Tensor) -> int:
    """The integer value of a live counter (reads a device tensor back: a host sync)."""
    if isinstance(counter, torch.Tensor):
        return int(counter.item())
    return counter


def period_of(state: Mapping[str, Any]) -> int:
    """The block period of a live state: the width of its codes ``uint8[B, P]``."""
    return int(state[INDICES].shape[1])


def state_variant(state: dict[str, Any]) -> str | None:
    """``"block"``, ``"factored"``, ``"element"`` or ``None`` for an empty state (keys are trusted here)."""
    if not state:
        return None
    return FACTORED if V_ROW in state else ELEMENT if V in state else BLOCK


def _second_moment(
    variant: str, local: torch.Tensor, blocks: int, device: torch.device, capturable: bool
) -> dict[str, Any]:
    if variant == FACTORED:
        rows, cols = local.shape
        return {
            V_ROW: torch.zeros(rows, dtype=torch.float32, device=device),
            V_COL: torch.zeros(cols, dtype=torch.float32, device=device),
            FACTORED_STEP: make_counter(0, device, capturable),
        }
    if variant == ELEMENT:
        return {
            V: torch.zeros(local.shape, dtype=torch.float32, device=device),
            V_STEP: make_counter(0, device, capturable),
        }
    return {
        VMEAN: torch.zeros(blocks, 1, dtype=torch.float32, device=device),
        VMEAN_STEP: make_counter(0, device, capturable),
    }


def new_state(local: torch.Tensor, period: int, variant: str, capturable: bool) -> dict[str, Any]:
    """Zero state for a local tensor (indices 0 decode to ``C[0] * 0 = 0``)."""
    numel = local.numel()
    if not cuts(numel, period):
        raise ValueError(f"period {period} does not divide {numel} elements")
    blocks = block_count(numel, period)
    device = local.device
    state: dict[str, Any] = {
        STEP: make_counter(0, device, capturable),
        INDICES: torch.zeros(blocks, period, dtype=torch.uint8, device=device),
        MAGNITUDE: torch.zeros(blocks, 1, dtype=torch.float32, device=device),
    }
    state.update(_second_moment(variant, local, blocks, device, capturable))
    return state


def blocked_codes(codes: torch.Tensor, period: int) -> torch.Tensor:
    """Codes of ``n`` elements (any shape) as live rows ``[ceil(n / P), P]``: a view when the
    blocks tile, else a copy whose ragged last row is padded with 0."""
    flat = codes.reshape(-1)
    blocks = block_count(flat.numel(), period)
    padding = blocks * period - flat.numel()
    if padding:
        flat = torch.cat([flat, flat.new_zeros(padding)])
    return flat.view(blocks, period)


def element_codes(codes: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` codes of live blocked codes, flat: a view without the padding (a copy when
    the codes were left strided between steps)."""
    return codes.reshape(-1)[:numel]


def zero_padding(codes: torch.Tensor, numel: int) -> None:
    """Reset the padding of blocked codes ``[B, P]`` of a tensor of ``numel`` elements to 0 (a
    ragged last block's unused codes; nothing when the blocks tile)."""
    if codes.numel() > numel:
        codes.view(-1)[numel:].zero_()


def switch_second_moment(state: dict[str, Any], variant: str, local: torch.Tensor, capturable: bool) -> None:
    """Replace the second moment by a zero one of ``variant`` (age 0), in place."""
    for key in _SECOND_MOMENT_KEYS:
        state.pop(key, None)
    blocks = state[INDICES].shape[0]
    state.update(_second_moment(variant, local, blocks, local.device, capturable))


def place_state(state: dict[str, Any], device: torch.device) -> None:
    """Move the state's tensors to ``device`` and make a tensor left strided contiguous, in
    place (the kernels need dense state on the parameter's device; torch's optimizers take any
    strides, and the kernels refused them mid-step, after other parameters had stepped)."""
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and (value.device != device or not value.is_contiguous()):
            state[key] = value.to(device).contiguous()


def refuse_codes_without_codebook(state: Mapping[str, Any], optimizer: str, where: str = "") -> None:
    """``StateValidationError`` for non-zero quantised momentum while no codebook is learned:
    learning one would misread the codes, and a load restores both, so this state came around
    ``load_state_dict`` (as torch's ``ZeroRedundancyOptimizer`` loads it)."""
    if bool(state[MAGNITUDE].ne(0).any()):
        raise StateValidationError(
            f"{where}the optimizer state holds quantised momentum but no codebook: it was put into optimizer.state "
            f"without {optimizer}'s load_state_dict (torch's ZeroRedundancyOptimizer consolidates and loads state "
            f"that way, without the codebook); load the state dict with {optimizer}.load_state_dict"
        )

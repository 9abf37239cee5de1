"""One local piece's compact state, and its portable fields in both directions.

A :class:`CompactPiece` holds what the quantized state of one local tensor (or one whole
matrix) keeps: period ``P``, codes, block scales, the codebook, and the second moment or
NorMuon statistic when there is one. A portable export carries it as it is (about one
byte per element):

* element field ``"momentum_codes"``: the uint8 codeword indices, shaped like the piece;
* block fields (one value per run of ``P`` elements, ``block_period = P``):
  ``"momentum_scale"`` (fp32 block scales) and, for a block second moment,
  ``"second_moment"`` (fp32 block means of ``v``);
* the factored second moment (``v_row``, ``v_col``) and NorMuon's row statistic
  (``normuon_v``) travel as replica fields (the pieces that hold them are complete).

An import receives the block fields expanded per element (the portable projection), so
:func:`incoming_momentum` decodes ``C[code] * scale`` for any target piece, bit for bit
what the source's step decodes; re-blocking (:mod:`gefen_core.reblocking`) then recovers
the source's blocks exactly when the target piece's blocks are the source's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from gefen_contracts.exchange import PortableSlotLayout, PortableSlotState
from gefen_contracts.torch_support import finite_bounds

from .param_state import V_COL, V_ROW

__all__ = [
    "MOMENTUM_CODES",
    "MOMENTUM_SCALE",
    "NORMUON_V_FIELD",
    "SECOND_MOMENT",
    "CompactPiece",
    "incoming_field",
    "incoming_momentum",
]

MOMENTUM_CODES = "momentum_codes"
MOMENTUM_SCALE = "momentum_scale"
SECOND_MOMENT = "second_moment"
NORMUON_V_FIELD = "normuon_v"


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


@dataclass(frozen=True, slots=True, eq=False)
class CompactPiece:
    """Compact state of one piece of shape ``shape`` (see the module docstring).

    ``vmean`` (block), ``v_row``/``v_col`` (factored; ``v_row`` holds the piece's rows) or ``v``
    (element: an element field) give the second moment; ``normuon_v`` (``[rows, 1]``) the NorMuon statistic.
    """

    shape: tuple[int, ...]
    period: int
    indices: torch.Tensor
    magnitude: torch.Tensor
    codebook: torch.Tensor
    vmean: torch.Tensor | None = None
    v_row: torch.Tensor | None = None
    v_col: torch.Tensor | None = None
    v: torch.Tensor | None = None
    normuon_v: torch.Tensor | None = None

    def portable_slot(
        self, layout: PortableSlotLayout, options: Mapping[str, object], variant: str, counters: Mapping[str, int]
    ) -> PortableSlotState:
        """The piece's portable record: fresh CPU copies, nothing aliasing live state."""
        elements: dict[str, object] = {MOMENTUM_CODES: _host(self.indices).reshape(self.shape)}
        blocks: dict[str, object] = {MOMENTUM_SCALE: _host(self.magnitude).reshape(-1).float()}
        if self.vmean is not None:
            blocks[SECOND_MOMENT] = _host(self.vmean).reshape(-1).float()
        if self.v is not None:
            elements[SECOND_MOMENT] = _host(self.v).reshape(self.shape)
        replicas: dict[str, object] = {}
        if self.v_row is not None and self.v_col is not None:
            replicas = {V_ROW: _host(self.v_row), V_COL: _host(self.v_col)}
        if self.normuon_v is not None:
            replicas[NORMUON_V_FIELD] = _host(self.normuon_v)
        return PortableSlotState(
            layout, options, variant, counters, elements, replicas, block_fields=blocks, block_period=self.period
        )


def incoming_momentum(
    element_fields: Mapping[str, object],
    shape: tuple[int, ...],
    codebook: torch.Tensor,
    where: str,
    fail: Callable[[str], Exception],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``(momentum, (codes, scale))``: the flat fp32 momentum ``C[code] * scale`` of an imported
    piece of ``shape`` and the flat codes and scales it was decoded from (re-blocking reuses
    them when the target's blocks are the source's: :func:`gefen_core.reblocking.source_encoding`).

    Checks ``momentum_codes`` (uint8) and ``momentum_scale`` (finite, non-negative fp32),
    both shaped like the piece; raises ``fail(message)`` naming ``where`` otherwise.
    """
    codes, scale = element_fields.get(MOMENTUM_CODES), element_fields.get(MOMENTUM_SCALE)
    for name, value, dtype in ((MOMENTUM_CODES, codes, torch.uint8), (MOMENTUM_SCALE, scale, torch.float32)):
        if type(value) is not torch.Tensor or value.dtype is not dtype or tuple(value.shape) != shape:
            got = f"{value.dtype}{tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise fail(f"{where} field {name!r} must be a {dtype} tensor of shape {shape}, got {got}")
    assert isinstance(codes, torch.Tensor) and isinstance(scale, torch.Tensor)
    flat_scale = scale.detach().reshape(-1)
    bounds = finite_bounds(flat_scale) if flat_scale.numel() else (0.0, 0.0)
    if bounds is None or bounds[0] < 0:
        raise fail(f"{where} field {MOMENTUM_SCALE!r} must be finite and non-negative")
    flat_codes = codes.detach().reshape(-1)
    table = codebook.detach().to(device="cpu", dtype=torch.float32)
    return table.index_select(0, flat_codes.to(torch.int32)) * flat_scale, (flat_codes, flat_scale)


def incoming_field(
    value: object, shape: tuple[int, ...], where: str, fail: Callable[[str], Exception], *, nonnegative: bool
) -> torch.Tensor:
    """An imported fp32 field of ``shape``, detached: a strided float32 tensor with finite values
    (and none negative with ``nonnegative``: a second moment or scale); raises ``fail(message)``
    naming ``where`` otherwise."""
    if type(value) is not torch.Tensor:
        raise fail(f"{where} must be a torch.Tensor, got {type(value).__name__}")
    tensor: torch.Tensor = value
    if tensor.dtype is not torch.float32 or tensor.layout is not torch.strided or tensor.is_meta:
        raise fail(f"{where} must be a strided float32 tensor, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise fail(f"{where} must have shape {shape}, got {tuple(tensor.shape)}")
    detached = tensor.detach()
    if detached.numel():
        bounds = finite_bounds(detached)
        if bounds is None:
            raise fail(f"{where} holds non-finite values")
        if nonnegative and bounds[0] < 0:
            raise fail(f"{where} holds negative values")
    return detached

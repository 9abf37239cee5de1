"""One local piece's compact state and the dense fields it stands for.

A :class:`CompactPiece` holds what the quantized state of one local tensor (or one whole
matrix) keeps: period, codes, block scales, the codebook, and the second moment or NorMuon
statistic when there is one. It produces the piece's dense fp32 fields
(:mod:`gefen_core.dense_view`) for any row range of its first dimension, so a checkpoint
writer can take a huge embedding chunk by chunk. :meth:`CompactPiece.frozen` copies the
compact tensors to the host (about one byte per element): that is what an asynchronous
save keeps instead of the dense fields (four bytes per element per field).

Field names (of the portable transport):

* ``"momentum"``: the decoded first moment;
* ``"second_moment"``: the dense second moment (block or factored, see
  :mod:`gefen_core.dense_view`);
* ``"normuon_v"``: GefenMuon's NorMuon row statistic repeated along each row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .dense_view import block_values, decode_momentum, factored_rows, row_values

__all__ = ["MOMENTUM", "NORMUON_V_FIELD", "SECOND_MOMENT", "CompactPiece"]

MOMENTUM = "momentum"
SECOND_MOMENT = "second_moment"
NORMUON_V_FIELD = "normuon_v"


@dataclass(frozen=True, slots=True, eq=False)
class CompactPiece:
    """Compact state of one piece whose dense fields have shape ``shape`` (see the module docstring).

    ``vmean`` (block) or ``v_row``/``v_col`` (factored; ``v_row`` holds the piece's rows)
    give the second moment; ``normuon_v`` (``[rows, 1]``) the NorMuon statistic.
    """

    shape: tuple[int, ...]
    period: int
    indices: torch.Tensor
    magnitude: torch.Tensor
    codebook: torch.Tensor
    vmean: torch.Tensor | None = None
    v_row: torch.Tensor | None = None
    v_col: torch.Tensor | None = None
    normuon_v: torch.Tensor | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        """The dense fields this piece produces, sorted."""
        names = [MOMENTUM]
        if self.vmean is not None or self.v_row is not None:
            names.append(SECOND_MOMENT)
        if self.normuon_v is not None:
            names.append(NORMUON_V_FIELD)
        return tuple(sorted(names))

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    def dense(self, field: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` (first dimension) of ``field`` as a fresh fp32 CPU tensor
        (the whole field for a 0-d piece). ``KeyError`` for a field the piece lacks."""
        end = self.rows if stop is None else stop
        if not 0 <= start <= end <= self.rows:
            raise ValueError(f"rows [{start}, {end}) are outside a piece of {self.rows} rows")
        tail = self.shape[1:]
        per_row = math.prod(tail)
        lo, hi = start * per_row, end * per_row
        out_shape = (end - start, *tail) if self.shape else ()
        if field == MOMENTUM:
            return decode_momentum(self.indices, self.magnitude, self.codebook, lo, hi).reshape(out_shape)
        if field == SECOND_MOMENT and self.vmean is not None:
            return block_values(self.vmean, self.period, lo, hi).reshape(out_shape)
        if field == SECOND_MOMENT and self.v_row is not None and self.v_col is not None:
            return factored_rows(self.v_row, self.v_col, start, end)
        if field == NORMUON_V_FIELD and self.normuon_v is not None:
            return row_values(self.normuon_v, per_row, start, end)
        raise KeyError(f"this piece has no dense field {field!r} (it has {list(self.fields)})")

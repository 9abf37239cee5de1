"""``GefenMuon``'s state in exchange form (the portable hand-over), used by its portable adapter.

One matrix's state (the whole matrix, or an ``"approx"`` row shard's rows) travels as

* a **variant**: ``"pristine"`` (no state yet), ``"muon"`` (quantized momentum) or
  ``"normuon"`` (momentum and NorMuon row statistics);
* **counters**: ``step``, plus ``normuon_step`` for ``"normuon"``;
* **fields** (:mod:`gefen_core.compact_piece`): the momentum as uint8 codes and fp32 block
  scales; the NorMuon statistic ``normuon_v`` as a replica field ``[rows, 1]`` (complete
  matrices), or on import as an element field repeated along each row.

Coming back, the momentum is re-blocked (:mod:`gefen_core.reblocking`; GefenMuon has no
second moment, so the period follows the momentum's exact structure, else a fresh search)
and re-encoded. Group options are adopted from the record except the execution choices
(:data:`EXECUTION_OPTIONS`), which stay the target's: they decide where the state lives,
not what it means.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.exchange import PortableSlotState
from gefen_contracts.torch_support import as_imported
from gefen_contracts.torch_support.option_records import plain_options
from gefen_contracts.torch_support.portable_slots import NamedSlot

from .compact_piece import (
    MOMENTUM_CODES,
    MOMENTUM_SCALE,
    NORMUON_V_FIELD,
    CompactPiece,
    incoming_field,
    incoming_momentum,
)
from .gefen_exchange import PRISTINE, momentum_codes
from .muon_native_state import export_muon_state_dict, slot_layouts
from .muon_state import NORMUON_STEP, NORMUON_V
from .param_state import INDICES, MAGNITUDE, STEP, period_of
from .parameter_update import placeholder_codebook
from .periods import shape_period
from .reblocking import PeriodChoice, exact_encoding, source_encoding
from .transport_slots import adopted_groups

__all__ = [
    "EXECUTION_OPTIONS",
    "MUON",
    "NORMUON",
    "PRISTINE",
    "IncomingMuonPiece",
    "check_incoming_muon",
    "live_muon_piece",
    "muon_entry",
    "muon_native_from_records",
    "plan_muon_piece",
]

MUON = "muon"
NORMUON = "normuon"
#: Group options that are the target's own choice (where state lives and how steps run).
EXECUTION_OPTIONS = ("sharded_mode", "fp8_ns", "fp8_ns_compile", "batched_ns", "batched_ns_workspace_bytes")
_COUNTERS = {MUON: frozenset({STEP}), NORMUON: frozenset({STEP, NORMUON_STEP})}


def _fail(message: str) -> StateValidationError:
    return StateValidationError(message)


def live_muon_piece(
    state: Mapping[str, Any] | None, shape: tuple[int, ...], codebook: torch.Tensor | None
) -> tuple[str, dict[str, int], CompactPiece | None]:
    """``(variant, counters, compact piece)`` of one live entry (``shape``: the matrix or rows it describes)."""
    if not state:
        return PRISTINE, {}, None
    indices = state[INDICES]
    table = codebook if codebook is not None else placeholder_codebook(indices.device)
    counters = {STEP: int(state[STEP])}
    common = (shape, period_of(state), indices, state[MAGNITUDE], table)
    if NORMUON_V in state:
        counters[NORMUON_STEP] = int(state[NORMUON_STEP])
        return NORMUON, counters, CompactPiece(*common, normuon_v=state[NORMUON_V])
    return MUON, counters, CompactPiece(*common)


@dataclass(frozen=True, slots=True, eq=False)
class IncomingMuonPiece:
    """A validated incoming record for one target matrix (or row shard) of ``shape``
    (``source``: the flat codes and scales the momentum was decoded from)."""

    fqn: str
    variant: str
    step: int
    normuon_step: int
    momentum: torch.Tensor
    normuon_v: torch.Tensor | None
    shape: tuple[int, int]
    source: tuple[torch.Tensor, torch.Tensor] | None = None


def check_incoming_muon(
    fqn: str,
    variant: str,
    counters: Mapping[str, int],
    element_fields: Mapping[str, object],
    replica_fields: Mapping[str, object],
    *,
    shape: tuple[int, int],
    global_step: int,
    codebook: torch.Tensor | None,
) -> IncomingMuonPiece | None:
    """Validate one projected record for a target of ``shape`` (``None`` for ``"pristine"``).

    The momentum arrives as codes and per-element scales (:mod:`gefen_core.compact_piece`)
    and is decoded with ``codebook`` (the placeholder when the source never learned one).
    ``normuon_v`` may come as a replica field ``[rows, 1]`` or as a dense element field
    ``[rows, cols]`` whose rows are constant. Raises
    :class:`~gefen_contracts.StateValidationError` naming the parameter and the problem.
    """
    where = f"parameter {fqn!r}"
    if variant == PRISTINE:
        if counters or element_fields or replica_fields:
            raise _fail(f"{where}: a {PRISTINE!r} record has no counters or fields")
        return None
    if variant not in _COUNTERS:
        raise _fail(f"{where}: unknown variant {variant!r} (GefenMuon knows {[PRISTINE, MUON, NORMUON]})")
    if set(counters) != _COUNTERS[variant]:
        raise _fail(f"{where}: variant {variant!r} needs counters {sorted(_COUNTERS[variant])}, got {sorted(counters)}")
    step = counters[STEP]
    if type(step) is not int or not 1 <= step <= global_step:
        raise _fail(f"{where} counter {STEP!r} must be an int in [1, {global_step}], got {step!r}")
    normuon_step = 0
    if variant == NORMUON:
        normuon_step = counters[NORMUON_STEP]
        if type(normuon_step) is not int or not 1 <= normuon_step <= step:
            raise _fail(f"{where} counter {NORMUON_STEP!r} must be an int in [1, {step}], got {normuon_step!r}")
    rows, cols = shape
    names = set(element_fields) | set(replica_fields)
    expected = {MOMENTUM_CODES, MOMENTUM_SCALE} | ({NORMUON_V_FIELD} if variant == NORMUON else set())
    if names != expected or not {MOMENTUM_CODES, MOMENTUM_SCALE} <= set(element_fields):
        raise _fail(f"{where}: variant {variant!r} needs the fields {sorted(expected)}, got {sorted(names)}")
    table = codebook if codebook is not None else placeholder_codebook(torch.device("cpu"))
    momentum, source = incoming_momentum(element_fields, shape, table, where, _fail)
    normuon_v = None
    if variant == NORMUON:
        if NORMUON_V_FIELD in replica_fields:
            normuon_v = incoming_field(
                replica_fields[NORMUON_V_FIELD],
                (rows, 1),
                f"{where} replica field 'normuon_v'",
                _fail,
                nonnegative=True,
            )
        else:
            dense = incoming_field(
                element_fields[NORMUON_V_FIELD], shape, f"{where} field 'normuon_v'", _fail, nonnegative=True
            )
            normuon_v = dense[:, :1].contiguous()
            if not torch.equal(dense, normuon_v.expand(rows, cols)):
                raise _fail(f"{where} field 'normuon_v' must repeat one value along each row")
    return IncomingMuonPiece(fqn, variant, step, normuon_step, momentum, normuon_v, shape, source)


def plan_muon_piece(
    piece: IncomingMuonPiece, *, search_shape: tuple[int, int], codebook: torch.Tensor | None
) -> PeriodChoice:
    """The target period: always the shape rule a first step applies, the only period a
    GefenMuon state holds (its load refuses any other). Gefen's period search chose period 1
    for a matrix under 8 elements, and a whole-matrix block for all-zero momentum (every
    period re-encodes zeros exactly), so those imports were refused. The momentum is exact when
    the source's codes re-encode to themselves at that period (no search)."""
    numel = piece.momentum.numel()
    period = shape_period(search_shape, numel)
    encoded = None
    if codebook is not None and numel:
        if piece.source is not None:
            encoded = source_encoding(piece.source[0], piece.source[1], period, codebook)
        else:
            encoded = exact_encoding(piece.momentum, period, codebook)
    return PeriodChoice(period, encoded is not None, True, "exact" if encoded is not None else "reinferred", encoded)


def muon_entry(
    piece: IncomingMuonPiece,
    period: int,
    codebook: torch.Tensor | None,
    *,
    device: torch.device,
    encoding: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The native state entry of a target matrix (tensors on ``device``; ``encoding``: the
    momentum's codes at ``period`` when the period choice already made them)."""
    indices, magnitude = momentum_codes(piece.momentum, period, codebook, device, encoding)
    entry: dict[str, Any] = {STEP: piece.step, INDICES: indices, MAGNITUDE: magnitude}
    if piece.normuon_v is not None:
        entry[NORMUON_V] = piece.normuon_v.to(device=device, copy=True)
        entry[NORMUON_STEP] = piece.normuon_step
    return entry


def muon_native_from_records(
    optimizer: Any, global_step: int, codebook: torch.Tensor | None, pairs: list[tuple[NamedSlot, PortableSlotState]]
) -> dict[str, Any]:
    """GefenMuon's native state dict for checked portable slot records (``pairs``, in the order
    of the optimizer's slots): whole matrices re-blocked and re-encoded, target groups adopting
    the options recorded for their matrices. The native staged load validates the result."""
    records: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in optimizer.param_groups]
    entries: dict[tuple[int, int], dict[str, Any]] = {}
    for slot, record in pairs:
        records[slot.group_index].append((slot.fqn, plain_options(record.options)))
        if slot.tensor is None:
            continue
        rows, cols = (int(d) for d in slot.tensor.shape)
        if record.block_fields:  # passed through unexpanded: GefenMuon re-blocks from the expanded form
            record = as_imported(record, (rows, cols))
        piece = check_incoming_muon(
            slot.fqn,
            record.variant,
            record.counters,
            record.element_fields,
            record.replica_fields,
            shape=(rows, cols),
            global_step=global_step,
            codebook=codebook,
        )
        if piece is None:
            continue
        choice = plan_muon_piece(piece, search_shape=(rows, cols), codebook=codebook)
        assert slot.live_index is not None
        entries[(slot.group_index, slot.live_index)] = muon_entry(
            piece, choice.period, codebook, device=slot.tensor.device, encoding=choice.encoding
        )
    groups = adopted_groups(optimizer.param_groups, records, keep=EXECUTION_OPTIONS)
    layouts, scope = slot_layouts(groups)
    positions = [(g, k) for g, group in enumerate(groups) for k in range(len(group["params"]))]
    states = [entries.get(position) for position in positions]
    return export_muon_state_dict(
        groups,
        states,
        layouts,
        scope,
        codebook=codebook,
        global_step=global_step,
        deterministic=optimizer._deterministic,
    )

"""``Gefen``'s state in exchange form (the portable hand-over), used by the portable adapter.

One piece of one parameter travels as

* a **variant**: ``"pristine"`` (no state yet), ``"block"`` (block second moment),
  ``"factored"`` (factored second moment) or ``"element"`` (a narrow matrix's per-element one);
* **counters**: ``step`` and the second moment's age (``vmean_step``, ``factored_step`` or ``v_step``);
* **fields** (:mod:`gefen_core.compact_piece`): the momentum as uint8 codes (an element
  field) and fp32 block scales (a block field, one per block of the piece's period), the
  block second moment as a block field, and a complete piece's factored second moment
  exactly as its two vectors, the *replica fields* ``v_row`` and ``v_col``: about one
  byte per element in all (five for an ``element`` piece, whose ``v`` is an element field).

Coming back, :func:`check_incoming` validates a record for one target piece and
:func:`native_entry` re-encodes it into the native per-parameter state of the target
(:mod:`gefen_core.param_state`), re-blocked by :mod:`gefen_core.reblocking`. The target's
representation follows the target (:func:`gefen_core.param_state.second_moment_variant`):
factored (its statistics copied from the replica fields, or re-factored from the dense field
by row and column means), element (the dense field itself) or block (block means of the
dense field, which a factored source provides through ``outer(v_row, v_col) / mean(v_col)``).
The age counter carries over whichever representation the target takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.exchange import PortableSlotState
from gefen_contracts.identity import LogicalSlice
from gefen_contracts.torch_support import as_imported, block_count
from gefen_contracts.torch_support.option_records import plain_options
from gefen_contracts.torch_support.portable_slots import NamedSlot

from . import native_format as F
from .compact_piece import (
    MOMENTUM_CODES,
    MOMENTUM_SCALE,
    SECOND_MOMENT,
    CompactPiece,
    incoming_field,
    incoming_momentum,
)
from .dense_view import factored_statistics, factored_values
from .distributed import local_tensor
from .errors import GefenOptionError, GefenOptionTypeError
from .native_records import native_state_dict
from .param_groups import normalize_group_options
from .param_state import (
    AGE_KEYS,
    BLOCK,
    ELEMENT,
    FACTORED,
    FACTORED_STEP,
    INDICES,
    MAGNITUDE,
    STEP,
    V_COL,
    V_ROW,
    V_STEP,
    VMEAN,
    VMEAN_STEP,
    V,
    blocked_codes,
    counter_value,
    element_codes,
    period_of,
    second_moment_variant,
    state_variant,
)
from .parameter_update import placeholder_codebook
from .periods import PeriodPolicy, aligned_period, cuts, period_policy
from .reblocking import PeriodChoice, block_means, choose_period, encode_momentum
from .state_placement import export_tensors
from .transport_slots import adopted_groups, positional_state

__all__ = [
    "PRISTINE",
    "IncomingPiece",
    "check_incoming",
    "complete_factors",
    "slot_options",
    "live_name",
    "live_piece",
    "momentum_codes",
    "native_entry",
    "native_from_records",
    "own_blocks_entry",
    "plan_piece",
]

#: The variant of a parameter without state.
PRISTINE = "pristine"
_COUNTERS = {variant: frozenset({STEP, age}) for variant, age in AGE_KEYS.items()}


def _fail(message: str) -> StateValidationError:
    return StateValidationError(message)


def live_piece(
    state: Mapping[str, Any] | None, shape: tuple[int, ...], codebook: torch.Tensor | None
) -> tuple[str, dict[str, int], CompactPiece | None]:
    """``(variant, counters, compact piece)`` of one live state entry (``shape``: the local tensor's)."""
    if not state:
        return PRISTINE, {}, None
    variant = state_variant(dict(state))
    assert variant is not None
    indices = element_codes(state[INDICES], math.prod(shape))  # without a ragged block's padding
    table = codebook if codebook is not None else placeholder_codebook(indices.device)
    age_key = AGE_KEYS[variant]
    counters = {STEP: counter_value(state[STEP]), age_key: counter_value(state[age_key])}
    common = (shape, period_of(state), indices, state[MAGNITUDE], table)
    if variant == FACTORED:
        return variant, counters, CompactPiece(*common, v_row=state[V_ROW], v_col=state[V_COL])
    if variant == ELEMENT:
        return variant, counters, CompactPiece(*common, v=state[V])
    return variant, counters, CompactPiece(*common, vmean=state[VMEAN])


@dataclass(frozen=True, slots=True, eq=False)
class IncomingPiece:
    """A validated incoming record for one non-empty-or-empty target piece.

    ``momentum`` is flat (the piece's row-major order). The second moment is one of:
    ``block_v`` (dense, block-shaped), ``dense_v`` (dense, from a factored or element source) or
    ``factors`` (the complete parameter's ``v_row`` and ``v_col``). ``flat_offset`` is the
    piece's first element within the parameter of ``global_shape``; ``source`` the flat codes
    and scales the momentum was decoded from.
    """

    fqn: str
    variant: str
    step: int
    age: int
    momentum: torch.Tensor
    block_v: torch.Tensor | None
    dense_v: torch.Tensor | None
    factors: tuple[torch.Tensor, torch.Tensor] | None
    flat_offset: int
    global_shape: tuple[int, ...]
    source: tuple[torch.Tensor, torch.Tensor] | None = None

    def second_moment(self) -> torch.Tensor:
        """The dense second moment of the piece, flat."""
        if self.block_v is not None:
            return self.block_v
        if self.dense_v is not None:
            return self.dense_v
        assert self.factors is not None
        v_row, v_col = self.factors
        return factored_values(v_row, v_col, self.flat_offset, self.flat_offset + self.momentum.numel())


def _field(value: object, shape: tuple[int, ...], where: str, *, nonnegative: bool) -> torch.Tensor:
    return incoming_field(value, shape, where, _fail, nonnegative=nonnegative).reshape(-1)


def _counter(counters: Mapping[str, int], key: str, where: str, maximum: int) -> int:
    value = counters[key]
    if type(value) is not int or not 1 <= value <= maximum:
        raise _fail(f"{where} counter {key!r} must be an int in [1, {maximum}], got {value!r}")
    return value


def _checked_counters(variant: str, counters: Mapping[str, int], where: str, global_step: int) -> tuple[int, int]:
    """``(step, age)`` of a record's counters (the variant's two, in range)."""
    if variant not in _COUNTERS:
        raise _fail(f"{where}: unknown variant {variant!r} (Gefen knows {[PRISTINE, *_COUNTERS]})")
    if set(counters) != _COUNTERS[variant]:
        raise _fail(f"{where}: variant {variant!r} needs counters {sorted(_COUNTERS[variant])}, got {sorted(counters)}")
    step = _counter(counters, STEP, where, global_step)
    return step, _counter(counters, AGE_KEYS[variant], where, step)


def own_blocks_entry(
    record: PortableSlotState,
    *,
    param: torch.Tensor,
    target: str,
    forced_one: bool,
    global_step: int,
) -> dict[str, Any] | None:
    """The native entry of a record whose block fields arrived as exported (the target piece is
    the fragment that exported them: same elements, same order), keeping the source's blocks,
    codes, scales and second moment as they are: no decode, no re-encoding, bit for bit.
    ``None`` when the target keeps another second moment than the record, a forced period
    one, or blocks the period cannot cut (the caller then expands the record and re-blocks).
    The native load validates the entry's dtypes, shapes and values."""
    where = f"parameter {record.layout.fqn!r}"
    variant, period = record.variant, record.block_period
    local = local_tensor(param)
    numel = local.numel()
    if variant != target or (forced_one and period != 1):
        return None
    if not cuts(numel, period):
        return None
    step, age = _checked_counters(variant, record.counters, where, global_step)
    factored = variant == FACTORED
    blocked = sorted((MOMENTUM_SCALE, SECOND_MOMENT) if variant == BLOCK else (MOMENTUM_SCALE,))
    elements = sorted((MOMENTUM_CODES, SECOND_MOMENT) if variant == ELEMENT else (MOMENTUM_CODES,))
    replicas = sorted((V_COL, V_ROW)) if factored else []
    if sorted(record.element_fields) != elements or sorted(record.block_fields) != blocked:
        raise _fail(
            f"{where}: a {variant!r} record passed through holds element fields {elements} and block fields "
            f"{blocked}, got {sorted(record.element_fields)} and {sorted(record.block_fields)}"
        )
    if sorted(record.replica_fields) != replicas:
        raise _fail(
            f"{where}: variant {variant!r} needs replica fields {replicas}, got {sorted(record.replica_fields)}"
        )
    codes = record.element_fields[MOMENTUM_CODES]
    if type(codes) is not torch.Tensor or codes.dtype is not torch.uint8 or codes.numel() != numel:
        raise _fail(f"{where} field {MOMENTUM_CODES!r} must be a uint8 tensor of {numel} elements")
    blocks = block_count(numel, period)
    device = local.device
    values: dict[str, torch.Tensor] = {}
    for name in blocked:
        value = record.block_fields[name]
        assert isinstance(value, torch.Tensor)
        if value.numel() != blocks:
            raise _fail(f"{where} block field {name!r} must hold {blocks} values, got {value.numel()}")
        values[name] = value.reshape(blocks, 1).to(device)
    entry: dict[str, Any] = {
        STEP: step,
        INDICES: blocked_codes(codes.to(device), period),
        MAGNITUDE: values[MOMENTUM_SCALE],
    }
    if factored:
        rows, cols = local.shape
        v_row = _field(record.replica_fields[V_ROW], (rows,), f"{where} replica field {V_ROW!r}", nonnegative=True)
        v_col = _field(record.replica_fields[V_COL], (cols,), f"{where} replica field {V_COL!r}", nonnegative=True)
        entry.update({V_ROW: v_row.to(device), V_COL: v_col.to(device), FACTORED_STEP: age})
    elif variant == ELEMENT:
        shape = tuple(local.shape)
        v = _field(record.element_fields[SECOND_MOMENT], shape, f"{where} field {SECOND_MOMENT!r}", nonnegative=True)
        entry.update({V: v.view(shape).to(device), V_STEP: age})
    else:
        entry.update({VMEAN: values[SECOND_MOMENT], VMEAN_STEP: age})
    entry.update(export_tensors(param, entry, variant))
    return entry


def check_incoming(
    fqn: str,
    variant: str,
    counters: Mapping[str, int],
    element_fields: Mapping[str, object],
    replica_fields: Mapping[str, object],
    *,
    piece_shape: tuple[int, ...],
    flat_offset: int,
    global_shape: tuple[int, ...],
    global_step: int,
    codebook: torch.Tensor | None,
) -> IncomingPiece | None:
    """Validate one projected record for a target piece of ``piece_shape`` (``None`` for ``"pristine"``).

    The block fields arrive expanded per element; the momentum is decoded with ``codebook``
    (the document's; the placeholder when the source never learned one). Raises
    :class:`~gefen_contracts.StateValidationError` naming the parameter, the field and what
    is wrong (unknown variant, counters other than the variant's, a counter outside
    ``[1, global_step]`` or an age above ``step``, missing or extra fields, wrong dtype or
    shape, non-finite values, a negative scale or second moment).
    """
    where = f"parameter {fqn!r}"
    if variant == PRISTINE:
        if counters or element_fields or replica_fields:
            raise _fail(f"{where}: a {PRISTINE!r} record has no counters or fields")
        return None
    step, age = _checked_counters(variant, counters, where, global_step)
    factors = None
    momentum_fields = sorted((MOMENTUM_CODES, MOMENTUM_SCALE))
    if variant == FACTORED and replica_fields:
        if sorted(element_fields) != momentum_fields or sorted(replica_fields) != sorted((V_ROW, V_COL)):
            raise _fail(
                f"{where}: a factored record holds fields {momentum_fields} and replica fields "
                f"{[V_COL, V_ROW]}, got {sorted(element_fields)} and {sorted(replica_fields)}"
            )
        if len(global_shape) != 2:
            raise _fail(f"{where}: a factored second moment needs a 2-D parameter, the parameter is {global_shape}")
        rows, cols = global_shape
        factors = (
            _field(replica_fields[V_ROW], (rows,), f"{where} replica field {V_ROW!r}", nonnegative=True),
            _field(replica_fields[V_COL], (cols,), f"{where} replica field {V_COL!r}", nonnegative=True),
        )
    else:
        if replica_fields:
            raise _fail(f"{where}: variant {variant!r} has no replica fields, got {sorted(replica_fields)}")
        if sorted(element_fields) != sorted((*momentum_fields, SECOND_MOMENT)):
            raise _fail(
                f"{where}: variant {variant!r} needs fields {sorted((*momentum_fields, SECOND_MOMENT))}, "
                f"got {sorted(element_fields)}"
            )
    table = codebook if codebook is not None else placeholder_codebook(torch.device("cpu"))
    momentum, source = incoming_momentum(element_fields, piece_shape, table, where, _fail)
    dense = None
    if factors is None:
        dense = _field(element_fields[SECOND_MOMENT], piece_shape, f"{where} field {SECOND_MOMENT!r}", nonnegative=True)
    return IncomingPiece(
        fqn,
        variant,
        step,
        age,
        momentum,
        dense if variant == BLOCK else None,
        dense if variant != BLOCK else None,
        factors,
        flat_offset,
        global_shape,
        source,
    )


def plan_piece(
    piece: IncomingPiece,
    *,
    search_shape: tuple[int, ...],
    policy: PeriodPolicy,
    name: str | None,
    ndim: int,
    codebook: torch.Tensor | None,
) -> PeriodChoice:
    """The target period of ``piece`` (:func:`gefen_core.reblocking.choose_period`).

    Re-inference runs the group's :class:`~gefen_core.periods.PeriodPolicy` as a first step
    would choose for the piece: the parameter's own period when the piece starts and ends on
    its blocks (:func:`gefen_core.periods.aligned_period`), else the rule on the piece.
    """

    def reinfer() -> int:
        numel = piece.momentum.numel()
        local = policy.resolve(name, search_shape, numel)
        if tuple(search_shape) == tuple(piece.global_shape):
            return local
        total = math.prod(piece.global_shape)
        logical = policy.resolve(name, piece.global_shape, total)
        return aligned_period(logical, piece.flat_offset, numel, local, total)

    return choose_period(
        piece.momentum,
        shape=search_shape,
        second_moment=piece.block_v,
        codebook=codebook,
        forced_one=policy.forces_period_one(name, ndim),
        reinfer=reinfer,
        source=piece.source,
    )


def complete_factors(piece: IncomingPiece, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v_row, v_col)`` fp32 for a factored target that holds every row of the parameter:
    the record's own vectors when it kept them, else the float64 row and column means of the
    dense second moment (which re-factor a rank-one field to fp32 rounding)."""
    if piece.factors is not None:
        v_row, v_col = piece.factors
        return v_row.clone(), v_col.clone()
    row_means, col_sums = factored_statistics(piece.second_moment().view(rows, cols))
    return row_means.to(torch.float32), (col_sums / max(rows, 1)).to(torch.float32)


def momentum_codes(
    momentum: torch.Tensor,
    period: int,
    codebook: torch.Tensor | None,
    device: torch.device,
    encoding: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, magnitude)`` on ``device``: the period choice's exact encoding when it made
    one, else :func:`gefen_core.reblocking.encode_momentum` (any codebook encodes a zero
    momentum when there is none)."""
    if encoding is not None:
        indices, magnitude = encoding
        return indices.to(device), magnitude.to(device)
    table = codebook if codebook is not None else placeholder_codebook(torch.device("cpu"))
    return encode_momentum(momentum, period, table, device)


def native_entry(
    piece: IncomingPiece,
    period: int,
    codebook: torch.Tensor | None,
    *,
    param: torch.Tensor,
    target: str,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoding: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """The native state entry of a target piece for the live ``param`` (tensors on its device,
    shaped and placed like it, :mod:`gefen_core.state_placement`), keeping the ``target``
    second moment: block (block means of the dense field at ``period``), element (the dense
    field) or factored, whose ``factors`` are the target's ``(v_row, v_col)``
    (:func:`complete_factors`, or a row shard's rows with every shard's columns).
    ``encoding``: the momentum's codes at ``period`` when the period choice already made them.
    """
    local = local_tensor(param)
    device = local.device
    indices, magnitude = momentum_codes(piece.momentum, period, codebook, device, encoding)
    entry: dict[str, Any] = {STEP: piece.step, INDICES: indices, MAGNITUDE: magnitude}
    if target == FACTORED:
        assert factors is not None
        v_row, v_col = factors
        entry.update({V_ROW: v_row.to(device), V_COL: v_col.to(device), FACTORED_STEP: piece.age})
    elif target == ELEMENT:
        entry.update({V: piece.second_moment().view(local.shape).to(device), V_STEP: piece.age})
    else:
        entry[VMEAN] = block_means(piece.second_moment(), period, device)
        entry[VMEAN_STEP] = piece.age
    entry.update(export_tensors(param, entry, target))
    return entry


def slot_options(options: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(recorded options as plain values, normalised Gefen options)``."""
    plain = plain_options(options)
    try:
        normalized = normalize_group_options(plain)
    except (GefenOptionError, GefenOptionTypeError) as exc:
        raise _fail(f"{where}: invalid recorded option: {exc}") from None
    missing = {
        "factored_v_2d",
        "min_dim_size_to_factor",
        "force_1d_period_one",
        "force_2d_period_one",
        "period_one_substrings",
    } - set(normalized)
    if missing:
        raise _fail(f"{where}: the recorded options lack {sorted(missing)}")
    return plain, normalized


def live_name(param_groups: Sequence[Mapping[str, Any]], slot: NamedSlot) -> str | None:
    """The live parameter name of ``slot`` (``None`` for an unnamed group or a slot without a tensor)."""
    names = param_groups[slot.group_index].get("param_names")
    if names is None or slot.live_index is None:
        return None
    return str(names[slot.live_index])


def native_from_records(
    optimizer: Any, global_step: int, codebook: torch.Tensor | None, pairs: list[tuple[NamedSlot, PortableSlotState]]
) -> dict[str, Any]:
    """Gefen's native state dict for checked portable slot records (``pairs``, in the order of
    the optimizer's slots): every piece re-blocked and re-encoded for its target (a piece that
    is exactly the fragment that exported it keeps its own blocks), target groups adopting the
    options recorded for their parameters. The native staged load validates the result."""
    records: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in optimizer.param_groups]
    entries: dict[tuple[int, int], dict[str, Any]] = {}
    for slot, record in pairs:
        where = f"parameter {slot.fqn!r}"
        plain, options = slot_options(record.options, where)
        records[slot.group_index].append((slot.fqn, plain))
        if slot.tensor is None:
            continue
        tensor = slot.tensor
        target = second_moment_variant(tensor.shape, options)
        assert slot.live_index is not None
        if record.block_fields:  # the piece is the fragment that exported it: keep its own blocks
            name = live_name(optimizer.param_groups, slot)
            # the parameter's own rank, not the piece's: a flattened shard of a matrix is 1-D,
            # and a step forces period 1 by the matrix's rank (force_1d_period_one spares it)
            ndim = len(record.layout.shard.parameter.global_shape)
            forced = period_policy(options).forces_period_one(name, ndim)
            kept = own_blocks_entry(record, param=tensor, target=target, forced_one=forced, global_step=global_step)
            if kept is not None:
                entries[(slot.group_index, slot.live_index)] = kept
                continue
            record = as_imported(record, tuple(tensor.shape))
        shard = record.layout.shard
        extent = shard.extent
        offset = extent.flat_offset if type(extent) is LogicalSlice else 0
        piece = check_incoming(
            slot.fqn,
            record.variant,
            record.counters,
            record.element_fields,
            record.replica_fields,
            piece_shape=tuple(tensor.shape),
            flat_offset=offset,
            global_shape=shard.parameter.global_shape,
            global_step=global_step,
            codebook=codebook,
        )
        if piece is None:
            continue
        choice = plan_piece(
            piece,
            search_shape=tuple(tensor.shape),
            policy=period_policy(options),
            name=live_name(optimizer.param_groups, slot),
            ndim=len(piece.global_shape),  # (the parameter's rank, as above; the rule on the piece reinfers)
            codebook=codebook,
        )
        factors = complete_factors(piece, *tensor.shape) if target == FACTORED else None
        entries[(slot.group_index, slot.live_index)] = native_entry(
            piece, choice.period, codebook, param=tensor, target=target, factors=factors, encoding=choice.encoding
        )
    groups = adopted_groups(optimizer.param_groups, records)
    state = positional_state(groups, entries)
    record_fields = {
        "global_step": global_step,
        "codebook": codebook,
        "deterministic": optimizer._deterministic,
    }
    return native_state_dict(F.FORMAT, groups, state, record_fields)

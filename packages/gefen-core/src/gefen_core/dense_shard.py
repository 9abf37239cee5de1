"""``Gefen``'s side of dense-shard checkpoints: :class:`gefen_contracts.DenseShardCodec` with the
optional :class:`~gefen_contracts.DenseFieldRows` and :class:`~gefen_contracts.DenseShardSnapshot`.

``gefen_dcp.GefenDCPState`` saves each parameter's dense fp32 fields at its local shard's
global offsets (FSDP2 ``Shard(0)`` DTensors, replicated DTensors or plain tensors), lets DCP
reshard them onto any later layout and hands the loaded local shards back. Gefen's part:

* **common**: ``{"schema_version": 2, "global_step": int, "deterministic": bool}``,
  identical on every rank (a load requires the same ``deterministic``). The codebook does
  not travel: without a codebook scope each rank learns its own from its own gradients, so
  on load each rank learns one from the dense momenta it receives, exactly as a first
  step learns one from gradients;
* **per parameter**, keyed by torch's parameter name (or the sealed FQN): the group's
  options, the variant and counters of :mod:`gefen_core.gefen_transport`, and the fields
  ``momentum`` and ``second_moment`` shaped like the local shard (for a factored parameter
  the dense estimate of its rows);
* **memory**: :meth:`~GefenDenseShard.materialize_dense_field_rows` decodes only the rows
  asked for (a chunk of an embedding), and :meth:`~GefenDenseShard.dense_shard_snapshot`
  keeps a host copy of the compact state (about one byte per element) for ``dcp.async_save``.

**Load** (:meth:`~GefenDenseShard.prepare_dense_shard_load`): every local piece is
re-blocked by :mod:`gefen_core.reblocking` without a codebook (the source's block structure
when the second moment is block-shaped, else the memory-safe fallback period), the codebook
is learned from the re-blocked momenta, momenta are re-encoded and the second moment takes
the target's representation: block means, or factored statistics re-factored from the dense
field. A row shard's column statistics need every shard's rows: all ranks vote once and
``all_reduce`` the float64 column sums once per device mesh, as a training step does.
Everything is validated and staged by the native staged load before anything changes.

Every rank's piece of one parameter must share its variant and counters (the save agrees
on them); that holds once every rank created the parameter's state at the same step, as
FSDP2 training does when each shard sees a non-zero gradient at the first step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from gefen_contracts import (
    FEATURE_DENSE_SHARD_CODEC,
    DenseShardLoad,
    DenseShardSlot,
    FeatureStatus,
    ParameterLayout,
    StagedTransaction,
    StateValidationError,
    require_transaction,
)
from gefen_contracts.torch_support import SealedLayout, failure_vote_on_group

from . import native_format as F
from .compact_piece import CompactPiece, FrozenDenseShards, stateful_piece
from .dense_view import factored_statistics
from .distributed import codebook_of_first_member, is_row_sharded, learning_mesh, local_tensor
from .gefen_transport import (
    IncomingPiece,
    check_incoming,
    complete_factors,
    live_piece,
    native_entry,
    period_policy,
    plan_piece,
    slot_options,
)
from .native_records import native_state_dict
from .ops import KernelDispatch
from .reblocking import PeriodChoice, learn_momentum_codebook
from .transport_records import check_dense_common, dense_common
from .transport_slots import (
    BoundLayoutHook,
    NamedSlot,
    adopted_groups,
    named_slots,
    naming_blockers,
    option_blockers,
    positional_state,
    require_feature,
    transport_options,
)

__all__ = ["LOAD_KIND", "GefenDenseShard", "row_shard_meshes"]

#: The kind of the staged transaction ``prepare_dense_shard_load`` returns.
LOAD_KIND = "gefen.Gefen.dense_shard_load"


class _Host(Protocol):
    param_groups: Any
    state: Any
    _codebook: torch.Tensor | None
    _deterministic: bool
    _version: int
    _dispatch: KernelDispatch

    @property
    def global_step(self) -> int: ...

    def _bound_layout(self) -> SealedLayout | None: ...

    def _with_identity_guard(self, native: dict[str, Any]) -> dict[str, Any]: ...

    def _dense_shard_status(self) -> FeatureStatus: ...

    def _dense_pieces(self) -> dict[str, tuple[NamedSlot, str, dict[str, int], CompactPiece | None]]: ...

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction: ...

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None: ...


_WHO = "Gefen dense-shard state"


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"{_WHO}: {message}")


def row_shard_meshes(params: list[torch.Tensor]) -> list[tuple[Any, list[int]]]:
    """``(mesh, positions)`` of the row-sharded 2-D parameters in ``params``, meshes in order of
    first appearance (the live layout alone decides, so every rank computes the same list)."""
    meshes: list[tuple[Any, list[int]]] = []
    for position, param in enumerate(params):
        if param.dim() != 2 or not is_row_sharded(param):
            continue
        mesh = param.device_mesh  # type: ignore[attr-defined]
        for known, members in meshes:
            if known is mesh:
                members.append(position)
                break
        else:
            meshes.append((mesh, [position]))
    return meshes


def _reduce_column_sums(
    params: list[torch.Tensor], sums: dict[int, torch.Tensor], error: BaseException | None
) -> dict[int, torch.Tensor]:
    """Vote on ``error`` and sum the row shards' float64 column sums over each mesh (every
    row-sharded 2-D parameter travels, with zeros where this rank has nothing to add)."""
    import torch.distributed as dist

    meshes = row_shard_meshes(params)
    if not meshes:
        if error is not None:
            raise error
        return {}
    reduced: dict[int, torch.Tensor] = {}
    member = f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "rank 0"
    for mesh, positions in meshes:
        device = local_tensor(params[positions[0]]).device
        failure_vote_on_group(mesh.get_group(), device, "Gefen dense-shard load", error, member=member)
        pieces = [sums.get(p, torch.zeros(int(params[p].shape[1]), dtype=torch.float64)).to(device) for p in positions]
        packet = torch.cat(pieces)
        dist.all_reduce(packet, op=dist.ReduceOp.SUM, group=mesh.get_group())
        offset = 0
        for position in positions:
            cols = int(params[position].shape[1])
            reduced[position] = packet[offset : offset + cols].cpu()
            offset += cols
    return reduced


class GefenDenseShard(BoundLayoutHook):
    """Mixin of ``Gefen``: the ``DenseShardCodec`` Protocol and its optional extensions."""

    def _dense_shard_status(self: _Host) -> FeatureStatus:
        """Whether ``dense_shard_codec`` is supported now, with the reasons when not (cheap)."""
        reasons: list[str] = []
        sealed = self._bound_layout()
        if sealed is None:
            reasons.extend(naming_blockers(self.param_groups))
        elif any(s.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD for _, s in sealed.bindings):
            reasons.append(
                "flattened element shards have no DTensor geometry for DCP to reshard; save them as portable state "
                "(gefen_dcp.save_portable_dcp)"
            )
        else:
            reasons.append(
                "a post_sharding layout is checkpointed as portable state (gefen_dcp.save_portable_dcp), which keys "
                "it by its sealed shard identities; the dense-shard codec covers optimizers built on named plain or "
                "DTensor (FSDP2) parameters"
            )
        reasons.extend(option_blockers(self.param_groups, "dense-shard"))
        return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

    def _dense_pieces(self: _Host) -> dict[str, tuple[NamedSlot, str, dict[str, int], CompactPiece | None]]:
        pieces = {}
        for slot in named_slots(self.param_groups, self._bound_layout()):
            assert slot.tensor is not None
            shape = tuple(local_tensor(slot.tensor).shape)
            variant, counters, piece = live_piece(self.state.get(slot.tensor), shape, self._codebook)
            pieces[slot.fqn] = (slot, variant, counters, piece)
        return pieces

    def dense_shard_common(self: _Host) -> dict[str, Any]:
        """``{"schema_version", "global_step", "deterministic"}`` (identical on every rank)."""
        require_feature(FEATURE_DENSE_SHARD_CODEC, self._dense_shard_status())
        return dense_common(self.global_step, self._deterministic)

    def dense_shard_slots(self: _Host) -> tuple[DenseShardSlot, ...]:
        """One slot per parameter in ``(group, slot)`` order: options, variant, counters and
        field names (nothing is materialised)."""
        require_feature(FEATURE_DENSE_SHARD_CODEC, self._dense_shard_status())
        slots = []
        for fqn, (slot, variant, counters, piece) in self._dense_pieces().items():
            options = transport_options(self.param_groups[slot.group_index])
            fields = piece.fields if piece is not None else ()
            slots.append(DenseShardSlot(fqn, slot.tensor, options, variant, counters, fields))
        return tuple(slots)

    def materialize_dense_field(self: _Host, fqn: str, field: str) -> torch.Tensor:
        """A fresh fp32 CPU copy of one field of ``fqn``'s local shard (``KeyError`` when absent)."""
        return stateful_piece(self._dense_pieces()[fqn][3], f"parameter {fqn!r}", field).dense(field)

    def materialize_dense_field_rows(self: _Host, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of :meth:`materialize_dense_field`, decoding only those rows."""
        return stateful_piece(self._dense_pieces()[fqn][3], f"parameter {fqn!r}", field).dense(field, start, stop)

    def dense_shard_snapshot(self: _Host) -> FrozenDenseShards:
        """A frozen host copy of the compact state (about one byte per element) serving the
        dense fields as they are now, whatever the optimizer does next."""
        return FrozenDenseShards({fqn: p[3] for fqn, p in self._dense_pieces().items() if p[3] is not None})

    def prepare_dense_shard_load(
        self: _Host, common: Mapping[str, Any], slots: Mapping[str, DenseShardLoad]
    ) -> StagedTransaction:
        """Re-block, re-encode and stage loaded dense shards for the live layout (no mutation).

        Collective over the device mesh of any row-sharded 2-D parameter (one vote, one
        ``all_reduce``); every rank of the mesh must call it. Raises
        :class:`~gefen_contracts.StateValidationError` (or, when a rank failed before the
        collective, :class:`~gefen_contracts.CollectiveFailureError` on every rank).
        """
        named = [s for s in named_slots(self.param_groups, self._bound_layout()) if s.tensor is not None]
        params = [s.tensor for s in named if s.tensor is not None]
        error: BaseException | None = None
        plans: list[_LoadPlan] = []
        codebook: torch.Tensor | None = None
        global_step = 0
        try:
            require_feature(FEATURE_DENSE_SHARD_CODEC, self._dense_shard_status())
            global_step = check_dense_common(common, self._deterministic, _WHO)
            live = {s.fqn for s in named}
            if set(slots) != live:
                missing, extra = sorted(live - set(slots)), sorted(set(slots) - live)
                raise _fail(
                    f"the loaded parameters differ from the live ones (missing {missing[:5]}, unexpected {extra[:5]})"
                )
            plans = [_plan_load(self.param_groups, slot, slots[slot.fqn], global_step) for slot in named]
            codebook = learn_momentum_codebook(
                [(p.piece.momentum, p.choice.period) for p in plans if p.piece is not None and p.choice is not None],
                self._dispatch,
                deterministic=self._deterministic,
            )
        except Exception as exc:
            error = exc
        local_sums = {i: p.factored[1] for i, p in enumerate(plans) if p.factored is not None}
        reduced = _reduce_column_sums(params, local_sums, error)
        mesh = learning_mesh(params) if row_shard_meshes(params) else None
        if mesh is not None:  # errors were voted on above: every rank of the mesh is here
            codebook = codebook_of_first_member(codebook, mesh)
        entries: dict[tuple[int, int], dict[str, Any]] = {}
        records: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in self.param_groups]
        for position, plan in enumerate(plans):
            slot = plan.slot
            records[slot.group_index].append((slot.fqn, plan.recorded))
            if plan.piece is None or plan.choice is None:
                continue
            param = params[position]
            local = local_tensor(param)
            factors = None
            if plan.factored is not None and position in reduced:
                global_rows = max(int(param.shape[0]), 1)
                factors = (plan.factored[0].to(torch.float32), (reduced[position] / global_rows).to(torch.float32))
            elif plan.options["factored_v_2d"] and param.dim() == 2:
                rows, cols = local.shape
                factors = complete_factors(plan.piece, rows, cols)
            assert slot.live_index is not None
            entries[(slot.group_index, slot.live_index)] = native_entry(
                plan.piece, plan.choice.period, codebook, param=param, factors=factors
            )
        groups = adopted_groups(self.param_groups, records)
        record_fields = {
            "global_step": global_step,
            "codebook": codebook,
            "deterministic": self._deterministic,
        }
        native = native_state_dict(F.FORMAT, groups, positional_state(groups, entries), record_fields)
        try:
            inner = self.stage_state_dict(self._with_identity_guard(native))
        except StateValidationError as exc:
            raise _fail(str(exc)) from None
        return StagedTransaction(self, kind=LOAD_KIND, token=self._version, payload=inner)

    def commit_dense_shard_load(self: _Host, staged: StagedTransaction) -> None:
        """Publish a staged load by the native load's swaps (``StaleTransactionError`` and no
        change for a foreign, consumed or stale one)."""
        inner = require_transaction(staged).claim(self, kind=LOAD_KIND, current_token=self._version)
        assert isinstance(inner, StagedTransaction)
        self.commit_staged_state_dict(inner)


@dataclass(frozen=True, slots=True, eq=False)
class _LoadPlan:
    """One live slot's loaded record: recorded and normalised options, the validated piece,
    its period, and (row-sharded factored targets) the float64 row means and column sums."""

    slot: NamedSlot
    recorded: dict[str, Any]
    options: dict[str, Any]
    piece: IncomingPiece | None
    choice: PeriodChoice | None
    factored: tuple[torch.Tensor, torch.Tensor] | None


def _plan_load(
    param_groups: Sequence[Mapping[str, Any]], slot: NamedSlot, load: DenseShardLoad, global_step: int
) -> _LoadPlan:
    where = f"parameter {slot.fqn!r}"
    if type(load) is not DenseShardLoad or load.fqn != slot.fqn:
        raise _fail(f"{where}: expected a DenseShardLoad for it")
    recorded, options = slot_options(load.options, where)
    param = slot.tensor
    assert param is not None
    local = local_tensor(param)
    global_shape = tuple(int(d) for d in param.shape)
    piece = check_incoming(
        slot.fqn,
        load.variant,
        load.counters,
        load.fields,
        {},
        piece_shape=tuple(local.shape),
        flat_offset=0,
        global_shape=global_shape,
        global_step=global_step,
    )
    if piece is None:
        return _LoadPlan(slot, recorded, options, None, None, None)
    names = param_groups[slot.group_index].get("param_names")
    name = None if names is None or slot.live_index is None else str(names[slot.live_index])
    policy = period_policy(options)
    if is_row_sharded(param):
        # every rank must cut the blocks the shape rule cuts: the state is a DTensor
        period = policy.resolve(name, global_shape, local.numel(), row_sharded=True)
        choice = PeriodChoice(period, False, False, "rule")
    else:
        choice = plan_piece(piece, search_shape=global_shape, policy=policy, name=name, ndim=param.dim(), codebook=None)
    factored = None
    if options["factored_v_2d"] and param.dim() == 2 and is_row_sharded(param):
        rows, cols = local.shape
        factored = factored_statistics(piece.second_moment().view(rows, cols))
    return _LoadPlan(slot, recorded, options, piece, choice, factored)

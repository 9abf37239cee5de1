"""``GefenDCPState``: an optimizer's dense-shard state as a DCP ``Stateful``.

Put it beside the model in one ``dcp.save`` / ``dcp.load``::

    dcp.save({"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
             storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner())
    dcp.load({"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
             checkpoint_id=path, planner=GefenLoadPlanner())

It works for any optimizer implementing :class:`gefen_contracts.DenseShardCodec`: each
parameter's dense fp32 fields are saved at its DTensor shard's global offsets, so DCP
reshards them onto any later layout (N ranks to M), and the codec compresses the loaded
dense shards back into its own state.
"""

from __future__ import annotations

from typing import Any

from gefen_contracts import (
    FEATURE_DENSE_SHARD_CODEC,
    ContractProvider,
    DenseShardCodec,
    DenseShardSlot,
    FrozenMap,
    PortableStateLimits,
    StagedTransaction,
)
from gefen_contracts.torch_support import failure_vote
from gefen_contracts.validation import exact_int
from torch.distributed.checkpoint.stateful import Stateful

from .canonical_json import dump_canonical
from .collective import agree_layout, checkpoint_binding, member_coordinate
from .envelope import DenseShardEnvelope, ParameterEntry, field_name
from .errors import CheckpointLayoutError, PlannerRequiredError
from .geometry import shard_geometry
from .load_session import LoadSession
from .save_session import SaveSession, SlotLayout
from .standins import GefenDenseShardStateDict

__all__ = ["GefenDCPState"]

_MIN_DEFAULT_CHUNK_BYTES = 256 << 10


def _implementation(optimizer: object) -> str:
    if isinstance(optimizer, ContractProvider):
        contract = optimizer.optimizer_contract()
        contract.require(FEATURE_DENSE_SHARD_CODEC)
        return contract.implementation
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


class GefenDCPState(Stateful):
    """A ``torch.distributed.checkpoint.stateful.Stateful`` over a dense-shard codec.

    ``process_group`` is the group DCP saves and loads with (``None``: the default world);
    ``state_dict()`` and ``load_state_dict()`` are collective over it. ``chunk_bytes`` caps
    each written chunk; by default it is a sixteenth of a byte per local element (so a
    chunk and its decode transient stay well under half a byte per parameter), clamped to
    ``[256 KiB, limits.chunk_bytes]``. ``limits`` bound what a load may allocate and parse.

    Promises:

    * ``state_dict()`` votes on the local checks and makes every member agree on the
      layout (FQNs, global shapes, options, variants, counters, field names) before DCP
      plans anything; it materialises nothing. Dense fields are produced one chunk at a
      time while the writer consumes them.
    * ``load_state_dict()`` (after a load with :class:`~gefen_dcp.GefenLoadPlanner`)
      authenticates the envelope, verifies every chunk read against its recorded SHA-256,
      stages the codec's load and commits only if every member succeeded (group-voted);
      on any failure the optimizer is unchanged on every member.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        process_group: Any = None,
        chunk_bytes: int | None = None,
        limits: PortableStateLimits | None = None,
    ) -> None:
        if not isinstance(optimizer, DenseShardCodec):
            raise TypeError(
                f"GefenDCPState needs an optimizer implementing gefen_contracts.DenseShardCodec, got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.process_group = process_group
        self.limits = limits if limits is not None else PortableStateLimits()
        if type(self.limits) is not PortableStateLimits:
            raise TypeError("GefenDCPState limits must be a gefen_contracts.PortableStateLimits")
        self.chunk_bytes = (
            None if chunk_bytes is None else exact_int(chunk_bytes, "GefenDCPState chunk_bytes", minimum=1)
        )

    def _session(self, writer: int) -> SaveSession:
        optimizer = self.optimizer
        implementation = _implementation(optimizer)
        common = dict(optimizer.dense_shard_common())
        dump_canonical(common, limits=self.limits, what="dense_shard_common()")
        slots = optimizer.dense_shard_slots()
        layouts: dict[str, SlotLayout] = {}
        entries = []
        for index, slot in enumerate(slots):
            if type(slot) is not DenseShardSlot:
                raise CheckpointLayoutError(f"dense_shard_slots()[{index}] must be a DenseShardSlot")
            if slot.fqn in layouts:
                raise CheckpointLayoutError(f"dense_shard_slots() lists {slot.fqn!r} twice")
            fields = tuple(sorted(field_name(f, f"{slot.fqn!r} field") for f in slot.fields))
            geometry = shard_geometry(slot.parameter, where=f"parameter {slot.fqn!r}")
            layouts[slot.fqn] = SlotLayout(slot.fqn, slot.parameter, geometry, fields)
            entries.append(
                ParameterEntry(slot.fqn, geometry.global_shape, slot.options, slot.variant, slot.counters, fields)
            )
        envelope = DenseShardEnvelope(implementation, FrozenMap(common), tuple(sorted(entries, key=lambda e: e.fqn)))
        chunk_bytes = self.chunk_bytes
        if chunk_bytes is None:
            local = sum(layout.geometry.numel for layout in layouts.values())
            chunk_bytes = min(self.limits.chunk_bytes, max(_MIN_DEFAULT_CHUNK_BYTES, local // 16))
        return SaveSession(
            envelope=envelope,
            slots=layouts,
            source=optimizer,
            writer=writer,
            chunk_bytes=chunk_bytes,
            limits=self.limits,
        )

    def state_dict(self) -> dict[str, Any]:
        """A lazy state dict (collective; see the class docstring). Nothing is materialised."""
        binding = checkpoint_binding(self.process_group)
        session: SaveSession | None = None
        error: BaseException | None = None
        try:
            session = self._session(member_coordinate(binding))
        except Exception as exc:
            error = exc
        failure_vote(binding, "gefen_dcp.state_dict", error)
        assert session is not None
        agree_layout(binding, session.envelope.digest())
        return GefenDenseShardStateDict(session)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Verify, stage and (if every member succeeded) commit a loaded state (collective)."""
        if not isinstance(state_dict, GefenDenseShardStateDict) or not isinstance(state_dict.load_session, LoadSession):
            raise PlannerRequiredError(
                "GefenDCPState.load_state_dict needs a state dict filled by dcp.load(..., planner=GefenLoadPlanner())"
            )
        binding = checkpoint_binding(self.process_group)
        error: BaseException | None = None
        common: dict[str, Any] = {}
        loads: dict[str, Any] = {}
        try:
            _envelope, common, loads = state_dict.load_session.finish()
        except Exception as exc:
            error = exc
        failure_vote(binding, "gefen_dcp.load_state_dict.verify", error)
        staged: StagedTransaction | None = None
        try:
            staged = self.optimizer.prepare_dense_shard_load(common, loads)
            if type(staged) is not StagedTransaction:
                raise TypeError("prepare_dense_shard_load must return a gefen_contracts.StagedTransaction")
        except Exception as exc:
            error = exc
        failure_vote(binding, "gefen_dcp.load_state_dict.prepare", error)
        assert staged is not None
        self.optimizer.commit_dense_shard_load(staged)
        state_dict.load_session = None

"""DCP planners that handle :class:`~gefen_dcp.GefenDCPState` entries (and everything else
exactly like DCP's defaults).

:class:`GefenSavePlanner` plans the state tensors of a :class:`~gefen_dcp.GefenDCPState`
like any tensor, digests each chunk as it is resolved for the writer, tells the state which
chunks this rank writes once DCP's global plan is final, and orders each rank's writes so
its digest table comes after its chunks.

:class:`GefenLoadPlanner` plans a DCP state from the checkpoint's metadata (a fresh
optimizer holds no state tensors to load into; their keys and shapes are only known
there): it validates everything before allocating, reads whole stored chunks that overlap
this rank's boxes into scratch buffers, hashes and copies them, and lets DCP's default
machinery load every other entry.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from gefen_contracts.limits import PortableStateLimits
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem

from .digest_table import ChunkKey
from .errors import CheckpointIntegrityError
from .load_session import LoadSession
from .save_session import SaveSession
from .standins import DigestTableStandIn, EnvelopeStandIn, GefenDCPStateDict, StandIn

__all__ = ["GefenLoadPlanner", "GefenSavePlanner"]


class GefenSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` plus digested writes of :class:`~gefen_dcp.GefenDCPState` entries.

    Accepts ``DefaultSavePlanner``'s arguments; ``flatten_state_dict`` must stay ``True``
    (unflattened, a stand-in would become one opaque pickled item) and
    ``enable_plan_caching`` ``False`` (``ValueError`` otherwise).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.flatten_state_dict:
            raise ValueError("GefenSavePlanner needs flatten_state_dict=True to plan GefenDCPState entries")
        if getattr(self, "_enable_plan_caching", False):
            raise ValueError(
                "GefenSavePlanner does not support enable_plan_caching=True (stand-ins are planned afresh each save)"
            )
        self._standins: dict[str, StandIn] = {}
        self._tensors: dict[str, tuple[SaveSession, str]] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        self._standins = {key: value for key, value in self.state_dict.items() if isinstance(value, StandIn)}
        # Found through the stand-ins, which any staging keeps, so the tensors map to their
        # session even when a stock writer's staging copied them into plain dicts.
        prefixes = {
            tuple(str(p) for p in self.mappings[flat][:-1]): standin.session
            for flat, standin in self._standins.items()
            if isinstance(standin, EnvelopeStandIn)
        }
        self._tensors = {}
        for flat, key_path in self.mappings.items():
            path = tuple(str(p) for p in key_path)
            session = prefixes.get(path[:-3])
            if session is not None and len(path) >= 3 and path[-3] == "tensors" and path[-1] in session.tensors:
                self._tensors[flat] = (session, path[-1])
                session.tensors[path[-1]] = self.state_dict[flat]  # a staged copy, if a writer staged one
        for session in self._sessions():
            session.bind()

    def _sessions(self) -> list[SaveSession]:
        seen: dict[int, SaveSession] = {}
        for standin in self._standins.values():
            seen.setdefault(id(standin.session), standin.session)
        return list(seen.values())

    def _tensor(self, item: WriteItem) -> tuple[SaveSession, str, tuple[int, ...]] | None:
        found = self._tensors.get(item.index.fqn)
        if found is None:
            return None
        return found[0], found[1], tuple(int(o) for o in (item.index.offset or ()))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan, without keeping every rank's plan on the coordinator.

        ``DefaultSavePlanner`` keeps the global plan (every rank's write items) as
        ``self.global_plan`` for the whole save, only for plan caching, which this planner
        does not use; dropped, the other ranks' items are freed once DCP has scattered them,
        so the coordinator writes with only its own plan and the metadata.
        """
        plans, metadata = super().create_global_plan(all_plans)
        self.global_plan = []
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        written: dict[int, set[ChunkKey]] = {id(s): set() for s in self._sessions()}
        for item in plan.items:
            found = self._tensor(item)
            if found is not None:
                session, key, offsets = found
                written[id(session)].add((key, offsets))
        for session in self._sessions():
            session.mark_written(written[id(session)])
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        standin = self._standins.get(write_item.index.fqn)
        if standin is not None:
            return standin.resolve(write_item)
        data = super().resolve_data(write_item)
        found = self._tensor(write_item)
        if found is None:
            return data
        session, key, offsets = found
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{write_item.index.fqn}: a GefenDCPState tensor resolved to {type(data).__name__}")
        return session.record(key, offsets, data)

    def write_phases(self, items: Sequence[WriteItem]) -> tuple[list[WriteItem], list[WriteItem]]:
        """``(first, last)``: a writer that writes ``last`` after everything in ``first`` (as
        :class:`~gefen_dcp.GefenFileSystemWriter` does) lets each chunk be materialised once,
        since a digest table then only reports digests already computed."""
        tables = [i for i in items if isinstance(self._standins.get(i.index.fqn), DigestTableStandIn)]
        rest = [i for i in items if not isinstance(self._standins.get(i.index.fqn), DigestTableStandIn)]
        return rest, tables


def _find_states(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], GefenDCPStateDict]]:
    if isinstance(value, GefenDCPStateDict):
        yield path, value
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _find_states(item, (*path, str(key)))


class GefenLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` plus dynamic, verified loads of :class:`~gefen_dcp.GefenDCPState` entries.

    ``limits`` bound what the metadata may ask this rank to allocate (defaults:
    :class:`gefen_contracts.limits.PortableStateLimits`). Non-tensor entries load with
    ``torch.load(weights_only=True)`` (DCP's default planner unpickles them unrestricted);
    read ``.metadata`` with :class:`~gefen_dcp.GefenFileSystemReader` so that nothing in
    the checkpoint runs.
    """

    def __init__(self, *args: Any, limits: PortableStateLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.flatten_state_dict:
            raise ValueError("GefenLoadPlanner needs flatten_state_dict=True to find GefenDCPState entries")
        self.limits = limits if limits is not None else PortableStateLimits()
        self._sessions: list[LoadSession] = []
        self._by_key: dict[str, LoadSession] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None:
            raise ValueError("GefenLoadPlanner needs the checkpoint metadata")
        self._sessions, self._by_key = [], {}
        for path, target in list(_find_states(state_dict, ())):
            session = LoadSession(path=path, live=target.session, metadata=metadata, limits=self.limits)
            target.load_session = session
            target["envelope"] = session.envelope_buffer
            target["digests"] = dict(session.table_buffers)
            target["tensors"] = {}  # read by this planner, not the default machinery
            self._sessions.append(session)
            for key in session.keys:
                self._by_key[key] = session
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        extra = [item for session in self._sessions for item in session.read_items()]
        return dataclasses.replace(plan, items=[*plan.items, *extra])

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """A non-tensor entry (a model's extra state, a step count): loaded with
        ``weights_only=True``, where DCP's default unpickles anything (and so runs code)."""
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as error:
            raise CheckpointIntegrityError(
                f"{fqn}: the stored bytes are not tensors and primitives (refused by torch.load(weights_only=True)): "
                f"{type(error).__name__}: {str(error)[:200]}"
            ) from None
        set_element(self.original_state_dict, self.mappings[fqn], loaded)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        session = self._by_key.get(read_item.dest_index.fqn)
        if session is None:
            return super().resolve_tensor(read_item)  # type: ignore[no-any-return]
        return session.resolve(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        session = self._by_key.get(read_item.dest_index.fqn)
        if session is None:
            super().commit_tensor(read_item, tensor)
            return
        session.commit(read_item, tensor)

"""What ``GefenDCPState.state_dict()`` hands to DCP: the state tensors themselves, and two
lazy stand-ins for the records that are not tensors.

A stand-in (the envelope, this rank's digest table) implements DCP's planning hook
``__create_write_items__`` and produces its bytes only when
:class:`~gefen_dcp.GefenSavePlanner` resolves its write item; the digest table is written
after every chunk it describes.

Copying the state dict (``copy.deepcopy``, which DCP's staging for ``dcp.async_save``
does) freezes it: the copy holds CPU copies of the state tensors taken at that moment,
shared by all of its entries. Pickling a stand-in is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .errors import PlannerRequiredError
from .save_session import SaveSession

__all__ = [
    "DigestTableStandIn",
    "EnvelopeStandIn",
    "GefenDCPStateDict",
    "StandIn",
]

_HINT = (
    "save GefenDCPState with dcp.save(..., planner=GefenSavePlanner()) and load it with "
    "dcp.load(..., planner=GefenLoadPlanner())"
)


def _bytes_item(key: str, nbytes: int) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(key, torch.Size([0])),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([nbytes])),
            properties=TensorProperties(dtype=torch.uint8),
            size=torch.Size([nbytes]),
        ),
    )


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class StandIn:
    """Base of the stand-ins: planner binding checks, copy-freezes, no pickling."""

    __slots__ = ("session",)

    def __init__(self, session: SaveSession) -> None:
        self.session = session

    def _require_planner(self, key: str) -> None:
        if not self.session.bound:
            raise PlannerRequiredError(f"{key!r} is a GefenDCPState stand-in and needs the Gefen planners: {_HINT}")

    def size(self) -> torch.Size:
        """Reached only by DCP's default load planner, which cannot load a stand-in."""
        raise PlannerRequiredError(f"a GefenDCPState stand-in reached a DCP planner that cannot load it: {_HINT}")

    def __create_write_items__(self, key: str, obj: object) -> list[WriteItem]:
        raise NotImplementedError

    def resolve(self, item: WriteItem) -> torch.Tensor:
        raise NotImplementedError

    def frozen(self, memo: dict[int, Any]) -> StandIn:
        raise NotImplementedError

    def __deepcopy__(self, memo: dict[int, Any]) -> StandIn:
        return self.frozen(memo)

    def __copy__(self) -> StandIn:
        return self

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(
            f"a GefenDCPState stand-in cannot be pickled (it would be saved as an opaque BYTE_IO object); {_HINT} "
            f"and keep flatten_state_dict=True"
        )


class EnvelopeStandIn(StandIn):
    """The envelope (identical on every rank; DCP writes it once)."""

    __slots__ = ()

    def __create_write_items__(self, key: str, obj: object) -> list[WriteItem]:
        self._require_planner(key)
        return [_bytes_item(key, len(self.session.envelope_bytes))]

    def resolve(self, item: WriteItem) -> torch.Tensor:
        return _bytes_tensor(self.session.envelope_bytes)

    def frozen(self, memo: dict[int, Any]) -> EnvelopeStandIn:
        return EnvelopeStandIn(self.session.snapshot())

    def __repr__(self) -> str:
        return f"<EnvelopeStandIn {len(self.session.envelope_bytes)} bytes>"


class DigestTableStandIn(StandIn):
    """This rank's chunk digest table (written after its chunks)."""

    __slots__ = ()

    def __create_write_items__(self, key: str, obj: object) -> list[WriteItem]:
        self._require_planner(key)
        return [_bytes_item(key, self.session.table_nbytes())]

    def resolve(self, item: WriteItem) -> torch.Tensor:
        return _bytes_tensor(self.session.table_bytes())

    def frozen(self, memo: dict[int, Any]) -> DigestTableStandIn:
        return DigestTableStandIn(self.session.snapshot())

    def __repr__(self) -> str:
        return f"<DigestTableStandIn writer {self.session.writer}>"


class GefenDCPStateDict(dict[str, Any]):
    """The dict ``GefenDCPState.state_dict()`` returns (a plain ``dict`` to DCP).

    Keys: ``"envelope"``, ``"digests"`` (``{"writer_NNNNN": table}``) and ``"tensors"``
    (``{placement: {key: tensor}}``, see :mod:`gefen_dcp.envelope`). ``session`` is its
    save session; ``load_session`` is set by :class:`~gefen_dcp.GefenLoadPlanner` when DCP
    loads into it.
    """

    session: SaveSession
    load_session: Any

    def __init__(self, session: SaveSession) -> None:
        super().__init__()
        self.session = session
        self.load_session = None
        self["envelope"] = EnvelopeStandIn(session)
        self["digests"] = {writer_key(session.writer): DigestTableStandIn(session)}
        self["tensors"] = session.tensor_tree()

    def __setitem__(self, key: str, value: Any) -> None:
        # DCP's default load planner replaces every value it does not know with None before
        # planning (its own error would then be a metadata-type mismatch): name the planner.
        if value is None and isinstance(self.get(key), StandIn):
            raise PlannerRequiredError(
                f"this checkpoint holds a GefenDCPState: load it with dcp.load(..., planner=GefenLoadPlanner()) "
                f"({_HINT})"
            )
        super().__setitem__(key, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> GefenDCPStateDict:
        return GefenDCPStateDict(self.session.snapshot())

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(f"a GefenDCPState state dict cannot be pickled; {_HINT}")


def writer_key(writer: int) -> str:
    """The key of a writer's digest table (``writer_00003``)."""
    return f"writer_{writer:05d}"


__all__.append("writer_key")

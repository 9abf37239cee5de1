"""``GefenDCPState``: an optimizer's own compact state as a verified DCP ``Stateful``.

Put it beside the model in one ``dcp.save`` / ``dcp.load``::

    dcp.save({"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
             storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner())
    dcp.load({"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
             storage_reader=GefenFileSystemReader(path), planner=GefenLoadPlanner())

It saves ``optimizer.state_dict()`` as it is, so a Gefen optimizer's checkpoint is about 1
byte per parameter: every state tensor is a DCP item at its local shard's global offsets
(DTensors placed like their parameters under FSDP2), which DCP reshards onto any later
layout (N ranks to M) bit for bit; everything else is one verified envelope. On top of
plain ``dcp.save(optimizer.state_dict())`` it adds: every chunk's SHA-256 checked on load,
group-voted all-or-nothing loads that never half-change the optimizer, loads into a fresh
optimizer (no initialising step), crash-safe overwrites and async snapshots (with
:class:`~gefen_dcp.GefenFileSystemWriter`).

It works for any optimizer that implements :class:`gefen_contracts.protocols.StagedNativeLoad` and
whose state tensors are placed like their parameters, replicated on their parameters'
mesh, or plain tensors equal on every rank (the contract feature
``parameter_shaped_state``).
"""

from __future__ import annotations

from typing import Any

from gefen_contracts import FEATURE_PARAMETER_SHAPED_STATE, OptimizerContract, StateGeometry, StateScope
from gefen_contracts.enums import ParameterLayout, ParameterStateRole, StateExtent
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.protocols import ContractProvider, ModeTaggedState, StagedNativeLoad
from gefen_contracts.torch_support import failure_vote
from gefen_contracts.transactions import StagedTransaction
from torch.distributed.checkpoint.stateful import Stateful

from .collective import agree_layout, checkpoint_binding, member_coordinate, shared_save_id
from .envelope import LIKE_PARAMETER, PLAIN, REPLICATED, DcpStateEnvelope, TensorEntry
from .errors import CheckpointLayoutError, PlannerRequiredError
from .geometry import is_dtensor
from .load_session import LoadSession
from .row_packs import pack_rows
from .save_session import SaveSession
from .skeleton import parameter_index, split
from .standins import GefenDCPStateDict

__all__ = ["GefenDCPState"]


def _implementation(optimizer: object, contract: OptimizerContract | None) -> str:
    if contract is not None:
        contract.require(FEATURE_PARAMETER_SHAPED_STATE)
        return contract.implementation
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def _field_geometry(contract: OptimizerContract | None) -> dict[str, str]:
    """Per-parameter state field name -> its declared geometry (from the contract, children included)."""
    if contract is None:
        return {}
    geometry: dict[str, str] = {}
    pending = [contract]
    while pending:
        contract = pending.pop()
        for field in contract.state_layout.fields:
            if field.scope is StateScope.PARAMETER:
                geometry.setdefault(field.name, field.geometry.value)
        pending.extend(child.contract for child in contract.children if child.contract is not None)
    return geometry


def _held_whole(optimizer: object, contract: OptimizerContract | None, parameters: tuple[Any, ...]) -> frozenset[int]:
    """The DTensor parameters (by index) whose state ``optimizer`` keeps whole on every rank.

    Read from its contract: every state variant it declares for a DTensor parameter of that
    rank, under the parameter's mode tags, describes the whole parameter (GefenMuon's
    ``sharded_mode="exact"``). A load reads such a parameter's state whole, whatever placement
    class the checkpoint recorded (a single-process save records the declared geometry's).
    """
    if contract is None or not any(is_dtensor(p) for p in parameters):
        return frozenset()
    variants = contract.state_layout.parameter_variants
    whole = set()
    for index, parameter in enumerate(parameters):
        if not is_dtensor(parameter):
            continue
        tags = optimizer.state_mode_tags(parameter) if isinstance(optimizer, ModeTaggedState) else frozenset()
        extents = {
            v.extent
            for v in variants
            if v.accepts(
                layout=ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
                parameter_rank=parameter.dim(),
                role=ParameterStateRole.ANY,
                mode_tags=tags,
            )
        }
        if extents == {StateExtent.GLOBAL_PARAMETER}:
            whole.add(index)
    return frozenset(whole)


def _placement(key: str, tensor: Any, parameters: tuple[Any, ...], geometry: dict[str, str]) -> str:
    """The placement class of one state tensor (``CheckpointLayoutError`` if it has none).

    A DTensor is placed like its parameter or replicated on its mesh. A plain tensor of a
    DTensor parameter is whole on every rank (``plain``). A plain tensor of a plain parameter
    (a single-process save) takes the class its declared geometry gives it under sharding:
    per-column state is replicated, parameter-, row- and block-shaped state follows the
    parameter's rows, scalars and tables are plain; an undeclared field follows the rows
    when its first dimension is the parameter's.
    """
    index = parameter_index(key)
    parameter = parameters[index] if index is not None and index < len(parameters) else None
    if is_dtensor(tensor):
        if parameter is None or not is_dtensor(parameter):
            raise CheckpointLayoutError(f"state tensor {key!r} is a DTensor but does not belong to a DTensor parameter")
        if tensor.device_mesh != parameter.device_mesh:
            raise CheckpointLayoutError(f"state tensor {key!r} is not on its parameter's device mesh")
        if tuple(tensor.placements) == tuple(parameter.placements):
            return LIKE_PARAMETER
        if all(p.is_replicate() for p in tensor.placements):
            return REPLICATED
        raise CheckpointLayoutError(
            f"state tensor {key!r} is placed {tuple(tensor.placements)}, neither like its parameter "
            f"{tuple(parameter.placements)} nor replicated"
        )
    if parameter is None or is_dtensor(parameter):
        return PLAIN
    declared = geometry.get(key.rsplit("/", 1)[-1])
    if declared == StateGeometry.COLUMN.value:
        return REPLICATED
    if declared in (StateGeometry.SCALAR.value, StateGeometry.TABLE.value, StateGeometry.OPAQUE.value):
        return PLAIN
    if declared is not None:
        return LIKE_PARAMETER
    rows_follow = tensor.dim() >= 1 and parameter.dim() >= 1 and tensor.shape[0] == parameter.shape[0]
    return LIKE_PARAMETER if rows_follow else PLAIN


_NESTED = (
    "put GefenDCPState at the top level of the state dict given to dcp.save / dcp.load (e.g. "
    "{'optimizer': GefenDCPState(opt)}); DCP calls state_dict() only on top-level Stateful values and would "
    "pickle a nested one whole"
)


class GefenDCPState(Stateful):
    """A ``torch.distributed.checkpoint.stateful.Stateful`` over an optimizer's native state.

    ``process_group`` is the group DCP saves and loads with (``None``: the default world);
    ``state_dict()`` and ``load_state_dict()`` are collective over it. ``limits`` bound what
    a load may allocate and parse.

    Promises:

    * ``state_dict()`` votes on the local checks and makes every member agree on the
      envelope (a fresh ``save_id`` broadcast from member 0, implementation, state-dict
      skeleton, tensor dtypes, shapes and placements) before DCP plans anything; it copies
      nothing. Every writer's digest table repeats the ``save_id``, so a load refuses data
      files mixed from two saves.
    * ``load_state_dict()`` (after a load with :class:`~gefen_dcp.GefenLoadPlanner`)
      authenticates the envelope, verifies every chunk read against its recorded SHA-256,
      stages the optimizer's native load and commits only if every member succeeded
      (group-voted); on any failure the optimizer is unchanged on every member.
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        process_group: Any = None,
        limits: PortableStateLimits | None = None,
    ) -> None:
        if not isinstance(optimizer, StagedNativeLoad) or not callable(getattr(optimizer, "state_dict", None)):
            raise TypeError(
                f"GefenDCPState needs an optimizer implementing gefen_contracts.protocols.StagedNativeLoad, got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.process_group = process_group
        self.limits = limits if limits is not None else PortableStateLimits()
        if type(self.limits) is not PortableStateLimits:
            raise TypeError("GefenDCPState limits must be a gefen_contracts.limits.PortableStateLimits")

    def _session(self, writer: int, save_id: str) -> SaveSession:
        optimizer = self.optimizer
        # built once: the implementation, the fields' geometry and the whole-held parameters read it
        contract = optimizer.optimizer_contract() if isinstance(optimizer, ContractProvider) else None
        implementation = _implementation(optimizer, contract)
        parameters = tuple(p for group in optimizer.param_groups for p in group["params"])  # type: ignore[attr-defined]
        skeleton, tensors = split(optimizer.state_dict())  # type: ignore[attr-defined]
        geometry = _field_geometry(contract)
        placements = {key: _placement(key, tensor, parameters, geometry) for key, tensor in tensors.items()}
        stored, packs = pack_rows(tensors, placements, geometry)
        entries = {}
        for key, tensor in stored.items():
            members = tuple((m.key, m.trailing) for m in packs.get(key, ()))
            placement = LIKE_PARAMETER if members else placements[key]
            entries[key] = TensorEntry(tensor.dtype, tuple(int(d) for d in tensor.shape), placement, members)
        envelope = DcpStateEnvelope(implementation, skeleton, entries, save_id)
        return SaveSession(
            envelope=envelope,
            tensors=stored,
            parameters=parameters,
            writer=writer,
            limits=self.limits,
            held_whole=_held_whole(optimizer, contract, parameters),
        )

    # DCP calls state_dict() only on a Stateful at the top level of the dict it saves; a nested
    # one would be pickled whole (optimizer and parameters) as one opaque item no load accepts
    def __create_write_items__(self, key: str, obj: object) -> list[Any]:
        raise PlannerRequiredError(f"{key}: {_NESTED}")

    def __reduce_ex__(self, protocol: object) -> Any:
        raise TypeError(f"a GefenDCPState cannot be pickled: {_NESTED}")

    def state_dict(self) -> dict[str, Any]:
        """The state dict DCP saves (collective; see the class docstring). Nothing is copied but
        the small per-row fields packed side by side (:mod:`gefen_dcp.row_packs`)."""
        binding = checkpoint_binding(self.process_group)
        save_id = shared_save_id(binding)
        session: SaveSession | None = None
        error: BaseException | None = None
        try:
            session = self._session(member_coordinate(binding), save_id)
        except Exception as exc:
            error = exc
        failure_vote(binding, "gefen_dcp.state_dict", error)
        assert session is not None
        agree_layout(binding, session.envelope.digest())
        return GefenDCPStateDict(session)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Verify, stage and (if every member succeeded) commit a loaded state (collective)."""
        if not isinstance(state_dict, GefenDCPStateDict) or not isinstance(state_dict.load_session, LoadSession):
            raise PlannerRequiredError(
                "GefenDCPState.load_state_dict needs a state dict filled by dcp.load(..., planner=GefenLoadPlanner())"
            )
        binding = checkpoint_binding(self.process_group)
        error: BaseException | None = None
        native: dict[str, Any] = {}
        try:
            _envelope, native = state_dict.load_session.finish()
        except Exception as exc:
            error = exc
        failure_vote(binding, "gefen_dcp.load_state_dict.verify", error)
        staged: StagedTransaction | None = None
        try:
            staged = self.optimizer.stage_state_dict(native)
            if type(staged) is not StagedTransaction:
                raise TypeError("stage_state_dict must return a gefen_contracts.transactions.StagedTransaction")
        except Exception as exc:
            error = exc
        failure_vote(binding, "gefen_dcp.load_state_dict.prepare", error)
        assert staged is not None
        self.optimizer.commit_staged_state_dict(staged)
        state_dict.load_session = None

"""Runtime bindings from a semantic :class:`ProcessGroupIdentity` to a live process group.

One class, one rule set (the reference had two near-identical classes with divergent
backend rules, so a valid checkpoint binding could never equal a valid codebook binding).
The two public names are purpose-labelled subclasses: a codebook scope and a checkpoint
scope compare by :meth:`ProcessGroupBinding.same_scope`, regardless of label.

Backend/device table (applied by :meth:`ProcessGroupBinding.validate_runtime`):

=======  ===========================
backend  collective device
=======  ===========================
nccl     CUDA (explicit, existing index)
gloo     CPU or CUDA
mpi      CPU
other    CPU or CUDA
=======  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ContractError, ContractTypeError
from ..identity import ProcessGroupIdentity

__all__ = ["CheckpointProcessGroupBinding", "CodebookProcessGroupBinding", "ProcessGroupBinding"]


@dataclass(frozen=True, eq=False)
class ProcessGroupBinding:
    """A process group known by meaning (``identity``) and bound to a live handle.

    ``local_member`` is this process's member string. A one-member scope has no handle
    (``process_group=None``) and never runs a collective; a multi-member scope needs a
    real ``torch.distributed.ProcessGroup``. ``collective_device`` is where small control
    tensors live (``"cpu"`` or a CUDA device; strings are coerced).
    """

    identity: ProcessGroupIdentity
    local_member: str
    process_group: Any
    collective_device: torch.device

    def __post_init__(self) -> None:
        name = type(self).__name__
        if type(self.identity) is not ProcessGroupIdentity:
            raise ContractTypeError(f"{name}.identity must be a ProcessGroupIdentity")
        if type(self.local_member) is not str:
            raise ContractTypeError(f"{name}.local_member must be a str")
        self.identity.coordinate(self.local_member)
        try:
            device = torch.device(self.collective_device)
        except (TypeError, RuntimeError) as exc:
            raise ContractTypeError(f"{name}.collective_device is not a device: {exc}") from None
        if device.type not in ("cpu", "cuda"):
            raise ContractError(f"{name}.collective_device must be cpu or cuda, got {device.type}")
        object.__setattr__(self, "collective_device", device)
        members = len(self.identity.ordered_members)
        if members == 1:
            if self.process_group is not None:
                raise ContractError(f"a one-member {name} must have process_group=None (it never communicates)")
        else:
            import torch.distributed as dist

            if not dist.is_available() or not isinstance(self.process_group, dist.ProcessGroup):
                raise ContractTypeError(
                    f"a {members}-member {name} needs a torch.distributed.ProcessGroup handle "
                    f"(use dist.group.WORLD for the default world)"
                )

    def __deepcopy__(self, memo: dict[int, Any]) -> ProcessGroupBinding:
        # a handle to a live group: a deep-copied optimizer keeps the same group, as a
        # deep-copied DTensor keeps its device mesh
        return self

    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not None:
            raise TypeError(
                f"{type(self).__name__} {self.identity.semantic_name!r} holds a live process group, which cannot be "
                "pickled; pickle the optimizer's state_dict() instead (copy.deepcopy shares the group)"
            )
        return dict(self.__dict__)

    @property
    def sort_key(self) -> tuple[str, tuple[str, ...]]:
        """Rank-invariant order for entering several scopes deterministically."""
        return (self.identity.semantic_name, self.identity.ordered_members)

    @property
    def member_count(self) -> int:
        return len(self.identity.ordered_members)

    @property
    def coordinate(self) -> int:
        return self.identity.coordinate(self.local_member)

    @property
    def communicates(self) -> bool:
        """False for one-member scopes, which never run a collective."""
        return self.member_count > 1

    def same_scope(self, other: object) -> bool:
        """Equal identity and member, the same handle object and an equal device."""
        return (
            isinstance(other, ProcessGroupBinding)
            and other.identity == self.identity
            and other.local_member == self.local_member
            and other.process_group is self.process_group
            and other.collective_device == self.collective_device
        )

    def scope_record(self) -> dict[str, object]:
        """The rank-neutral primitive record stored in checkpoints (no handle, no device)."""
        return {
            "semantic_name": self.identity.semantic_name,
            "ordered_members": list(self.identity.ordered_members),
        }

    def validate_runtime(self) -> None:
        """Check, with local queries only, that the handle matches the identity.

        Raises ``RuntimeError`` naming the mismatch: distributed not initialized, group
        size different from the member count, this rank's coordinate not ``local_member``,
        or a backend/device combination outside the table in the module docstring.
        """
        name = type(self).__name__
        device = self.collective_device
        if device.type == "cuda":
            if device.index is None:
                raise RuntimeError(f"{name}.collective_device must name an explicit CUDA index")
            if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
                raise RuntimeError(f"{name}.collective_device {device} does not exist on this machine")
        if not self.communicates:
            return
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{name} needs torch.distributed to be initialized")
        group = self.process_group
        size = dist.get_world_size(group)
        if size != self.member_count:
            raise RuntimeError(f"{name}: the process group has {size} ranks but the identity has {self.member_count}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise RuntimeError(f"{name}: this process is not a member of the bound process group")
        if self.identity.ordered_members[rank] != self.local_member:
            raise RuntimeError(
                f"{name}: this process is group rank {rank} ({self.identity.ordered_members[rank]!r}) but the binding "
                f"says local_member {self.local_member!r}"
            )
        backend = str(dist.get_backend(group)).lower()
        if backend == "nccl" and device.type != "cuda":
            raise RuntimeError(f"{name}: the nccl backend needs a CUDA collective_device")
        if backend == "mpi" and device.type != "cpu":
            raise RuntimeError(f"{name}: the mpi backend needs a CPU collective_device")


@dataclass(frozen=True, eq=False)
class CodebookProcessGroupBinding(ProcessGroupBinding):
    """The scope over which an optimizer learns shared state (Gefen's codebook)."""


@dataclass(frozen=True, eq=False)
class CheckpointProcessGroupBinding(ProcessGroupBinding):
    """The scope over which portable checkpoint collectives run."""

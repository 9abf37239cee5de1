"""Resource limits for portable-state and DCP I/O (enforced before allocation)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import ContractError
from .validation import exact_int

__all__ = ["PortableStateLimits"]

_U64_MAX = 2**64 - 1
_MIB = 1 << 20
_GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class PortableStateLimits:
    """Bounds that every parser and every collective round checks before allocating.

    All fields are exact ints in ``[1, 2**64 - 1]``. ``max_fragment_tensor_bytes`` bounds one
    member's tensor bytes, ``max_collective_tensor_bytes`` the sum over members; likewise for
    metadata. Unlike the reference, ``max_metadata_bytes`` defaults to
    ``min(64 MiB, max_collective_metadata_bytes)``, so lowering only the collective limit works
    in the constructor. The instance holds the resolved value, so ``dataclasses.replace`` of an
    existing instance carries it: lowering the collective limit below it there needs
    ``max_metadata_bytes`` too (or ``max_metadata_bytes=0``, which resolves again).
    """

    max_fragment_tensor_bytes: int = 64 * _GIB
    max_collective_tensor_bytes: int = 256 * _GIB
    max_collective_metadata_bytes: int = 256 * _MIB
    chunk_bytes: int = 8 * _MIB
    max_members: int = 4096
    max_metadata_bytes: int = 0
    max_tree_nodes: int = 1_000_000
    max_tree_depth: int = 64
    max_container_items: int = 1_000_000
    max_string_bytes: int = _MIB
    max_integer_bytes: int = 4096
    max_tensors: int = 262_144
    max_tensor_rank: int = 64
    diagnostic_bytes: int = 2048

    def __post_init__(self) -> None:
        if type(self.max_metadata_bytes) is int and self.max_metadata_bytes == 0:
            collective = self.max_collective_metadata_bytes
            if type(collective) is int:
                object.__setattr__(self, "max_metadata_bytes", min(64 * _MIB, collective))
        for spec in fields(self):
            exact_int(getattr(self, spec.name), f"PortableStateLimits.{spec.name}", minimum=1, maximum=_U64_MAX)
        if self.max_tree_depth > 256:
            raise ContractError("PortableStateLimits.max_tree_depth must be <= 256")
        if self.max_tensor_rank > 65535:
            raise ContractError("PortableStateLimits.max_tensor_rank must be <= 65535")
        if self.max_fragment_tensor_bytes > self.max_collective_tensor_bytes:
            raise ContractError("max_fragment_tensor_bytes must not exceed max_collective_tensor_bytes")
        if self.max_metadata_bytes > self.max_collective_metadata_bytes:
            raise ContractError("max_metadata_bytes must not exceed max_collective_metadata_bytes")

    def collective(self) -> PortableStateLimits:
        """The limits a collective-side parser uses (collective bounds replace per-fragment ones)."""
        return PortableStateLimits(
            **{
                **{f.name: getattr(self, f.name) for f in fields(self)},
                "max_fragment_tensor_bytes": self.max_collective_tensor_bytes,
                "max_metadata_bytes": self.max_collective_metadata_bytes,
            }
        )

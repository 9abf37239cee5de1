"""``SealedLayout``: the owned, immutable record of a finalized post-sharding layout.

The reference re-proved its layout from mutable public containers on every entry point
with hundreds of lines of forensic caching. Here the optimizer owns one immutable object,
published by ``commit_post_sharding`` together with a layout version; :meth:`verify`
compares the public containers (group ``params`` lists by identity, names, state keys)
against it in O(local parameters) with identity checks only, so tampering is detected
before any mutation, also inside a closure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import LayoutTamperedError
from ..identity import ShardIdentity
from ..manifest import ShardingManifest
from ..rebinding import LogicalSlotBinding
from .bindings import ProcessGroupBinding
from .rebinding_plan import RebindingPlan

__all__ = ["SealedLayout"]


class SealedLayout:
    """An immutable finalized layout (slots, manifest, local bindings, scope) and its guard."""

    __slots__ = ("_by_tensor", "_expected", "_names", "bindings", "manifest", "scope", "slots")

    manifest: ShardingManifest
    slots: tuple[LogicalSlotBinding, ...]
    bindings: tuple[tuple[torch.Tensor | None, ShardIdentity], ...]
    scope: ProcessGroupBinding | None
    _expected: tuple[tuple[torch.Tensor, ...], ...]
    _names: tuple[tuple[str, ...], ...]
    _by_tensor: dict[int, tuple[torch.Tensor, ShardIdentity]]

    def __init__(self, plan: RebindingPlan, group_count: int) -> None:
        expected: list[list[torch.Tensor]] = [[] for _ in range(group_count)]
        names: list[list[str]] = [[] for _ in range(group_count)]
        by_tensor: dict[int, tuple[torch.Tensor, ShardIdentity]] = {}
        for entry in plan.entries:
            # a pruned non-owner slot leaves its group: the live params list will not hold it
            if entry.target is None:
                continue
            expected[entry.slot.group_index].append(entry.target)
            names[entry.slot.group_index].append(entry.slot.compatibility_name)
            by_tensor[id(entry.target)] = (entry.target, entry.slot.shard)
        object.__setattr__(self, "manifest", plan.manifest)
        object.__setattr__(self, "slots", plan.slots)
        object.__setattr__(self, "bindings", plan.local_bindings())
        object.__setattr__(self, "scope", plan.scope)
        object.__setattr__(self, "_expected", tuple(tuple(g) for g in expected))
        object.__setattr__(self, "_names", tuple(tuple(n) for n in names))
        object.__setattr__(self, "_by_tensor", by_tensor)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("SealedLayout is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("SealedLayout is immutable")

    def shard_identity(self, tensor: object) -> ShardIdentity:
        """The shard bound to ``tensor`` (``KeyError`` for an unbound tensor)."""
        found = self._by_tensor.get(id(tensor))
        if found is None or found[0] is not tensor:
            raise KeyError("no finalized shard identity is bound to this tensor")
        return found[1]

    def expected_params(self, group_index: int) -> tuple[torch.Tensor, ...]:
        return self._expected[group_index]

    def compatibility_names(self, group_index: int) -> tuple[str, ...]:
        return self._names[group_index]

    def verify(
        self,
        param_groups: Sequence[Mapping[str, Any]],
        state: Mapping[Any, Any],
        *,
        names_key: str | None = "param_names",
        where: str = "step",
    ) -> None:
        """Raise :class:`LayoutTamperedError` if the public containers differ from the sealed layout.

        Checks, by identity and in O(local parameters): the number of groups, every group's
        ``params`` list, its ``names_key`` list (when the optimizer keeps one), and that every
        ``state`` key is a bound tensor.
        """
        if len(param_groups) != len(self._expected):
            raise LayoutTamperedError(
                f"{where}: the finalized parameter layout changed outside post_sharding "
                f"({len(param_groups)} param groups, sealed {len(self._expected)})"
            )
        for index, (group, expected) in enumerate(zip(param_groups, self._expected)):
            params = group["params"]
            # by identity: an equal-valued replacement tensor is still a tampered layout
            if len(params) != len(expected) or any(a is not b for a, b in zip(params, expected)):
                raise LayoutTamperedError(
                    f"{where}: the finalized parameter layout changed outside post_sharding (param_groups[{index}] "
                    f"params were replaced, added, removed or reordered)"
                )
            if names_key is not None and names_key in group and tuple(group[names_key]) != self._names[index]:
                raise LayoutTamperedError(
                    f"{where}: the finalized parameter layout changed outside post_sharding "
                    f"(param_groups[{index}][{names_key!r}] was edited)"
                )
        for key in state:
            found = self._by_tensor.get(id(key))
            if found is None or found[0] is not key:
                raise LayoutTamperedError(
                    f"{where}: the finalized parameter layout changed outside post_sharding (state holds an entry for a "
                    f"tensor that is not bound)"
                )

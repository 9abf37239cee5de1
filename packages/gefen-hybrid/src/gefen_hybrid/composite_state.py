"""``CompositeState``: the composite's ``state``, a routed view of its children's state.

Reads return the owning child's live per-parameter dict; reading a known parameter that
has no state yet creates its (empty) entry in the owning child, as ``torch.optim``'s
``defaultdict`` does, while ``get`` and ``in`` never create anything. Writes and deletes
go to the owning child; ``clear`` clears every child. A tensor the composite does not
optimize raises ``KeyError`` saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["CompositeState"]


class CompositeState(MutableMapping[torch.Tensor, Any]):
    """A live view; ``owner_of(parameter)`` returns the child that optimizes ``parameter`` or ``None``."""

    __slots__ = ("_children", "_owner_of")

    def __init__(
        self,
        children: Sequence[torch.optim.Optimizer],
        owner_of: Callable[[torch.Tensor], torch.optim.Optimizer | None],
    ) -> None:
        self._children = tuple(children)
        self._owner_of = owner_of

    def _owner(self, key: object) -> torch.optim.Optimizer:
        child = self._owner_of(key) if isinstance(key, torch.Tensor) else None
        if child is None:
            raise KeyError(
                f"{type(key).__name__} is not a parameter of this composite optimizer (its state is kept by the "
                "child that optimizes each parameter)"
            )
        return child

    def __getitem__(self, key: torch.Tensor) -> Any:
        return self._owner(key).state[key]

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        self._owner(key).state[key] = value

    def __delitem__(self, key: torch.Tensor) -> None:
        del self._owner(key).state[key]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for child in self._children:
            yield from list(child.state)

    def __len__(self) -> int:
        return sum(len(child.state) for child in self._children)

    def __contains__(self, key: object) -> bool:
        child = self._owner_of(key) if isinstance(key, torch.Tensor) else None
        return child is not None and key in child.state

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        child = self._owner_of(key) if isinstance(key, torch.Tensor) else None
        if child is None:
            return default
        return child.state.get(key, default)

    def clear(self) -> None:
        for child in self._children:
            child.state.clear()

    def __repr__(self) -> str:
        return f"CompositeState({len(self)} parameters with state)"

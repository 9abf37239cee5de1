"""``revalidate``: defend against ``object.__setattr__`` on a frozen descriptor."""

from __future__ import annotations

from typing import TypeVar

from .codec import from_primitive, to_primitive

__all__ = ["revalidate"]

T = TypeVar("T")


def revalidate(descriptor: T) -> T:
    """Rebuild ``descriptor`` from its canonical record so every invariant runs again.

    Returns an equal, freshly validated descriptor, or raises the constructor's error. Use
    it where a descriptor might have been mutated with ``object.__setattr__``.
    """
    rebuilt = from_primitive(to_primitive(descriptor), type(descriptor))
    return rebuilt

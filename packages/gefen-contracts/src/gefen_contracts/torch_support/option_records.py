"""A parameter group's options as checkpoint records hold them: which options can travel, the
plain form they travel in, and how two recorded option trees compare.

Records (canonical local documents, portable state) hold a group's options as a tree of
primitives: ``None``, ``bool``, ``int``, finite ``float``, ``str``, lists and ``str``-keyed
dicts, and (canonical documents only) plain strided tensors. Every optimizer of the convention
checks, converts and compares options through this one module, so the rules and the messages
are the same whichever optimizer or record is involved.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

__all__ = ["listify", "option_blockers", "option_problem", "options_equal", "plain_options", "recorded_options"]

#: How deep an option tree may nest before it is refused (a cycle or a pathological value).
_MAX_DEPTH = 8


def option_problem(value: object, *, tensors: bool = False, depth: int = 0) -> str | None:
    """``None`` when ``value`` can be recorded, else what is wrong with it ("a Tensor", "a
    non-finite float", ...). ``tensors``: plain strided tensors may be recorded too."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return None
    if kind is float:
        return None if math.isfinite(value) else "a non-finite float"  # type: ignore[arg-type]
    if tensors and kind is torch.Tensor:
        tensor: torch.Tensor = value  # type: ignore[assignment]
        return None if tensor.layout is torch.strided and not tensor.is_meta else "a non-strided tensor"
    # exact list/tuple/dict only: a subclass may carry behaviour a record cannot restore
    if depth < _MAX_DEPTH and kind in (list, tuple):
        items: Sequence[object] = value  # type: ignore[assignment]
        return next((p for v in items if (p := option_problem(v, tensors=tensors, depth=depth + 1))), None)
    if depth < _MAX_DEPTH and kind is dict:
        tree: dict[object, object] = value  # type: ignore[assignment]
        if any(type(key) is not str for key in tree):
            return "a dict with non-str keys"
        return next((p for v in tree.values() if (p := option_problem(v, tensors=tensors, depth=depth + 1))), None)
    return f"a {kind.__name__}"


def option_blockers(
    param_groups: Sequence[Mapping[str, Any]], record: str, *, excluded: Collection[str], tensors: bool = False
) -> tuple[str, ...]:
    """Why the options of ``param_groups`` (except the keys in ``excluded``) cannot travel in a
    ``record`` (e.g. ``"portable"``), one reason per offending option; empty when they can."""
    allowed = "primitives and plain tensors" if tensors else "primitives"
    reasons = []
    for index, group in enumerate(param_groups):
        for key, value in group.items():
            if key in excluded:
                continue
            problem = option_problem(value, tensors=tensors)
            if problem is not None:
                hint = " (use a float lr, not a tensor)" if key == "lr" and not tensors else ""
                reasons.append(
                    f"param_groups[{index}] option {key!r} holds {problem}; {record} records hold {allowed} only{hint}"
                )
    return tuple(reasons)


def listify(value: Any) -> Any:
    """``value`` with every tuple made a list and every mapping a ``dict`` (the form records
    compare and hand back)."""
    if type(value) in (list, tuple):
        return [listify(v) for v in value]
    if isinstance(value, Mapping):
        return {k: listify(v) for k, v in value.items()}
    return value


def recorded_options(group: Mapping[str, Any], excluded: Collection[str]) -> dict[str, Any]:
    """A group's options as a record holds them: every key but ``excluded``, :func:`listify`-ed."""
    return {key: listify(value) for key, value in group.items() if key not in excluded}


def plain_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options handed back by a record (frozen mappings, tuples) as plain dicts and lists."""
    return {key: listify(value) for key, value in options.items()}


def options_equal(a: Any, b: Any) -> bool:
    """Exact equality of recorded option trees: types included (``1`` is not ``1.0``), tensors
    by dtype, shape and values on any device."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(options_equal(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(options_equal(a[k], b[k]) for k in a)
    return bool(a == b)

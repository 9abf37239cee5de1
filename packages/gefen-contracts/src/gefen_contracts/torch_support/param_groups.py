"""Checks every optimizer of the convention runs on a parameter group before registering it
and again before each step: no parameter twice, and a tensor ``lr`` where the step can read it.

torch only warns about a parameter listed twice in one group, and the result then differs
from listing it once (it is updated twice per step); a tensor ``lr`` on a device that is
neither the CPU nor the parameters' fails deep inside the first ``step()``, after state was
created. Both are refused here with ``ValueError`` before anything changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["check_new_group", "check_tensor_lr", "group_params"]


def group_params(params: object) -> list[object]:
    """A group's ``params`` as a list: one tensor, or an ordered iterable of tensors or
    ``(name, tensor)`` pairs. A ``set`` is refused with torch's ``TypeError`` (its order, and so
    every checkpoint's parameter ids, changes between runs)."""
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
            "sets will change between runs. Please use a list instead."
        )
    if not isinstance(params, Iterable):
        raise TypeError(f"params must be a tensor or an iterable of tensors, got {type(params).__name__}")
    return list(params)


def _tensors(params: Iterable[object]) -> list[object]:
    """The tensors of a ``params`` list (``(name, tensor)`` pairs unwrapped; other items kept)."""
    return [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in params]


def check_tensor_lr(lr: object, params: Iterable[object], where: str) -> None:
    """A tensor ``lr`` must sit on the CPU or on the device of every tensor of ``params``."""
    if not isinstance(lr, torch.Tensor) or lr.device.type == "cpu":
        return
    for tensor in _tensors(params):
        if isinstance(tensor, torch.Tensor) and tensor.device != lr.device:
            raise ValueError(
                f"{where}: a tensor lr on {lr.device} cannot drive a parameter on {tensor.device}; "
                "put it on the CPU or on the parameters' device"
            )


def check_new_group(params: Sequence[object], index: int, groups: Sequence[Mapping[str, Any]], lr: object) -> None:
    """Refuse a parameter listed twice in ``params`` or already in one of ``groups``, and a
    tensor ``lr`` :func:`check_tensor_lr` refuses (``ValueError``, naming the positions)."""
    seen: dict[int, str] = {}
    for number, group in enumerate(groups):
        for position, tensor in enumerate(_tensors(group["params"])):
            seen[id(tensor)] = f"param_groups[{number}]['params'][{position}]"
    for position, tensor in enumerate(_tensors(params)):
        here = f"param_groups[{index}]['params'][{position}]"
        if id(tensor) in seen:
            raise ValueError(f"{here} is the same parameter as {seen[id(tensor)]}; list each parameter once")
        seen[id(tensor)] = here
    check_tensor_lr(lr, params, f"param_groups[{index}]")

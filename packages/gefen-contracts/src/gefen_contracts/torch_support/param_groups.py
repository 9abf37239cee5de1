"""Checks every optimizer of the convention runs on a parameter group before registering it
and again before each step: no parameter twice, and a tensor ``lr`` where the step can read it.

torch only warns about a parameter listed twice in one group, and the result then differs
from listing it once (it is updated twice per step); a tensor ``lr`` on a device that is
neither the CPU nor the parameters' fails deep inside the first ``step()``, after state was
created. Both are refused here with ``ValueError`` before anything changes. And a loaded
checkpoint keeps a tensor option that several saved groups shared as one tensor, as torch's
load does (:func:`shared_tensor_options`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "SharedOption",
    "check_new_group",
    "check_tensor_lr",
    "group_params",
    "names_mismatch",
    "routing_mismatch",
    "share_options",
    "shared_tensor_options",
]


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


def names_mismatch(saved: object, live: Sequence[str], ids: object = None) -> str | None:
    """``None`` when a loaded group's ``param_names`` are the live group's, else what differs,
    for the refusal's message (also when the loaded ``param_names`` are not a list of names).

    A native load matches state to parameters by position, so the same names in another order
    (a model that registers its parameters in another order) differ too: loaded by position,
    each state would land on another parameter. The exception is torch's
    ``set_optimizer_state_dict``, which keys the state by name and lists the group's ``params``
    (``ids``) as those names in the live order, but passes the checkpoint's ``param_names``
    through in the saved order: when ``ids`` are exactly the live names, the state is already
    matched by name and the saved order does not matter.
    """
    if not isinstance(saved, (list, tuple)) or any(type(name) is not str for name in saved):
        return f"the checkpoint's param_names must be a list of str, got {type(saved).__name__} {saved!r:.80}"
    saved, live = list(saved), list(live)
    if saved == live or (isinstance(ids, list) and ids == live and sorted(saved) == sorted(live)):
        return None
    common = min(len(saved), len(live))
    first = next((i for i in range(common) if saved[i] != live[i]), common)
    if first < common:
        where = f"parameter {first} is {saved[first]!r} in the checkpoint but {live[first]!r} here"
    else:
        where = f"the checkpoint names {len(saved)} parameters, this group {len(live)}"
    if sorted(saved) == sorted(live):
        return (
            f"the same names in another order ({where}): the optimizer lists its parameters in another order "
            "than the one that saved (the model registers them in another order, or they were passed in "
            "another one); build the optimizer from them in the saving order, or load through torch's "
            "set_optimizer_state_dict, which matches them by name"
        )
    return f"{where}; rename them with a load_state_dict pre-hook if the model really changed"


def _prefixed(saved: Mapping[str, str], live: Mapping[str, str]) -> str | None:
    """What a routing mismatch is when one side's names are all the other's under one prefix."""
    for outer, inner, side in ((saved, live, "the checkpoint's"), (live, saved, "this composite's")):
        first = min(outer, default="")
        for name in inner if len(outer) == len(inner) else ():
            prefix = first[: len(first) - len(name)]
            if first.endswith("." + name) and {prefix + n: role for n, role in inner.items()} == outer:
                return f"{side} parameter names are the others' under the prefix {prefix!r}"
    return None


def routing_mismatch(saved: Mapping[str, str], live: Mapping[str, str]) -> str | None:
    """``None`` when a checkpoint's routing (parameter name -> role of a composite) is the live
    composite's, else the first difference, for the refusal's message: names that are the
    other side's under a wrapper's prefix (``torch.compile``'s ``_orig_mod.``, DDP's
    ``module.``), a parameter on one side only, or one routed to another role."""
    if dict(saved) == dict(live):
        return None
    prefixed = _prefixed(saved, live)
    if prefixed is not None:
        return (
            f"{prefixed}: the optimizer was built from a wrapped model on one side only (torch.compile adds "
            "'_orig_mod.', DistributedDataParallel 'module.'); build both from the same module, or rename the "
            "checkpoint's parameters with a load_state_dict pre-hook"
        )
    for fqn in sorted(set(saved) | set(live)):
        if fqn not in live:
            return f"the checkpoint routes {fqn!r} to {saved[fqn]!r}, but this composite has no such parameter"
        if fqn not in saved:
            return f"parameter {fqn!r} (role {live[fqn]!r}) is missing from the checkpoint's routing"
        if saved[fqn] != live[fqn]:
            return f"parameter {fqn!r} is routed to {saved[fqn]!r} in the checkpoint but to {live[fqn]!r} here"
    raise AssertionError("unreachable: two different routings differ at some parameter")


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


def check_new_group(
    params: Sequence[object],
    index: int,
    groups: Sequence[Mapping[str, Any]],
    lr: object,
    *,
    param_names: object = None,
) -> None:
    """Refuse a parameter listed twice in ``params`` or already in one of ``groups``, a tensor
    ``lr`` :func:`check_tensor_lr` refuses (``ValueError``, naming the positions), and names
    (the ``(name, tensor)`` pairs' or a ``param_names`` list's) that a load could not check
    its states against: not ``str`` (``TypeError``), too few or too many, or a name already
    used (``ValueError``). torch's optimizers take any names; these optimizers' loads compare
    them, so a checkpoint with them was refused by the optimizer that wrote it."""
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
    _check_new_names(params, index, groups, param_names)


def _check_new_names(params: Sequence[object], index: int, groups: Sequence[Mapping[str, Any]], given: object) -> None:
    pairs = [item for item in params if isinstance(item, tuple)]
    if pairs and len(pairs) != len(params):
        return  # torch's add_param_group refuses a group naming only some parameters
    names = [pair[0] for pair in pairs] if pairs else given
    if names is None:
        return
    if not isinstance(names, (list, tuple)) or len(names) != len(params):
        shown = len(names) if isinstance(names, (list, tuple)) else type(names).__name__
        raise ValueError(f"param_groups[{index}] has {len(params)} parameters but param_names {shown}; name each once")
    taken = {
        name: f"param_groups[{number}]['params'][{position}]"
        for number, group in enumerate(groups)
        for position, name in enumerate(group.get("param_names") or ())
        if isinstance(name, str)
    }
    for position, name in enumerate(names):
        here = f"param_groups[{index}]['params'][{position}]"
        if type(name) is not str:
            raise TypeError(f"{here} is named by {type(name).__name__} {name!r}; parameter names must be str")
        if name in taken:
            raise ValueError(
                f"{here} is named {name!r}, as {taken[name]} is; names must be distinct (a load matches each state "
                "to its parameter by name)"
            )
        taken[name] = here


#: ``(group, key, first group, first key)``: group ``group``'s option ``key`` is the tensor that
#: group ``first group`` holds under ``first key``.
SharedOption = tuple[int, str, int, str]


def shared_tensor_options(saved_groups: Sequence[object]) -> tuple[SharedOption, ...]:
    """Where ``saved_groups`` hold one tensor object in more than one group (a tensor ``lr``
    given once for several groups). torch's load deep-copies the saved groups in one call, so
    such a tensor stays one tensor after the load and an in-place schedule
    (``ReduceLROnPlateau`` fills a tensor ``lr``) moves it as before the save; a loader that
    copies group by group restores that with :func:`share_options`."""
    first: dict[int, tuple[int, str]] = {}
    shared: list[SharedOption] = []
    for index, group in enumerate(saved_groups):
        if not isinstance(group, Mapping):
            continue  # the loader names it
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                origin = first.setdefault(id(value), (index, str(key)))
                if origin[0] != index:
                    shared.append((index, str(key), *origin))
    return tuple(shared)


def share_options(groups: Sequence[dict[str, Any]], shared: Sequence[SharedOption]) -> None:
    """Point each shared option of ``groups`` (new or live group dicts, in the saved order) at
    its first group's object (:func:`shared_tensor_options`)."""
    for index, key, first, first_key in shared:
        if key in groups[index] and first_key in groups[first]:
            groups[index][key] = groups[first][first_key]

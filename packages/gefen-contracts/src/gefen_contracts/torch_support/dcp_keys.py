"""A native state dict as ``torch.distributed.checkpoint`` hands it back.

``dcp.save`` of a state dict whose ``state`` is keyed by int parameter ids (what
``optimizer.state_dict()`` returns) flattens every leaf to a string path. ``dcp.load`` then
loads each tensor in place into the template's (still under the int id) but writes each other
leaf (a Python-int step counter) back along the string path: the entry ends up split in two,
the int-keyed one with the loaded tensors and the template's counters, and a ``"0"``-keyed one
with the saved counters alone. torch's AdamW keeps its ``step`` in a tensor and never sees
this; an optimizer whose counters are ints rejoins the halves before validating its load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, cast

__all__ = ["with_rejoined_state"]

T = TypeVar("T")


def with_rejoined_state(state_dict: T) -> T:
    """``state_dict`` (a shallow copy) with every entry that ``dcp.load`` split rejoined: where
    ``state`` holds both ``i`` and ``str(i)``, one entry whose values are the string half's over
    the int half's. Anything else, malformed input included, is returned as it is (the loader
    validates it)."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        return state_dict
    state = state_dict["state"]
    split = [
        key
        for key in state
        if type(key) is str and key.isascii() and key.isdecimal() and str(int(key)) == key and int(key) in state
    ]
    if not split:
        return state_dict
    rejoined = {key: value for key, value in state.items() if key not in split}
    for key in split:
        whole, counters = state[int(key)], state[key]
        if isinstance(whole, Mapping) and isinstance(counters, Mapping):
            rejoined[int(key)] = {**whole, **counters}
        else:
            rejoined[key] = counters  # not DCP's split: left for the loader to name
    return cast(T, {**state_dict, "state": rejoined})

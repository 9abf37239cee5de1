"""An optimizer's native state dict split into a primitive skeleton and its tensors.

:class:`~gefen_dcp.GefenDCPState` saves ``optimizer.state_dict()`` as it is: its tensors
(DTensors placed like their parameters under FSDP2) become DCP items that DCP reshards,
and everything else (counters, hyperparameters, group structure) becomes one skeleton, a
canonical-JSON tree stored inside the envelope. Python types JSON cannot tell apart are
tagged, so the skeleton rebuilds the state dict exactly::

    None, bool, int, str, finite float    themselves
    non-finite float                      {"float": "inf" | "-inf" | "nan"}
    list / tuple                          {"list": [...]} / {"tuple": [...]}
    dict (str or int keys)                {"dict": [[key, value], ...]}  (insertion order)
    tensor                                {"tensor": "<key>"}

Each tensor's key is its path joined by ``/`` (``state/3/m_codes``,
``param_groups/0/_gefen_checkpoint_metadata/codebook``); a tensor under ``state/<i>/``
belongs to parameter ``i`` in torch's state-dict numbering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .errors import CheckpointLayoutError, EnvelopeFormatError

__all__ = ["parameter_index", "rebuild", "split"]

_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _key_text(key: object, where: str) -> str:
    if type(key) is int:
        return str(key)
    if type(key) is str and key and "/" not in key:
        return key
    raise CheckpointLayoutError(f"{where}: state-dict keys must be ints or non-empty str without '/', got {key!r}")


def split(state_dict: Mapping[str, Any]) -> tuple[object, dict[str, torch.Tensor]]:
    """``(skeleton, tensors)`` of a native state dict (``CheckpointLayoutError`` for a value
    that is neither a primitive, a container of them, nor a tensor)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: object, path: tuple[str, ...]) -> object:
        where = "/".join(path) or "the state dict"
        if value is None or type(value) in (bool, int, str):
            return value
        if type(value) is float:
            if math.isfinite(value):
                return value
            return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            key = "/".join(path)
            if key in tensors:  # e.g. keys 0 and "0" side by side
                raise CheckpointLayoutError(f"{key}: two state-dict entries share this tensor key")
            tensors[key] = value
            return {"tensor": key}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            tag = "list" if type(value) is list else "tuple"
            return {tag: [walk(item, (*path, str(index))) for index, item in enumerate(value)]}
        if isinstance(value, dict) and type(value) is dict:
            pairs = []
            for key, item in value.items():
                text = _key_text(key, where)
                pairs.append([key, walk(item, (*path, text))])
            return {"dict": pairs}
        raise CheckpointLayoutError(
            f"{where}: a {type(value).__name__} cannot be saved by GefenDCPState (tensors and primitives only)"
        )

    if type(state_dict) is not dict:
        raise CheckpointLayoutError(f"optimizer.state_dict() must return a dict, got {type(state_dict).__name__}")
    return walk(state_dict, ()), tensors


def rebuild(skeleton: object, tensor: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """The state dict a skeleton describes, with ``tensor(key)`` for each tensor leaf
    (``EnvelopeFormatError`` for a malformed skeleton)."""

    def walk(value: object, where: str) -> object:
        if value is None or type(value) in (bool, int, str, float):
            return value
        if type(value) is not dict or len(value) != 1:
            raise EnvelopeFormatError(f"skeleton {where}: expected a primitive or a one-key tagged dict")
        ((tag, body),) = value.items()
        if tag == "float" and body in _FLOATS:
            return _FLOATS[body]
        if tag == "tensor" and type(body) is str:
            return tensor(body)
        if tag in ("list", "tuple") and type(body) is list:
            items = [walk(item, f"{where}[{index}]") for index, item in enumerate(body)]
            return items if tag == "list" else tuple(items)
        if tag == "dict" and type(body) is list:
            out: dict[object, object] = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (int, str) or pair[0] in out:
                    raise EnvelopeFormatError(f"skeleton {where}: dict entries must be unique [int | str, value] pairs")
                out[pair[0]] = walk(pair[1], f"{where}.{pair[0]}")
            return out
        raise EnvelopeFormatError(f"skeleton {where}: unknown tag {tag!r} or malformed body")

    result = walk(skeleton, "root")
    if type(result) is not dict:
        raise EnvelopeFormatError("skeleton root must describe a dict")
    return result


def parameter_index(key: str) -> int | None:
    """The parameter a tensor key belongs to (``state/<i>/...``), or ``None``."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "state" and parts[1].isdigit() and str(int(parts[1])) == parts[1]:
        return int(parts[1])
    return None

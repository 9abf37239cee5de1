"""Canonical JSON bytes for small primitive records, parsed under limits before use.

Records written into checkpoints by gefen-dcp (the DCP state envelope and the per-writer
digest tables) are primitive trees: ``dict`` with ``str`` keys, ``list``, ``str``, exact
``int``, finite ``float``, ``bool`` and ``None``. They are stored as canonical UTF-8 JSON
(sorted keys, no whitespace, shortest round-trip floats), which keeps ``int`` and
``float`` apart and is readable with any JSON tool. Parsing refuses duplicate keys,
``NaN``/``Infinity``, and anything over the size, depth, node and string limits.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gefen_contracts.limits import PortableStateLimits

from .errors import EnvelopeFormatError

__all__ = ["dump_canonical", "load_canonical", "load_document"]


def _check_tree(value: object, path: str, depth: int, limits: PortableStateLimits, budget: list[int]) -> None:
    budget[0] += 1
    if budget[0] > limits.max_tree_nodes:
        raise EnvelopeFormatError(f"{path}: more than {limits.max_tree_nodes} nodes")
    if depth > limits.max_tree_depth:
        raise EnvelopeFormatError(f"{path}: nested deeper than {limits.max_tree_depth}")
    if value is None or type(value) in (bool, int):
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise EnvelopeFormatError(f"{path}: non-finite float")
        return
    if type(value) is str:
        if len(value.encode("utf-8")) > limits.max_string_bytes:
            raise EnvelopeFormatError(f"{path}: string longer than {limits.max_string_bytes} bytes")
        return
    if type(value) is list:
        if len(value) > limits.max_container_items:
            raise EnvelopeFormatError(f"{path}: more than {limits.max_container_items} items")
        for index, item in enumerate(value):
            _check_tree(item, f"{path}[{index}]", depth + 1, limits, budget)
        return
    if type(value) is dict:
        if len(value) > limits.max_container_items:
            raise EnvelopeFormatError(f"{path}: more than {limits.max_container_items} items")
        for key, item in value.items():
            if type(key) is not str:
                raise EnvelopeFormatError(f"{path}: keys must be str")
            _check_tree(key, f"{path} key", depth + 1, limits, budget)
            _check_tree(item, f"{path}.{key}", depth + 1, limits, budget)
        return
    raise EnvelopeFormatError(f"{path}: {type(value).__name__} values are not allowed")


def dump_canonical(value: object, *, limits: PortableStateLimits, what: str) -> bytes:
    """Canonical UTF-8 JSON bytes of a primitive tree (raises ``EnvelopeFormatError``)."""
    _check_tree(value, what, 0, limits, [0])
    data = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    encoded = data.encode("utf-8")
    if len(encoded) > limits.max_metadata_bytes:
        raise EnvelopeFormatError(f"{what}: {len(encoded)} bytes exceed max_metadata_bytes={limits.max_metadata_bytes}")
    return encoded


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise EnvelopeFormatError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> None:
    raise EnvelopeFormatError(f"non-finite constant {name} is not allowed")


def load_canonical(data: bytes, *, limits: PortableStateLimits, what: str) -> Any:
    """Parse bytes written by :func:`dump_canonical`; they must be byte-identical to the
    canonical re-encoding of what they parse to (one record, one byte form)."""
    if type(data) is not bytes:
        raise EnvelopeFormatError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_metadata_bytes:
        raise EnvelopeFormatError(f"{what}: {len(data)} bytes exceed max_metadata_bytes={limits.max_metadata_bytes}")
    try:
        text = data.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except EnvelopeFormatError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise EnvelopeFormatError(f"{what}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if dump_canonical(value, limits=limits, what=what) != data:
        raise EnvelopeFormatError(f"{what}: bytes are not in canonical form")
    return value


def load_document(
    data: bytes,
    *,
    limits: PortableStateLimits,
    what: str,
    format: str,
    version: int,
    keys: frozenset[str],
    older: str = "",
) -> dict[str, Any]:
    """Parse a canonical record of ``format`` ``version`` whose keys are exactly ``keys``.

    The format and version are checked before the keys, so a record of another version is
    refused naming both versions (``older`` says what earlier versions held, or what to do),
    whatever keys that version had.
    """
    value = load_canonical(data, limits=limits, what=what)
    if type(value) is not dict:
        raise EnvelopeFormatError(f"{what}: expected a JSON object, got {type(value).__name__}")
    found, found_version = value.get("format"), value.get("format_version")
    if found != format or type(found_version) is not int or found_version != version:
        raise EnvelopeFormatError(
            f"{what}: this is {found!r} version {found_version!r}; this library reads {format!r} version "
            f"{version}{f' ({older})' if older else ''}"
        )
    if set(value) != keys:
        raise EnvelopeFormatError(f"{what}: expected the keys {sorted(keys)}, got {sorted(value)}")
    return value

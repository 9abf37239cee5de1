"""The generic envelope of canonical local state documents (``gefen.bound_state``).

An optimizer that implements ``CanonicalLocalState`` builds its export with
:func:`build_bound_state` and validates an import with :func:`parse_bound_state`; it
supplies only its own policy record, common state and per-parameter authoritative state.
Documents hold primitive containers and detached, tight, finite CPU tensors, so they load
with ``torch.load(weights_only=True)``; parameters are keyed by exact FQN, so an import
routes across regrouped or reordered targets.

Layout (format version 1)::

    {"format": "gefen.bound_state", "format_version": 1, "coverage": "local_optimizer_fragment",
     "implementation": str, "policy": {...}, "common": {...},
     "manifest": <ShardingManifest record>,
     "parameters": {fqn: {"compatibility_name": str, "shard": <ShardIdentity record>,
                          "group_options": {...}, "variant": str, "state": {...}}}}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import from_primitive, to_primitive
from ..digest import canonical_digest
from ..errors import CodecError, StateValidationError
from ..identity import ShardIdentity
from ..manifest import ShardingManifest
from .tensors import DIGESTED_DTYPES

__all__ = [
    "BOUND_STATE_COVERAGE",
    "BOUND_STATE_FORMAT",
    "BOUND_STATE_FORMAT_VERSION",
    "BoundParameter",
    "BoundStateDocument",
    "build_bound_state",
    "parse_bound_state",
]

BOUND_STATE_FORMAT = "gefen.bound_state"
BOUND_STATE_FORMAT_VERSION = 1
BOUND_STATE_COVERAGE = "local_optimizer_fragment"
_TOP_KEYS = frozenset(
    {"format", "format_version", "coverage", "implementation", "policy", "common", "manifest", "parameters"}
)
_PARAM_KEYS = frozenset({"compatibility_name", "shard", "group_options", "variant", "state"})


@dataclass(frozen=True, slots=True, eq=False)
class BoundParameter:
    """One local parameter's entry: native name, shard, group options, variant, state."""

    compatibility_name: str
    shard: ShardIdentity
    group_options: Mapping[str, Any]
    variant: str
    state: Mapping[str, Any]


@dataclass(frozen=True, slots=True, eq=False)
class BoundStateDocument:
    """A parsed, validated document (tensors are owned copies on CPU)."""

    implementation: str
    policy: dict[str, Any]
    common: dict[str, Any]
    manifest: ShardingManifest
    parameters: dict[str, BoundParameter]


def _clone_value(value: Any, path: str, *, tensors: bool, depth: int = 0) -> Any:
    """Deep copy of a primitive/tensor tree with exact types; tensors become tight CPU copies."""
    if depth > 32:
        raise StateValidationError(f"{path}: nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if not math.isfinite(value):
            raise StateValidationError(f"{path}: non-finite float")
        return value
    if kind is list:
        return [_clone_value(v, f"{path}[{i}]", tensors=tensors, depth=depth + 1) for i, v in enumerate(value)]
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str:
                raise StateValidationError(f"{path}: keys must be str, got {type(key).__name__}")
            out[key] = _clone_value(item, f"{path}.{key}", tensors=tensors, depth=depth + 1)
        return out
    if tensors and kind is torch.Tensor:
        if value.layout is not torch.strided or value.is_meta or value.is_quantized or value.is_nested:
            raise StateValidationError(f"{path}: only plain strided tensors are allowed")
        if value.dtype not in DIGESTED_DTYPES:  # float8/float4, unsigned wide ints, complex32, ...
            raise StateValidationError(f"{path}: {value.dtype} tensors are not allowed")
        if (value.is_floating_point() or value.is_complex()) and not bool(torch.isfinite(value).all()):
            raise StateValidationError(f"{path}: tensor holds non-finite values")
        data = value.detach()
        if data.is_conj():
            data = data.resolve_conj()
        return data.to("cpu", copy=True).contiguous().clone()
    raise StateValidationError(f"{path}: {kind.__name__} values are not allowed in a bound-state document")


def build_bound_state(
    *,
    implementation: str,
    policy: Mapping[str, Any],
    common: Mapping[str, Any],
    manifest: ShardingManifest,
    parameters: Mapping[str, BoundParameter],
) -> dict[str, Any]:
    """Build a document (owned, tight CPU copies; nothing aliases the optimizer)."""
    if type(manifest) is not ShardingManifest:
        raise StateValidationError("build_bound_state: manifest must be a ShardingManifest")
    body: dict[str, Any] = {}
    # sorted: the document (and its digest) must not depend on the order the state was walked
    for fqn in sorted(parameters):
        entry = parameters[fqn]
        if entry.shard.fqn != fqn:
            raise StateValidationError(f"build_bound_state: parameter {fqn!r} carries the shard of {entry.shard.fqn!r}")
        body[fqn] = {
            "compatibility_name": entry.compatibility_name,
            "shard": to_primitive(entry.shard),
            "group_options": _clone_value(dict(entry.group_options), f"parameters.{fqn}.group_options", tensors=True),
            "variant": entry.variant,
            "state": _clone_value(dict(entry.state), f"parameters.{fqn}.state", tensors=True),
        }
    return {
        "format": BOUND_STATE_FORMAT,
        "format_version": BOUND_STATE_FORMAT_VERSION,
        "coverage": BOUND_STATE_COVERAGE,
        "implementation": implementation,
        "policy": _clone_value(dict(policy), "policy", tensors=False),
        "common": _clone_value(dict(common), "common", tensors=True),
        "manifest": to_primitive(manifest),
        "parameters": body,
    }


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise StateValidationError(message)


def parse_bound_state(
    document: Mapping[str, Any],
    *,
    implementation: str,
    policy: Mapping[str, Any],
    manifest: ShardingManifest,
    local_shards: Iterable[ShardIdentity] | None = None,
) -> BoundStateDocument:
    """Validate ``document`` for a target with this implementation, policy and manifest.

    Strict: exact key sets and types, the envelope constants, the implementation, the
    policy (compared exactly) and the manifest (compared as descriptors) must all match;
    every parameter's shard must be in the manifest and keyed by its own FQN. With
    ``local_shards`` (the target member's own shards) the document must hold exactly those
    shards: another member's document is refused even when its shards have the same sizes.
    Returns owned copies; never mutates ``document``. Raises ``StateValidationError``
    naming the problem.
    """
    _require(type(document) is dict, "bound-state document must be a dict")
    _require(
        set(document) == _TOP_KEYS,
        f"bound-state document keys must be {sorted(_TOP_KEYS)}, got {sorted(document, key=repr)}",
    )
    _require(document["format"] == BOUND_STATE_FORMAT, f"format must be {BOUND_STATE_FORMAT!r}")
    version = document["format_version"]
    _require(
        type(version) is int and version == BOUND_STATE_FORMAT_VERSION,
        f"format_version must be the int {BOUND_STATE_FORMAT_VERSION}",
    )
    _require(document["coverage"] == BOUND_STATE_COVERAGE, f"coverage must be {BOUND_STATE_COVERAGE!r}")
    _require(
        document["implementation"] == implementation,
        f"implementation {document['implementation']!r} does not match {implementation!r}",
    )
    # cloned before comparing: nothing returned may alias the caller's document
    saved_policy = _clone_value(document["policy"], "policy", tensors=False)
    _require(type(saved_policy) is dict, "policy must be a dict")
    # the union of keys: a key only one side has is a difference too (get() gives None)
    # compared exactly: True is not 1, nor 1 1.0 (the encoding the digests use)
    differing = sorted(
        str(key)
        for key in set(saved_policy) | set(policy)
        if canonical_digest(saved_policy.get(key)) != canonical_digest(policy.get(key))
    )
    _require(
        not differing,
        "the document's policy differs from the optimizer's: "
        + "; ".join(f"{key}: document {saved_policy.get(key)!r}, optimizer {policy.get(key)!r}" for key in differing),
    )
    try:
        saved_manifest = from_primitive(document["manifest"], ShardingManifest)
    except CodecError as exc:
        raise StateValidationError(f"manifest: {exc}") from exc
    _require(saved_manifest == manifest, "the document's manifest differs from the optimizer's finalized manifest")
    parameters = document["parameters"]
    _require(type(parameters) is dict, "parameters must be a dict keyed by FQN")
    shards = set(manifest.shards)
    parsed: dict[str, BoundParameter] = {}
    for fqn, entry in parameters.items():
        where = f"parameters[{fqn!r}]"
        _require(type(fqn) is str, "parameter keys must be str FQNs")
        _require(type(entry) is dict and set(entry) == _PARAM_KEYS, f"{where} keys must be {sorted(_PARAM_KEYS)}")
        try:
            shard = from_primitive(entry["shard"], ShardIdentity)
        except CodecError as exc:
            raise StateValidationError(f"{where}.shard: {exc}") from exc
        _require(shard.fqn == fqn, f"{where} carries the shard of {shard.fqn!r}")
        _require(shard in shards, f"{where}.shard is not an element of the manifest")
        _require(type(entry["compatibility_name"]) is str, f"{where}.compatibility_name must be a str")
        _require(type(entry["variant"]) is str and bool(entry["variant"]), f"{where}.variant must be a non-empty str")
        _require(type(entry["group_options"]) is dict, f"{where}.group_options must be a dict")
        _require(type(entry["state"]) is dict, f"{where}.state must be a dict")
        parsed[fqn] = BoundParameter(
            entry["compatibility_name"],
            shard,
            _clone_value(entry["group_options"], f"{where}.group_options", tensors=True),
            entry["variant"],
            _clone_value(entry["state"], f"{where}.state", tensors=True),
        )
    if local_shards is not None:
        local = {shard.fqn: shard for shard in local_shards}
        missing, extra = sorted(set(local) - set(parsed)), sorted(set(parsed) - set(local))
        _require(
            not missing and not extra,
            f"the document's parameters differ from the local ones (missing {missing}, not local {extra})",
        )
        # same FQNs, other shards: a neighbour's slice of equal size would otherwise load silently
        foreign = sorted(fqn for fqn, entry in parsed.items() if entry.shard != local[fqn])
        _require(
            not foreign,
            f"the document was exported for other shards of {foreign[:3]} (another member's slice or another layout)",
        )
    common = _clone_value(document["common"], "common", tensors=True)
    _require(type(common) is dict, "common must be a dict")
    return BoundStateDocument(implementation, saved_policy, common, saved_manifest, parsed)

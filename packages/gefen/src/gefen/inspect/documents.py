"""Convention documents saved with ``torch.save``: portable states and canonical local state.

* ``gefen.portable_state`` and ``gefen.portable_composite_state`` (gefen-portable) carry a
  completion digest over every byte; they are verified by gefen-portable's own parsers
  (:meth:`gefen_portable.PortableState.from_document`,
  :meth:`gefen_portable.PortableCompositeState.from_document`), which recompute it and
  check every record and limit.
* ``gefen.bound_state`` (gefen-contracts) and ``gefen.composite_bound_state`` (gefen-hybrid)
  carry no digest; they are validated by gefen-contracts' envelope parser against their own
  implementation, policy and manifest (exact keys and types, shards in the manifest, finite
  tight tensors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from .report import CheckpointDescription, ParameterSummary, Problem

__all__ = ["DOCUMENT_FORMATS", "describe_document"]

_PORTABLE = "gefen.portable_state"
_PORTABLE_COMPOSITE = "gefen.portable_composite_state"
_BOUND = "gefen.bound_state"
_BOUND_COMPOSITE = "gefen.composite_bound_state"
DOCUMENT_FORMATS = frozenset({_PORTABLE, _PORTABLE_COMPOSITE, _BOUND, _BOUND_COMPOSITE})


def _tensor_bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _portable_parameters(state: Any) -> tuple[ParameterSummary, ...]:
    catalog = state.catalog
    summaries = []
    for fqn, record in catalog.parameters.items():
        fragments = catalog.fragments.get(fqn, ())
        fields = ", ".join([*record.fields, *sorted(record.replica_fields)])
        summaries.append(
            ParameterSummary(
                fqn,
                tuple(record.identity.global_shape),
                record.variant,
                sum(f.nbytes for f in fragments) + _tensor_bytes(record.replica_fields),
                f"from {record.source_layout.value}; fields {fields or '-'}",
            )
        )
    return tuple(summaries)


def _portable_facts(state: Any) -> tuple[tuple[str, str], ...]:
    catalog = state.catalog
    manifest = catalog.header.manifest
    members = {shard.local_member for shard in manifest.shards if shard.local_member is not None}
    return (
        ("root digest", catalog.digest),
        ("source layouts", ", ".join(sorted({s.layout.value for s in manifest.shards})) or "-"),
        ("source members", str(len(members)) if members else "1 (no process group)"),
        ("fragments", str(len(catalog.fragment_keys()))),
    )


def _describe_portable(document: Mapping[str, Any], path: str, file_bytes: int | None) -> CheckpointDescription:
    from gefen_contracts.limits import PortableStateLimits
    from gefen_portable import PortableState

    version = document.get("format_version")
    try:
        state = PortableState.from_document(document, limits=PortableStateLimits())
    except Exception as exc:
        return CheckpointDescription(
            path, "portable optimizer state", _PORTABLE, version if type(version) is int else None,
            implementation=document.get("implementation") if isinstance(document.get("implementation"), str) else None,
            problems=(Problem("document", _error(exc)),), file_bytes=file_bytes, tensor_bytes=_tensor_bytes(document),
        )  # fmt: skip
    return CheckpointDescription(
        path,
        "portable optimizer state",
        _PORTABLE,
        version,
        implementation=state.implementation,
        parameters=_portable_parameters(state),
        facts=_portable_facts(state),
        verified=("completion digest over every record and tensor (gefen-portable)",),
        file_bytes=file_bytes,
        tensor_bytes=_tensor_bytes(document),
    )


def _describe_portable_composite(
    document: Mapping[str, Any], path: str, file_bytes: int | None
) -> CheckpointDescription:
    from gefen_contracts.limits import PortableStateLimits
    from gefen_portable import PortableCompositeState

    version = document.get("format_version")
    try:
        state = PortableCompositeState.from_document(document, limits=PortableStateLimits())
    except Exception as exc:
        return CheckpointDescription(
            path, "portable composite state", _PORTABLE_COMPOSITE, version if type(version) is int else None,
            problems=(Problem("document", _error(exc)),), file_bytes=file_bytes, tensor_bytes=_tensor_bytes(document),
        )  # fmt: skip
    children = tuple(
        CheckpointDescription(
            f"role {role}",
            "portable optimizer state",
            _PORTABLE,
            1,
            implementation=child.implementation,
            parameters=_portable_parameters(child),
            facts=_portable_facts(child),
            tensor_bytes=sum(p.state_bytes for p in _portable_parameters(child)),
        )
        for role, child in state.children.items()
    )
    return CheckpointDescription(
        path,
        "portable composite state",
        _PORTABLE_COMPOSITE,
        version,
        implementation=state.implementation,
        facts=(("roles", ", ".join(state.roles)), ("wrapper digest", str(state.digest))),
        verified=("wrapper digest and every child's completion digest (gefen-portable)",),
        children=children,
        file_bytes=file_bytes,
        tensor_bytes=_tensor_bytes(document),
    )


def _bound(document: Mapping[str, Any], path: str) -> CheckpointDescription:
    from gefen_contracts.codec import from_primitive
    from gefen_contracts.manifest import ShardingManifest
    from gefen_contracts.torch_support import parse_bound_state

    implementation = document.get("implementation")
    version = document.get("format_version")
    common = dict(
        kind="canonical local state",
        format=_BOUND,
        format_version=version if type(version) is int else None,
        implementation=implementation if isinstance(implementation, str) else None,
        tensor_bytes=_tensor_bytes(document),
    )
    policy = document.get("policy")
    try:
        manifest = from_primitive(document.get("manifest"), ShardingManifest)
        parsed = parse_bound_state(
            dict(document),
            implementation=str(implementation),
            policy=policy if isinstance(policy, dict) else {},
            manifest=manifest,
        )
    except Exception as exc:
        return CheckpointDescription(path, problems=(Problem("document", _error(exc)),), **common)  # type: ignore[arg-type]
    parameters = tuple(
        ParameterSummary(
            fqn,
            tuple(entry.shard.parameter.global_shape),
            entry.variant,
            _tensor_bytes(dict(entry.state)),
            f"{entry.shard.layout.value} shard"
            + (f" of member {entry.shard.local_member}" if entry.shard.local_member is not None else ""),
        )
        for fqn, entry in parsed.parameters.items()
    )
    members = {s.local_member for s in manifest.shards if s.local_member is not None}
    return CheckpointDescription(
        path,
        parameters=parameters,
        facts=(
            ("layouts", ", ".join(sorted({s.layout.value for s in manifest.shards}))),
            ("members", str(len(members) or 1)),
        ),
        verified=("envelope, manifest and every parameter's record (no digest in this format)",),
        **common,  # type: ignore[arg-type]
    )


def _composite_envelope_problems(document: Mapping[str, Any], roles: list[str]) -> list[Problem]:
    """What a composite document's envelope breaks without a live composite to compare with
    (gefen-hybrid's load checks the same against the composite it loads into)."""
    from gefen_contracts import CodecError
    from gefen_contracts.codec import from_primitive
    from gefen_contracts.manifest import ShardingManifest
    from gefen_hybrid import COMPOSITE_DOCUMENT_KEYS, COMPOSITE_DOCUMENT_VERSION

    problems = []
    if set(document) != COMPOSITE_DOCUMENT_KEYS:
        wanted = sorted(COMPOSITE_DOCUMENT_KEYS)
        problems.append(Problem("envelope", f"keys must be {wanted}, got {sorted(map(str, document))}"))
    version = document.get("format_version")
    if type(version) is not int or version != COMPOSITE_DOCUMENT_VERSION:
        problems.append(Problem("format_version", f"{version!r} is not {COMPOSITE_DOCUMENT_VERSION}, the version read"))
    if not isinstance(document.get("implementation"), str) or document.get("common") != {}:
        problems.append(Problem("envelope", "'implementation' must be a string and 'common' empty"))
    policy = document.get("policy")
    declared = policy.get("child_implementations") if isinstance(policy, Mapping) else None
    if not isinstance(declared, Mapping) or not declared or sorted(map(str, declared)) != sorted(roles):
        problems.append(Problem("policy", f"child_implementations must name exactly the children's roles {roles}"))
    try:
        from_primitive(document.get("manifest"), ShardingManifest)
    except CodecError as exc:
        problems.append(Problem("manifest", str(exc)))
    routing = document.get("routing")
    pairs = routing if isinstance(routing, list) else []
    if not isinstance(routing, list) or not all(
        type(p) is list and len(p) == 2 and all(type(x) is str for x in p) for p in pairs
    ):
        problems.append(Problem("routing", "must be a list of [fqn, role] string pairs"))
    elif pairs != sorted(pairs) or not {role for _, role in pairs} <= set(roles):
        problems.append(Problem("routing", "must be sorted and route only to the document's roles"))
    return problems


def _describe_bound_composite(document: Mapping[str, Any], path: str) -> CheckpointDescription:
    problems: list[Problem] = []
    children_docs = document.get("children")
    if not isinstance(children_docs, Mapping) or not children_docs:
        problems.append(Problem("children", "must map each role to its child's document"))
        children_docs = {}
    problems.extend(_composite_envelope_problems(document, sorted(map(str, children_docs))))
    children = tuple(
        _bound(child, f"role {role}") if isinstance(child, Mapping) else CheckpointDescription(
            f"role {role}", "canonical local state", _BOUND, None, problems=(Problem("document", "is not a dict"),)
        )
        for role, child in children_docs.items()
    )  # fmt: skip
    version = document.get("format_version")
    implementation = document.get("implementation")
    return CheckpointDescription(
        path,
        "composite canonical local state",
        _BOUND_COMPOSITE,
        version if type(version) is int else None,
        implementation=implementation if isinstance(implementation, str) else None,
        facts=(("roles", ", ".join(children_docs)),),
        verified=("each child's envelope, manifest and records",),
        problems=tuple(problems),
        children=children,
        tensor_bytes=_tensor_bytes(document),
    )


def describe_document(document: Mapping[str, Any], path: str, file_bytes: int | None) -> CheckpointDescription:
    """Describe and verify a document whose ``format`` is in :data:`DOCUMENT_FORMATS`."""
    fmt = document.get("format")
    if fmt == _PORTABLE:
        return _describe_portable(document, path, file_bytes)
    if fmt == _PORTABLE_COMPOSITE:
        return _describe_portable_composite(document, path, file_bytes)
    described = _bound(document, path) if fmt == _BOUND else _describe_bound_composite(document, path)
    return dataclasses.replace(described, file_bytes=file_bytes)

"""PyTorch Distributed Checkpoint folders: what they hold and whether their digests verify.

DCP's ``.metadata`` lists every stored key. Keys are grouped by namespace: a gefen-dcp
``GefenDCPState`` (``<ns>.envelope``, ``<ns>.digests.*``, ``<ns>.tensors.*``), a portable state
(``<ns>.envelope``, ``<ns>.catalog.*``, ``<ns>.writers.*``, ``<ns>.fragments.*``), a portable
composite (``<ns>.composite``, ``<ns>.roles.<role>.*``), and everything else (a model's
weights, torch's own optimizer state), which is listed with its byte count.

Each gefen namespace is described from its own records (envelope, catalog) and, unless
``verify=False``, loaded in this process into a recorder (:mod:`gefen.inspect.recorders`)
through gefen-dcp's loaders, which authenticate the envelopes and check every chunk's
SHA-256 and every catalog and fragment digest; their error names the corrupted chunk.
Verification reads the whole optimizer state once (its stored size).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from .recorders import LoadedParameter, RecordingComposite, RecordingNativeState, RecordingPortableAdapter
from .report import CheckpointDescription, ParameterSummary, Problem

__all__ = ["describe_dcp", "is_dcp_checkpoint"]

_TRANSACTION = "gefen-inspect"


def is_dcp_checkpoint(path: Path) -> bool:
    """A folder with DCP's ``.metadata`` file."""
    return path.is_dir() and (path / ".metadata").is_file()


def _error(exc: BaseException) -> str:
    """The message of an error, unwrapping DCP's ``CheckpointException`` to its rank failures."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        inner = next(iter(failures.values()))
        cause = getattr(inner, "exc", inner)
        if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
            cause = cause[0]  # DCP's WrappedException: (exception, traceback frames)
        return f"{type(cause).__name__}: {cause}"
    return f"{type(exc).__name__}: {exc}"


def _keys(metadata: Any) -> dict[str, tuple[str, ...]]:
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict) and planner_data:
        return {key: tuple(str(p) for p in path) for key, path in planner_data.items()}
    return {key: tuple(key.split(".")) for key in metadata.state_dict_metadata}


def _stored_bytes(md: Any) -> int:
    size = getattr(md, "size", None)
    properties = getattr(md, "properties", None)
    if size is None or properties is None:
        return 0
    return int(math.prod(size)) * torch.empty((), dtype=properties.dtype).element_size()


def _read(path: Path, key: str, md: Any) -> torch.Tensor:
    """One stored tensor, whole (single-process DCP load)."""
    from gefen_dcp import GefenFileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    buffer = torch.empty(tuple(int(d) for d in md.size), dtype=md.properties.dtype)
    load({key: buffer}, storage_reader=GefenFileSystemReader(str(path)), no_dist=True)
    return buffer


def _read_json(path: Path, key: str, metadata: Any) -> dict[str, Any]:
    data = _read(path, key, metadata.state_dict_metadata[key])
    value = json.loads(bytes(data.numpy().tobytes()).decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{key} does not hold a JSON object")
    return value


def _loaded_problems(loaded: Mapping[str, LoadedParameter]) -> list[Problem]:
    return [
        Problem(f"parameter {fqn!r}", f"field {name!r} holds {count} non-finite value(s)")
        for fqn, record in sorted(loaded.items())
        for name, count in sorted(record.nonfinite.items())
    ]


def _nest(path: tuple[str, ...], value: object) -> dict[str, Any]:
    nested: Any = value
    for part in reversed(path):
        nested = {part: nested}
    assert isinstance(nested, dict)
    return nested


def _dcp_state(
    root: Path, prefix: tuple[str, ...], metadata: Any, keys: dict[str, tuple[str, ...]], verify: bool
) -> CheckpointDescription:
    name = ".".join(prefix)
    envelope_key = next(k for k, p in keys.items() if p == (*prefix, "envelope"))
    writers = sum(1 for p in keys.values() if p[: len(prefix) + 1] == (*prefix, "digests"))
    stored = sum(_stored_bytes(metadata.state_dict_metadata[k]) for k, p in keys.items() if p[: len(prefix)] == prefix)
    kind = "DCP optimizer state (GefenDCPState)"
    try:
        envelope = _read_json(root, envelope_key, metadata)
        from gefen_dcp import DCP_STATE_FORMAT, DCP_STATE_FORMAT_VERSION

        if envelope.get("format") != DCP_STATE_FORMAT:
            raise ValueError(
                f"{envelope.get('format')!r} version {envelope.get('format_version')!r} is not {DCP_STATE_FORMAT!r} "
                f"version {DCP_STATE_FORMAT_VERSION}, the format this gefen reads"
            )
        tensors_record = envelope["tensors"]
        implementation = str(envelope["implementation"])
        if not isinstance(tensors_record, dict):
            raise ValueError("the envelope's tensors are not a table")
    except (Exception, CheckpointException) as exc:  # torch's is a BaseException
        return CheckpointDescription(
            name, kind, "gefen.dcp_state", None,
            problems=(Problem(envelope_key, f"unreadable envelope: {_error(exc)}"),), tensor_bytes=stored,
        )  # fmt: skip
    from gefen_contracts import CodecError
    from gefen_contracts.torch_support import dtype_from_name
    from gefen_dcp import parameter_index

    by_parameter: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    common: list[str] = []
    for key, record in sorted(tensors_record.items()):
        index = parameter_index(key)
        if index is None:
            common.append(key)
        else:
            by_parameter.setdefault(index, []).append((key.split("/", 2)[2], record))

    def nbytes(record: dict[str, Any]) -> int:
        try:  # the record is not verified yet; verification reports a bad one
            return int(math.prod(record.get("shape", ()))) * dtype_from_name(record.get("dtype")).itemsize
        except (CodecError, TypeError):
            return 0

    parameters = tuple(
        ParameterSummary(
            f"state/{index}",
            next((tuple(r["shape"]) for _, r in entries if r.get("placement") == "like_parameter"), None),
            "",
            sum(nbytes(r) for _, r in entries),
            ", ".join(
                f"{field} {r.get('dtype')}{list(r.get('shape', ()))} {r.get('placement')}" for field, r in entries
            ),
        )
        for index, entries in sorted(by_parameter.items())
    )
    problems: list[Problem] = []
    verified: list[str] = []
    if verify:
        from gefen_contracts.limits import PortableStateLimits
        from gefen_dcp import GefenDCPState, GefenFileSystemReader, GefenLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import load

        recorder = RecordingNativeState(implementation, max(by_parameter, default=-1) + 1)
        limits = PortableStateLimits(max_fragment_tensor_bytes=max(1, 2 * stored))
        try:
            load(
                _nest(prefix, GefenDCPState(recorder, limits=limits)),
                storage_reader=GefenFileSystemReader(str(root)),
                planner=GefenLoadPlanner(limits=limits),
                no_dist=True,
            )
            verified.append(
                f"envelope digest and the SHA-256 of every stored chunk against {writers} writer table(s) (gefen-dcp)"
            )
            problems.extend(_loaded_problems(recorder.loaded))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            problems.append(Problem(name, _error(exc)))
    return CheckpointDescription(
        name,
        kind,
        str(envelope.get("format")),
        envelope.get("format_version") if type(envelope.get("format_version")) is int else None,
        implementation=implementation,
        parameters=parameters,
        facts=(
            ("namespace", name),
            ("writers", str(writers)),
            ("envelope digest", str(envelope.get("digest"))),
            ("optimizer-wide tensors", ", ".join(common) or "-"),
        ),
        verified=tuple(verified),
        problems=tuple(problems),
        tensor_bytes=stored,
    )


def _catalog(
    root: Path, namespace: tuple[str, ...], metadata: Any, keys: dict[str, tuple[str, ...]]
) -> tuple[dict[str, Any], Any]:
    """The envelope record and the catalog of one portable namespace (read, rebuilt, digest-checked)."""
    from gefen_contracts.limits import PortableStateLimits
    from gefen_portable import PortableState, parse_wire, reconstruct_wire

    by_path = {p: k for k, p in keys.items()}
    envelope = _read_json(root, by_path[(*namespace, "envelope")], metadata)
    wire_key = by_path[(*namespace, "catalog", "wire")]
    limits = PortableStateLimits()
    wire = parse_wire(
        bytes(_read(root, wire_key, metadata.state_dict_metadata[wire_key]).numpy().tobytes()), limits=limits
    )
    tensors = []
    for index in range(int(envelope["catalog_tensors"])):
        key = by_path[(*namespace, "catalog", "tensors", f"t{index:06d}")]
        tensors.append(_read(root, key, metadata.state_dict_metadata[key]))
    record = reconstruct_wire(wire, tensors, expected_digest=envelope["catalog_wire_digest"])
    return envelope, PortableState.from_parts(record, [], limits=limits).catalog


def _catalog_parameters(catalog: Any) -> tuple[ParameterSummary, ...]:
    return tuple(
        ParameterSummary(
            fqn,
            tuple(record.identity.global_shape),
            record.variant,
            sum(f.nbytes for f in catalog.fragments.get(fqn, ())),
            f"{len(catalog.fragments.get(fqn, ()))} fragment(s) from {record.source_layout.value}",
        )
        for fqn, record in catalog.parameters.items()
    )


def _recorder(catalog: Any) -> RecordingPortableAdapter:
    shapes = [(fqn, tuple(record.identity.global_shape)) for fqn, record in catalog.parameters.items()]
    return RecordingPortableAdapter(catalog.implementation, shapes)


def _portable_load(root: Path, namespace: str, optimizer: object) -> None:
    from gefen_contracts.identity import ProcessGroupIdentity
    from gefen_contracts.limits import PortableStateLimits
    from gefen_contracts.torch_support import CheckpointProcessGroupBinding
    from gefen_dcp import GefenFileSystemReader, load_portable_dcp

    binding = CheckpointProcessGroupBinding(
        ProcessGroupIdentity("gefen-inspect", ("rank:0",)), "rank:0", None, torch.device("cpu")
    )
    load_portable_dcp(
        optimizer,
        checkpoint_process_group=binding,
        storage_reader=GefenFileSystemReader(str(root)),
        transaction_id=_TRANSACTION,
        limits=PortableStateLimits(),
        namespace=namespace,
    )


def _portable(
    root: Path, namespace: str, metadata: Any, keys: dict[str, tuple[str, ...]], verify: bool
) -> CheckpointDescription:
    stored = sum(_stored_bytes(metadata.state_dict_metadata[k]) for k, p in keys.items() if p[:1] == (namespace,))
    kind = "DCP portable optimizer state"
    try:
        envelope, catalog = _catalog(root, (namespace,), metadata, keys)
    except (Exception, CheckpointException) as exc:  # torch's is a BaseException
        return CheckpointDescription(
            namespace, kind, "gefen.portable_dcp", None,
            problems=(Problem(f"{namespace} catalog", _error(exc)),), tensor_bytes=stored,
        )  # fmt: skip
    problems: list[Problem] = []
    verified: list[str] = []
    if verify:
        recorder = _recorder(catalog)
        try:
            _portable_load(root, namespace, recorder)
            verified.append(
                "envelope, catalog root digest, every chunk's SHA-256 and every fragment digest (gefen-dcp, gefen-portable)"
            )
            problems.extend(_loaded_problems(recorder.loaded))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            problems.append(Problem(namespace, _error(exc)))
    return CheckpointDescription(
        namespace,
        kind,
        str(envelope.get("format")),
        envelope.get("format_version") if type(envelope.get("format_version")) is int else None,
        implementation=catalog.implementation,
        parameters=_catalog_parameters(catalog),
        facts=(
            ("namespace", namespace),
            ("root digest", catalog.digest),
            ("writers", str(envelope.get("writers"))),
            ("chunk bytes", str(envelope.get("chunk_bytes"))),
        ),
        verified=tuple(verified),
        problems=tuple(problems),
        tensor_bytes=stored,
    )


def _portable_composite(
    root: Path, namespace: str, metadata: Any, keys: dict[str, tuple[str, ...]], verify: bool
) -> CheckpointDescription:
    stored = sum(_stored_bytes(metadata.state_dict_metadata[k]) for k, p in keys.items() if p[:1] == (namespace,))
    kind = "DCP portable composite state"
    by_path = {p: k for k, p in keys.items()}
    try:
        envelope = _read_json(root, by_path[(namespace, "composite")], metadata)
        roles = [str(role) for role in envelope["roles"]]
        catalogs = {role: _catalog(root, (namespace, "roles", role), metadata, keys)[1] for role in roles}
    except (Exception, CheckpointException) as exc:  # torch's is a BaseException
        return CheckpointDescription(
            namespace, kind, "gefen.portable_dcp_composite", None,
            problems=(Problem(f"{namespace} composite records", _error(exc)),), tensor_bytes=stored,
        )  # fmt: skip
    children = {role: _recorder(catalog) for role, catalog in catalogs.items()}
    problems: list[Problem] = []
    verified: list[str] = []
    if verify:
        composite = RecordingComposite(str(envelope["implementation"]), children, dict(envelope["routing"]))
        try:
            _portable_load(root, namespace, composite)
            verified.append("composite envelope and wrapper digest; every child's root, chunk and fragment digests")
            for child in children.values():
                problems.extend(_loaded_problems(child.loaded))
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            problems.append(Problem(namespace, _error(exc)))
    described = tuple(
        CheckpointDescription(
            f"role {role}",
            "DCP portable optimizer state",
            "gefen.portable_dcp",
            1,
            implementation=catalog.implementation,
            parameters=_catalog_parameters(catalog),
            facts=(("root digest", catalog.digest),),
            tensor_bytes=catalog.total_fragment_bytes,
        )
        for role, catalog in catalogs.items()
    )
    return CheckpointDescription(
        namespace,
        kind,
        str(envelope.get("format")),
        envelope.get("format_version") if type(envelope.get("format_version")) is int else None,
        implementation=str(envelope.get("implementation")),
        facts=(
            ("namespace", namespace),
            ("roles", ", ".join(roles)),
            ("wrapper digest", str(envelope.get("wrapper_digest"))),
        ),
        verified=tuple(verified),
        problems=tuple(problems),
        children=described,
        tensor_bytes=stored,
    )


def describe_dcp(root: Path, *, verify: bool = True) -> CheckpointDescription:
    """Describe (and verify) every gefen namespace of a DCP folder (module docstring)."""
    with warnings.catch_warnings():
        # single-process DCP loads say so on every call; that is what inspection wants
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return _describe_dcp(root, verify)


def _describe_dcp(root: Path, verify: bool) -> CheckpointDescription:
    from gefen_dcp import MetadataFormatError, read_dcp_metadata

    file_bytes = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    try:
        metadata = read_dcp_metadata(root / ".metadata")
    except MetadataFormatError as exc:
        return CheckpointDescription(
            str(root), "DCP checkpoint", "torch.distributed.checkpoint", None, file_bytes=file_bytes, recognised=False,
            facts=(("recognised", f"a DCP folder whose .metadata gefen cannot read safely, refused unread "
                                  f"({_error(exc)}): damaged, hostile, or written by another torch"),),
        )  # fmt: skip
    except Exception as exc:
        return CheckpointDescription(
            str(root), "DCP checkpoint", "torch.distributed.checkpoint", None, file_bytes=file_bytes, recognised=False,
            facts=(("recognised", f"a DCP folder whose .metadata this torch cannot read ({_error(exc)}): "
                    "written by another torch version, or damaged"),),
        )  # fmt: skip
    keys = _keys(metadata)
    paths = set(keys.values())
    children: list[CheckpointDescription] = []
    claimed: set[str] = set()
    prefixes = sorted({p[:-1] for p in paths if p[-1] == "envelope"} | {p[:-1] for p in paths if p[-1] == "composite"})
    for prefix in prefixes:
        if len(prefix) >= 2 and prefix[-2] == "roles":
            continue  # a composite's child: described with its composite
        under = {k for k, p in keys.items() if p[: len(prefix)] == prefix}
        if (*prefix, "composite") in paths and len(prefix) == 1:
            children.append(_portable_composite(root, prefix[0], metadata, keys, verify))
        elif (*prefix, "catalog", "wire") in paths and len(prefix) == 1:
            children.append(_portable(root, prefix[0], metadata, keys, verify))
        elif any(p[: len(prefix) + 1] == (*prefix, "digests") for p in paths):
            children.append(_dcp_state(root, prefix, metadata, keys, verify))
        else:
            continue
        claimed |= under
    others = sorted(set(keys) - claimed)
    other_bytes = sum(_stored_bytes(metadata.state_dict_metadata[k]) for k in others)
    facts = [("keys", str(len(keys))), ("gefen namespaces", str(len(children)))]
    if others:
        # (a model's weights: no digest covers them, so "OK" says nothing about them)
        facts.append(("other keys", f"{len(others)} ({other_bytes:,} B), e.g. {', '.join(others[:3])}; not verified"))
    if not children:
        facts.append(
            (
                "recognised",
                "a DCP checkpoint without a gefen-dcp namespace (torch's get_state_dict recipe, a model): its "
                "tensors carry no digests; verify it by loading it into the optimizer's template (dcp.load)",
            )
        )
    return CheckpointDescription(
        str(root),
        "DCP checkpoint",
        "torch.distributed.checkpoint",
        None,
        facts=tuple(facts),
        recognised=bool(children),
        children=tuple(children),
        file_bytes=file_bytes,
        tensor_bytes=sum(_stored_bytes(md) for md in metadata.state_dict_metadata.values()),
    )

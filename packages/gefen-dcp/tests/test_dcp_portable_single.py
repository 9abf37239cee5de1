"""save_portable_dcp / load_portable_dcp in one process: formats (golden vectors), the key
layout, exact round trips, and every refusal with the optimizer unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dcp_portable_adopter import PieceSGD, manifest, reference_momentum
from gefen_contracts import ContractTypeError
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_dcp import (
    CHUNK_TABLE_FORMAT,
    PORTABLE_DCP_FORMAT,
    CheckpointIntegrityError,
    CheckpointLayoutError,
    EnvelopeFormatError,
    GefenFileSystemWriter,
    load_portable_dcp,
    save_portable_dcp,
)
from gefen_dcp.portable_format import (
    ChunkTable,
    CompositeEnvelope,
    FragmentChunk,
    PortableEnvelope,
    decode_chunk_table,
    decode_composite_envelope,
    decode_portable_envelope,
    encode_chunk_table,
    encode_composite_envelope,
    encode_portable_envelope,
)
from gefen_portable import PortableIntegrityError, PortableLimitError
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

GOLDEN = Path(__file__).parent / "golden"
LIMITS = PortableStateLimits(chunk_bytes=24)
SINGLE = CheckpointProcessGroupBinding(ProcessGroupIdentity("single", ("rank:0",)), "rank:0", None, "cpu")
STEPS = 3


def test_portable_envelope_chunk_table_and_composite_golden_vectors() -> None:
    limits = PortableStateLimits()
    envelope = PortableEnvelope("optimizer", "a" * 64, "b" * 64, 2, 3, 8 << 20)
    golden = (GOLDEN / "portable_dcp_envelope_v2.json").read_bytes()
    assert encode_portable_envelope(envelope, limits=limits) == golden
    assert decode_portable_envelope(golden, limits=limits) == envelope
    assert json.loads(golden)["format"] == PORTABLE_DCP_FORMAT
    table = ChunkTable(
        "a" * 64,
        1,
        (
            FragmentChunk("embed.weight", 1, "momentum", 0, 6, "c" * 64),
            FragmentChunk("embed.weight", 1, "momentum", 6, 2, "d" * 64),
        ),
    )
    golden = (GOLDEN / "portable_dcp_chunks_v1.json").read_bytes()
    assert encode_chunk_table(table, limits=limits) == golden
    assert decode_chunk_table(golden, limits=limits) == table
    assert json.loads(golden)["format"] == CHUNK_TABLE_FORMAT
    composite = CompositeEnvelope(
        "optimizer",
        "vendor.Composite",
        ("muon", "backup"),
        (("embed.weight", "backup"), ("layers.0.w", "muon")),
        (("muon", "a" * 64), ("backup", "b" * 64)),
        "c" * 64,
    )
    golden = (GOLDEN / "portable_dcp_composite_v1.json").read_bytes()
    assert encode_composite_envelope(composite, limits=limits) == golden
    assert decode_composite_envelope(golden, limits=limits) == composite
    tampered = json.loads((GOLDEN / "portable_dcp_envelope_v2.json").read_bytes())
    tampered["writers"] = 4
    with pytest.raises(EnvelopeFormatError, match="digest"):
        decode_portable_envelope(json.dumps(tampered, sort_keys=True, separators=(",", ":")).encode(), limits=limits)


def _trained() -> PieceSGD:
    optimizer = PieceSGD(manifest("replicated", 1), None)
    optimizer.train(0, STEPS)
    return optimizer


def _save(optimizer: PieceSGD, path: Path, **options: object) -> None:
    save_portable_dcp(
        optimizer,
        checkpoint_process_group=SINGLE,
        storage_writer=GefenFileSystemWriter(path),
        transaction_id="save",
        limits=options.pop("limits", LIMITS),  # type: ignore[arg-type]
        **options,  # type: ignore[arg-type]
    )


def _load(optimizer: PieceSGD, path: Path, **options: object) -> None:
    load_portable_dcp(
        optimizer,
        checkpoint_process_group=SINGLE,
        storage_reader=FileSystemReader(path),
        transaction_id="load",
        limits=options.pop("limits", LIMITS),  # type: ignore[arg-type]
        **options,  # type: ignore[arg-type]
    )


def test_round_trip_is_exact_tensor_only_and_chunked(tmp_path: Path) -> None:
    optimizer = _trained()
    before = deep_snapshot(optimizer)
    _save(optimizer, tmp_path)
    assert not snapshot_diff(before, optimizer)
    metadata = FileSystemReader(tmp_path).read_metadata()
    assert not any(isinstance(md, BytesStorageMetadata) for md in metadata.state_dict_metadata.values())
    embed = metadata.state_dict_metadata["optimizer.fragments.embed.weight.0.momentum"]
    assert tuple(embed.size) == (48,) and len(embed.chunks) == 8  # 24-byte chunks of 48 fp32 elements
    fresh = PieceSGD(manifest("replicated", 1), None)
    _load(fresh, tmp_path)
    reference = reference_momentum(STEPS)
    assert all(torch.equal(v, reference[k]) for k, v in fresh.momentum().items())  # type: ignore[arg-type]


def _storage(path: Path, key: str) -> object:
    metadata = FileSystemReader(path).read_metadata()
    return next(info for index, info in metadata.storage_data.items() if index.fqn == key)


def _flip(path: Path, key: str, needle: bytes, delta: int = 1) -> None:
    info = _storage(path, key)
    target = path / info.relative_path  # type: ignore[attr-defined]
    data = bytearray(target.read_bytes())
    start = info.offset  # type: ignore[attr-defined]
    position = bytes(data[start : start + info.length]).find(needle)  # type: ignore[attr-defined]
    assert position >= 0, f"{needle!r} not found in {key}"
    data[start + position + delta] ^= 0x01
    target.write_bytes(bytes(data))


def _flip_fragment(path: Path) -> None:
    elements = reference_momentum(STEPS)["embed.weight"].reshape(-1)[:4].numpy().tobytes()
    _flip(path, "optimizer.fragments.embed.weight.0.momentum", elements)


def _flip_envelope(path: Path) -> None:
    _flip(path, "optimizer.envelope", b'"writers":1', delta=10)


def _flip_wire(path: Path) -> None:
    _flip(path, "optimizer.catalog.wire", b"embed.weight")


def _flip_table(path: Path) -> None:
    _flip(path, "optimizer.writers.writer_00000", b'"momentum",0,')


def _truncate(path: Path) -> None:
    info = _storage(path, "optimizer.fragments.embed.weight.0.momentum")
    target = path / info.relative_path  # type: ignore[attr-defined]
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], type[BaseException]]] = {
    "fragment_chunk": (_flip_fragment, CheckpointIntegrityError),
    "envelope": (_flip_envelope, EnvelopeFormatError),
    "catalog_wire": (_flip_wire, PortableIntegrityError),
    # a planning or read failure is the member's own error, no longer DCP's CheckpointException
    # (a BaseException that `except Exception` let through)
    "chunk_table": (_flip_table, CheckpointIntegrityError),  # the plan no longer matches the stored chunks
    "truncated_file": (_truncate, RuntimeError),  # torch's reader: "unexpected EOF"
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_portable_checkpoints_are_refused_unchanged(name: str, tmp_path: Path) -> None:
    _save(_trained(), tmp_path)
    corrupt, error = CORRUPTIONS[name]
    corrupt(tmp_path)
    target = PieceSGD(manifest("replicated", 1), None)
    target.train(0, 1)
    before = deep_snapshot(target)
    with pytest.raises(error):
        _load(target, tmp_path)
    assert not snapshot_diff(before, target)


def test_namespace_and_storage_are_checked_before_any_io(tmp_path: Path) -> None:
    optimizer = _trained()
    for namespace in ("", "a.b", "x y", "bad\x00"):
        with pytest.raises(EnvelopeFormatError, match="namespace"):
            _save(optimizer, tmp_path, namespace=namespace)
    with pytest.raises(ContractTypeError, match="StorageWriter"):
        save_portable_dcp(
            optimizer,
            checkpoint_process_group=SINGLE,
            storage_writer=object(),
            transaction_id="t",
            limits=LIMITS,  # type: ignore[arg-type]
        )
    with pytest.raises(ContractTypeError, match="CheckpointProcessGroupBinding"):
        save_portable_dcp(
            optimizer,
            checkpoint_process_group=None,
            storage_writer=GefenFileSystemWriter(tmp_path),
            transaction_id="t",
            limits=LIMITS,  # type: ignore[arg-type]
        )
    assert not (tmp_path / ".metadata").exists()


def test_wrong_namespace_and_limits_are_refused_from_the_metadata(tmp_path: Path) -> None:
    _save(_trained(), tmp_path, namespace="first")
    target = PieceSGD(manifest("replicated", 1), None)
    before = deep_snapshot(target)
    with pytest.raises(CheckpointLayoutError, match="no portable state under the namespace 'second'") as caught:
        _load(target, tmp_path, namespace="second")
    assert isinstance(caught.value.__cause__, CheckpointException)  # DCP's own, kept as the cause
    small = PortableStateLimits(chunk_bytes=24, max_fragment_tensor_bytes=64)
    # the catalog read from the metadata announces a 192-byte fragment: refused before DCP reads any tensor
    with pytest.raises(PortableLimitError) as limited:
        _load(target, tmp_path, namespace="first", limits=small)
    assert limited.value.limit == "max_fragment_tensor_bytes"
    assert not snapshot_diff(before, target)


def test_composite_round_trip_and_refusals(tmp_path: Path) -> None:
    from dcp_portable_adopter import PieceComposite

    composite = PieceComposite("replicated", 1, None)
    composite.train(0, STEPS)
    save_portable_dcp(
        composite,
        checkpoint_process_group=SINGLE,
        storage_writer=GefenFileSystemWriter(tmp_path),
        transaction_id="s",
        limits=LIMITS,
    )
    keys = set(FileSystemReader(tmp_path).read_metadata().state_dict_metadata)
    assert "optimizer.composite" in keys and "optimizer.roles.first.envelope" in keys
    assert "optimizer.roles.second.fragments.head.weight.0.momentum" in keys
    fresh = PieceComposite("replicated", 1, None)
    load_portable_dcp(
        fresh,
        checkpoint_process_group=SINGLE,
        storage_reader=FileSystemReader(tmp_path),
        transaction_id="l",
        limits=LIMITS,
    )
    reference = reference_momentum(STEPS)
    assert all(torch.equal(v, reference[k]) for k, v in fresh.momentum().items())  # type: ignore[arg-type]
    single = PieceSGD(manifest("replicated", 1), None)
    with pytest.raises(CheckpointLayoutError, match="holds a composite optimizer's state"):
        _load(single, tmp_path)
    _flip(tmp_path, "optimizer.composite", b'"roles":["first"', delta=12)
    target = PieceComposite("replicated", 1, None)
    before = deep_snapshot(*target.children.values())
    with pytest.raises(EnvelopeFormatError):
        load_portable_dcp(
            target,
            checkpoint_process_group=SINGLE,
            storage_reader=FileSystemReader(tmp_path),
            transaction_id="l",
            limits=LIMITS,
        )
    assert not snapshot_diff(before, *target.children.values())


class _DottedFieldSGD(PieceSGD):
    """Exports its momentum under a dotted field name, which gefen-portable accepts."""

    def portable_export(self) -> Any:
        from gefen_contracts.exchange import PortableExport, PortableSlotState

        base = super().portable_export()
        slots = tuple(
            PortableSlotState(s.layout, s.options, s.variant, s.counters, element_fields={"momentum.buffer": v})
            for s in base.slots
            for v in s.element_fields.values()
        )
        return PortableExport(base.implementation, base.policy, base.common, base.manifest, slots)


def test_a_dotted_field_name_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A load refuses a dotted field (``fqn "x", field "y.1.z"`` and ``fqn "x.0.y", index 1,
    field "z"`` flatten to one DCP key), so the save refuses it first rather than write a
    checkpoint no load can read."""
    optimizer = _DottedFieldSGD(manifest("replicated", 1), None)
    optimizer.train(0, STEPS)
    with pytest.raises(EnvelopeFormatError, match=r"must not contain '\.'"):
        _save(optimizer, tmp_path)
    assert not (tmp_path / ".metadata").exists()

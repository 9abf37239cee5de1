"""Envelope and digest-table formats (golden vectors, strict parsing), chunk digests,
geometry and stored-chunk validation. No process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gefen_contracts import FrozenMap, PortableStateLimits
from gefen_dcp import DENSE_SHARD_FORMAT, DIGEST_TABLE_FORMAT, CheckpointLayoutError, EnvelopeFormatError
from gefen_dcp.digest_table import ChunkRecord, DigestTable, chunk_digest, decode_digest_table, encode_digest_table
from gefen_dcp.envelope import DenseShardEnvelope, ParameterEntry, decode_envelope, encode_envelope
from gefen_dcp.geometry import RowChunk, ShardGeometry
from gefen_dcp.load_session import StoredChunk, _check_chunks

GOLDEN = Path(__file__).parent / "golden"
LIMITS = PortableStateLimits()

ENVELOPE = DenseShardEnvelope(
    "vendor.Optimizer",
    FrozenMap({"global_step": 7, "deterministic": True, "name": "gefen ✓"}),
    (
        ParameterEntry(
            "layers.0.weight",
            (4, 3),
            FrozenMap({"lr": 0.01, "betas": [0.9, 0.95]}),
            "block",
            FrozenMap({"step": 7}),
            ("momentum", "second_moment"),
        ),
        ParameterEntry("bias", (3,), FrozenMap({"lr": 0.01, "weight_decay": 0.0}), "pristine", FrozenMap(), ()),
    ),
)
CHUNK = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 8
CHUNK_SHA256 = "259a2e23297810b6704586ca682a0f0497faa0a2260e08a6a30aa79b78fd621b"


def _table(written: bool, digest: str) -> DigestTable:
    return DigestTable(
        3,
        (
            ChunkRecord("layers.0.weight", "momentum", (0, 0), (2, 3), True, CHUNK_SHA256),
            ChunkRecord("layers.0.weight", "momentum", (2, 0), (2, 3), written, digest),
        ),
    )


def test_envelope_golden_vector() -> None:
    golden = (GOLDEN / "dense_shard_envelope_v1.json").read_bytes()
    assert encode_envelope(ENVELOPE, limits=LIMITS) == golden
    assert ENVELOPE.digest() == "f096b9a5cb261a6b190732fd1ae38d4905a0ef5fd71f2a49fe4498d10ea840e4"
    decoded = decode_envelope(golden, limits=LIMITS)
    assert encode_envelope(decoded, limits=LIMITS) == golden
    assert decoded.implementation == "vendor.Optimizer"
    weight = decoded.by_fqn()["layers.0.weight"]
    assert weight.global_shape == (4, 3) and weight.fields == ("momentum", "second_moment")
    assert weight.counters == {"step": 7} and weight.options["betas"] == [0.9, 0.95]
    assert json.loads(golden)["format"] == DENSE_SHARD_FORMAT


def _mutated(change: object) -> bytes:
    value = json.loads((GOLDEN / "dense_shard_envelope_v1.json").read_bytes())
    change(value)  # type: ignore[operator]
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v["parameters"]["bias"].update(variant="other"),  # content changed, digest not
        lambda v: v.update(format_version=2),
        lambda v: v.update(format="gefen.other"),
        lambda v: v.pop("common"),
        lambda v: v["parameters"]["layers.0.weight"]["counters"].update(step=True),
        lambda v: v["parameters"]["layers.0.weight"].update(fields=["second_moment", "momentum"]),
    ],
    ids=["digest", "version", "format", "missing_key", "bool_counter", "unsorted_fields"],
)
def test_envelope_refuses_tampering(change: object) -> None:
    with pytest.raises(EnvelopeFormatError):
        decode_envelope(_mutated(change), limits=LIMITS)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe",
        b'{"a":1,"a":2}',
        b'{"a":NaN}',
        b'{"a": 1}',
        b"[1,2",
    ],
    ids=["utf8", "duplicate_key", "nan", "non_canonical_spacing", "truncated"],
)
def test_envelope_parser_refuses_non_canonical_bytes(data: bytes) -> None:
    with pytest.raises(EnvelopeFormatError):
        decode_envelope(data, limits=LIMITS)


def test_envelope_limits_are_enforced_before_parsing() -> None:
    golden = (GOLDEN / "dense_shard_envelope_v1.json").read_bytes()
    small = PortableStateLimits(max_metadata_bytes=len(golden) - 1)
    with pytest.raises(EnvelopeFormatError, match="max_metadata_bytes"):
        decode_envelope(golden, limits=small)
    with pytest.raises(EnvelopeFormatError, match="max_metadata_bytes"):
        encode_envelope(ENVELOPE, limits=small)


def test_field_names_cannot_contain_dots() -> None:
    bad = DenseShardEnvelope("x.Y", FrozenMap(), (ParameterEntry("w", (1,), FrozenMap(), "v", FrozenMap(), ("a.b",)),))
    with pytest.raises(EnvelopeFormatError, match="must not contain"):
        decode_envelope(encode_envelope(bad, limits=LIMITS), limits=LIMITS)


def test_chunk_digest_golden_and_layout_independent() -> None:
    assert chunk_digest(CHUNK) == CHUNK_SHA256
    assert chunk_digest(CHUNK.t().contiguous().t()) == CHUNK_SHA256  # non-contiguous input, same elements
    changed = CHUNK.clone()
    changed[1, 2] = torch.nextafter(changed[1, 2], torch.tensor(2.0))
    assert chunk_digest(changed) != CHUNK_SHA256


def test_digest_table_golden_vector_and_fixed_width() -> None:
    golden = (GOLDEN / "dense_shard_digests_v1.json").read_bytes()
    assert encode_digest_table(_table(False, "0" * 64), limits=LIMITS) == golden
    assert len(encode_digest_table(_table(True, "a" * 64), limits=LIMITS)) == len(golden)
    table = decode_digest_table(golden, limits=LIMITS)
    assert table.writer == 3 and [r.written for r in table.chunks] == [True, False]
    assert table.chunks[0].digest == CHUNK_SHA256
    assert json.loads(golden)["format"] == DIGEST_TABLE_FORMAT


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v["chunks"][0].__setitem__(4, "x"),
        lambda v: v["chunks"][0].__setitem__(5, "Z" * 64),
        lambda v: v["chunks"].reverse(),
        lambda v: v["chunks"][0].__setitem__(2, [0]),
        lambda v: v.update(format_version=0),
    ],
    ids=["flag", "digest", "unsorted", "rank", "version"],
)
def test_digest_table_refuses_malformed_records(change: object) -> None:
    value = json.loads((GOLDEN / "dense_shard_digests_v1.json").read_bytes())
    change(value)  # type: ignore[operator]
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(EnvelopeFormatError):
        decode_digest_table(data, limits=LIMITS)


def test_row_chunks_respect_the_byte_budget() -> None:
    geometry = ShardGeometry((10, 4), (3, 0), (5, 4))
    chunks = geometry.row_chunks(chunk_bytes=2 * 4 * 4)
    assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 5)]
    assert [c.offsets for c in chunks] == [(3, 0), (5, 0), (7, 0)]
    assert all(c.numel * 4 <= 32 for c in chunks)
    assert geometry.row_chunks(chunk_bytes=1) == tuple(
        RowChunk(r, r + 1, (3 + r, 0), (1, 4)) for r in range(5)
    )  # at least one row per chunk
    assert ShardGeometry((), (), ()).row_chunks(8) == (RowChunk(0, 0, (), ()),)
    assert ShardGeometry((6, 2), (6, 0), (0, 2)).row_chunks(8) == ()  # empty local shard: nothing to write
    assert len(ShardGeometry((0, 2), (0, 0), (0, 2)).row_chunks(8)) == 1  # empty parameter keeps its key


def test_geometry_overlap_and_bounds() -> None:
    geometry = ShardGeometry((10, 4), (3, 0), (5, 4))
    assert geometry.overlap((0, 0), (4, 4)) == ((3, 0), (1, 4))
    assert geometry.overlap((8, 0), (2, 4)) is None
    with pytest.raises(CheckpointLayoutError):
        ShardGeometry((10, 4), (8, 0), (5, 4))


def _chunks(*boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> list[StoredChunk]:
    return [StoredChunk(i, offsets, sizes) for i, (offsets, sizes) in enumerate(boxes)]


def test_stored_chunk_validation() -> None:
    _check_chunks("k", (4, 2), _chunks(((0, 0), (2, 2)), ((2, 0), (2, 2))))
    with pytest.raises(CheckpointLayoutError, match="overlap"):
        _check_chunks("k", (4, 2), _chunks(((0, 0), (3, 2)), ((2, 0), (2, 2))))
    with pytest.raises(CheckpointLayoutError, match="cover"):
        _check_chunks("k", (4, 2), _chunks(((0, 0), (2, 2))))
    with pytest.raises(CheckpointLayoutError, match="leaves"):
        _check_chunks("k", (4, 2), _chunks(((0, 0), (2, 2)), ((3, 0), (2, 2))))
    with pytest.raises(CheckpointLayoutError, match="0-d"):
        _check_chunks("k", (), _chunks(((), ()), ((), ())))

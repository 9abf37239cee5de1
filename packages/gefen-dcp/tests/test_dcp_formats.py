"""Skeleton, envelope and digest-table formats (golden vectors, strict parsing), chunk
digests, geometry and stored-chunk validation. No process group."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_dcp import DCP_STATE_FORMAT, DIGEST_TABLE_FORMAT, CheckpointLayoutError, EnvelopeFormatError
from gefen_dcp.digest_table import ChunkRecord, DigestTable, chunk_digest, decode_digest_table, encode_digest_table
from gefen_dcp.envelope import DcpStateEnvelope, TensorEntry, decode_envelope, encode_envelope
from gefen_dcp.geometry import ShardGeometry
from gefen_dcp.load_session import StoredChunk, _check_chunks
from gefen_dcp.portable_format import decode_chunk_table, decode_composite_envelope, decode_portable_envelope
from gefen_dcp.skeleton import parameter_index, rebuild, split

GOLDEN = Path(__file__).parent / "golden"
REGEN = bool(os.environ.get("GEFEN_REGEN_GOLDEN"))
LIMITS = PortableStateLimits()

NATIVE = {
    "state": {
        0: {"step": 7, "codes": torch.arange(12, dtype=torch.uint8).reshape(4, 3), "v_col": torch.ones(3)},
        1: {"step": 7, "momentum": torch.zeros(3)},
    },
    "param_groups": [
        {"lr": 0.01, "betas": (0.9, 0.95), "clip": math.inf, "names": ["a", "b"], "params": [0, 1], "tag": None},
    ],
    "codebook": torch.linspace(-1, 1, 4),
    "name": "gefen ✓",
}
SKELETON, TENSORS = split(NATIVE)
ENVELOPE = DcpStateEnvelope(
    "vendor.Optimizer",
    SKELETON,
    {
        "state/0/codes": TensorEntry(torch.uint8, (4, 3), "like_parameter"),
        "state/0/v_col": TensorEntry(torch.float32, (3,), "replicated"),
        "state/1/momentum": TensorEntry(torch.float32, (3,), "like_parameter"),
        "codebook": TensorEntry(torch.float32, (4,), "plain"),
        "state/0/scale+v_row": TensorEntry(
            torch.float32, (4, 3), "like_parameter", (("state/0/scale", (2,)), ("state/0/v_row", ()))
        ),
    },
    "0123456789abcdef0123456789abcdef",
)
CHUNK = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 8
CHUNK_SHA256 = "259a2e23297810b6704586ca682a0f0497faa0a2260e08a6a30aa79b78fd621b"


def _golden(name: str, data: bytes) -> bytes:
    path = GOLDEN / name
    if REGEN:
        path.write_bytes(data)
    return path.read_bytes()


def _table(written: bool, digest: str) -> DigestTable:
    return DigestTable(
        3,
        "0123456789abcdef0123456789abcdef",
        (
            ChunkRecord("state/0/codes", (0, 0), (2, 3), True, CHUNK_SHA256),
            ChunkRecord("state/0/codes", (2, 0), (2, 3), written, digest),
        ),
    )


def test_skeleton_rebuilds_the_state_dict_exactly() -> None:
    assert sorted(TENSORS) == ["codebook", "state/0/codes", "state/0/v_col", "state/1/momentum"]
    rebuilt = rebuild(SKELETON, lambda key: TENSORS[key])
    assert_trees_equal(rebuilt, NATIVE)
    assert type(rebuilt["param_groups"][0]["betas"]) is tuple and list(rebuilt["state"]) == [0, 1]
    assert math.isinf(rebuilt["param_groups"][0]["clip"])
    assert parameter_index("state/1/momentum") == 1 and parameter_index("codebook") is None
    with pytest.raises(CheckpointLayoutError, match="tensors and primitives"):
        split({"state": {0: {"bad": object()}}})
    with pytest.raises(CheckpointLayoutError, match="without '/'"):
        split({"state": {"a/b": 1}})
    with pytest.raises(CheckpointLayoutError, match="share this tensor key"):
        split({"state": {0: torch.zeros(1), "0": torch.ones(1)}})
    with pytest.raises(EnvelopeFormatError, match="unknown tag"):
        rebuild({"dict": [["x", {"pickle": "..."}]]}, lambda key: torch.zeros(0))


def test_envelope_golden_vector() -> None:
    encoded = encode_envelope(ENVELOPE, limits=LIMITS)
    golden = _golden("dcp_state_envelope_v4.json", encoded)
    assert encoded == golden
    assert ENVELOPE.digest() == json.loads(golden)["digest"]
    decoded = decode_envelope(golden, limits=LIMITS)
    assert encode_envelope(decoded, limits=LIMITS) == golden
    assert decoded.implementation == "vendor.Optimizer"
    assert decoded.tensors["state/0/codes"] == TensorEntry(torch.uint8, (4, 3), "like_parameter")
    assert decoded.tensors["state/0/scale+v_row"].members == (("state/0/scale", (2,)), ("state/0/v_row", ()))
    assert json.loads(golden)["format"] == DCP_STATE_FORMAT


def _mutated(change: object, *, resign: bool = False) -> bytes:
    """The golden envelope with ``change`` applied; ``resign`` recomputes its digest, so the
    check after the digest is what must refuse it."""
    value = json.loads((GOLDEN / "dcp_state_envelope_v4.json").read_bytes())
    change(value)  # type: ignore[operator]
    if resign:
        from gefen_contracts.digest import canonical_digest

        value["digest"] = canonical_digest({k: v for k, v in value.items() if k != "digest"})
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(
    ("change", "resign", "message"),
    [
        (lambda v: v["tensors"]["codebook"].update(placement="replicated"), False, "digest does not match"),
        (lambda v: v.update(format_version=5), False, "version 5"),
        (
            lambda v: v.update(format="gefen.other"),
            False,
            r"'gefen\.other' version 4; this library reads 'gefen\.dcp_state'",
        ),
        (lambda v: v.update(save_id="not hex"), False, "save_id"),
        (lambda v: v.pop("skeleton"), False, "keys"),
        (lambda v: v["tensors"]["codebook"].update(dtype="float7"), True, "float7"),
        (lambda v: v["tensors"]["codebook"].update(placement="sharded"), True, "placement must be one of"),
    ],
    ids=["digest", "version", "format", "save_id", "missing_key", "dtype", "placement"],
)
def test_envelope_refuses_tampering(change: object, resign: bool, message: str) -> None:
    with pytest.raises(EnvelopeFormatError, match=message):
        decode_envelope(_mutated(change, resign=resign), limits=LIMITS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v["members"][0].__setitem__(1, [3]), "widths must add up"),  # 3 + 1 columns for 3
        (lambda v: v["members"].pop(), "two or more members"),
        (lambda v: v.update(placement="replicated"), "placed like its parameter"),
        (lambda v: v.update(members=[["state/0/a", []], ["state/0/a", [2]]]), "each key once"),
        (lambda v: v.update(members="state/0/a"), "two or more members"),
    ],
    ids=["widths", "one_member", "placement", "duplicate", "not_a_list"],
)
def test_a_malformed_row_pack_is_refused_even_with_a_matching_digest(change: object, message: str) -> None:
    """The members are checked after the digest: a writer that signs a bad pack is refused too."""
    data = _mutated(lambda value: change(value["tensors"]["state/0/scale+v_row"]), resign=True)  # type: ignore[operator]
    with pytest.raises(EnvelopeFormatError, match=message):
        decode_envelope(data, limits=LIMITS)


def test_version_1_envelope_is_refused_naming_both_versions() -> None:
    old = json.dumps({"format": "gefen.dense_shard_state", "format_version": 1}, separators=(",", ":")).encode()
    with pytest.raises(
        EnvelopeFormatError, match=r"'gefen\.dense_shard_state' version 1.*'gefen\.dcp_state' version 4"
    ):
        decode_envelope(old, limits=LIMITS)
    for version in (2, 3):
        previous = json.dumps({"format": "gefen.dcp_state", "format_version": version}, separators=(",", ":"))
        with pytest.raises(
            EnvelopeFormatError,
            match=rf"'gefen\.dcp_state' version {version}; this library reads 'gefen\.dcp_state' version 4",
        ):
            decode_envelope(previous.encode(), limits=LIMITS)


@pytest.mark.parametrize(
    ("decode", "name", "version"),
    [
        (decode_envelope, "gefen.dcp_state", 4),
        (decode_digest_table, "gefen.dcp_digests", 3),
        (decode_portable_envelope, "gefen.portable_dcp", 2),
        (decode_chunk_table, "gefen.portable_dcp_chunks", 1),
        (decode_composite_envelope, "gefen.portable_dcp_composite", 1),
    ],
    ids=["dcp_state", "digests", "portable", "chunks", "composite"],
)
def test_every_record_of_another_version_is_refused_naming_both_versions(decode: Any, name: str, version: int) -> None:
    """Checked before the keys: another version's record (whose keys differ too) is refused by
    its version, not as a malformed record of this one."""
    for other in (version - 1, version + 1):
        record = json.dumps({"field_of_v9": 1, "format": name, "format_version": other}, separators=(",", ":"))
        with pytest.raises(
            EnvelopeFormatError,
            match=rf"{re.escape(repr(name))} version {other}; this library reads "
            rf"{re.escape(repr(name))} version {version}",
        ):
            decode(record.encode(), limits=LIMITS)


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
    golden = (GOLDEN / "dcp_state_envelope_v4.json").read_bytes()
    small = PortableStateLimits(max_metadata_bytes=len(golden) - 1)
    with pytest.raises(EnvelopeFormatError, match="max_metadata_bytes"):
        decode_envelope(golden, limits=small)
    with pytest.raises(EnvelopeFormatError, match="max_metadata_bytes"):
        encode_envelope(ENVELOPE, limits=small)


def test_chunk_digest_golden_and_layout_independent() -> None:
    assert chunk_digest(CHUNK) == CHUNK_SHA256
    assert chunk_digest(CHUNK.t().contiguous().t()) == CHUNK_SHA256  # non-contiguous input, same elements
    assert chunk_digest(torch.tensor([1, 2], dtype=torch.uint8)) == hashlib.sha256(b"\x01\x02").hexdigest()
    assert chunk_digest(torch.ones(1, dtype=torch.bfloat16)) == hashlib.sha256(b"\x80\x3f").hexdigest()
    changed = CHUNK.clone()
    changed[1, 2] = torch.nextafter(changed[1, 2], torch.tensor(2.0))
    assert chunk_digest(changed) != CHUNK_SHA256


def test_digest_table_golden_vector_and_fixed_width() -> None:
    encoded = encode_digest_table(_table(False, "0" * 64), limits=LIMITS)
    golden = _golden("dcp_digests_v3.json", encoded)
    assert encoded == golden
    assert len(encode_digest_table(_table(True, "a" * 64), limits=LIMITS)) == len(golden)
    table = decode_digest_table(golden, limits=LIMITS)
    assert table.writer == 3 and [r.written for r in table.chunks] == [True, False]
    assert table.chunks[0].digest == CHUNK_SHA256
    assert json.loads(golden)["format"] == DIGEST_TABLE_FORMAT


@pytest.mark.parametrize(
    "change",
    [
        lambda v: v["chunks"][0].__setitem__(3, "x"),
        lambda v: v["chunks"][0].__setitem__(4, "Z" * 64),
        lambda v: v["chunks"].reverse(),
        lambda v: v["chunks"][0].__setitem__(1, [0]),
        lambda v: v.update(format_version=0),
    ],
    ids=["flag", "digest", "unsorted", "rank", "version"],
)
def test_digest_table_refuses_malformed_records(change: object) -> None:
    value = json.loads((GOLDEN / "dcp_digests_v3.json").read_bytes())
    change(value)  # type: ignore[operator]
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(EnvelopeFormatError):
        decode_digest_table(data, limits=LIMITS)


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

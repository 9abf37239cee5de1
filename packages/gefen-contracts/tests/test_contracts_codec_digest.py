"""The canonical codec and digest grammar, pinned by committed golden vectors.

Regenerate intentionally with ``GEFEN_REGEN_GOLDEN=1 uv run pytest <this file>`` after a
deliberate format change (and bump the affected schema version).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from contract_builders import GROUP, flat_shard, simple_contract
from gefen_contracts import CodecError, OptimizerContract
from gefen_contracts.codec import from_primitive, to_primitive
from gefen_contracts.digest import canonical_digest, descriptor_digest
from gefen_contracts.enums import ParameterLayout, PlacementKind
from gefen_contracts.identity import LogicalRegion, ParameterIdentity, ShardIdentity, ShardPlacement
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.manifest import ShardingManifest

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("GEFEN_REGEN_GOLDEN") == "1"

DIGEST_CASES: dict[str, Any] = {
    "none": None,
    "bools": [True, False],
    "ints": [0, -1, 12345678901234567890, -(2**200)],
    "floats": [0.0, -0.0, 1.5, -2.25, 5e-324, 1.7976931348623157e308],
    "strings": ["", "x\u2603", "a\x00b"],
    "nested": {"b": [1, [2, {"z": None}]], "a": {"y": "s", "x": -0.5}},
    "empty_containers": [[], {}],
}


def golden_manifest() -> ShardingManifest:
    region = ShardIdentity(
        ParameterIdentity("layer.bias", (5, 4)),
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
        LogicalRegion((3, 0), (2, 4)),
        (ShardPlacement("dp", PlacementKind.DIMENSION_SHARD, 1, 2, parameter_dimension=0),),
        GROUP,
        "rank:1",
    )
    return ShardingManifest(
        (
            flat_shard("layer.weight", (2, 4), 0, 4, 0),
            flat_shard("layer.weight", (2, 4), 4, 4, 1),
            region,
            dataclass_replace_region(region),
        )
    )


def dataclass_replace_region(shard: ShardIdentity) -> ShardIdentity:
    return ShardIdentity(
        shard.parameter,
        shard.layout,
        LogicalRegion((0, 0), (3, 4)),
        (ShardPlacement("dp", PlacementKind.DIMENSION_SHARD, 0, 2, parameter_dimension=0),),
        GROUP,
        "rank:0",
    )


def _check_golden(name: str, actual: Any) -> None:
    path = GOLDEN / name
    if REGEN or not path.exists():
        if not REGEN:
            pytest.fail(f"golden vector {path} is missing; run with GEFEN_REGEN_GOLDEN=1 to create it")
        path.write_text(json.dumps(actual, indent=1, sort_keys=True, ensure_ascii=True) + "\n")
    expected = json.loads(path.read_text())
    assert actual == expected, f"{name} drifted from its golden vector"


def test_digest_grammar_golden_vectors() -> None:
    _check_golden("digest_vectors.json", {name: canonical_digest(value) for name, value in DIGEST_CASES.items()})


def test_descriptor_records_and_digests_are_golden() -> None:
    manifest = golden_manifest()
    contract = simple_contract(extensions={"test.codebook": {"entries": 256}})
    actual = {
        "manifest": to_primitive(manifest),
        "manifest_digest": descriptor_digest(manifest),
        "contract": to_primitive(contract),
        "contract_digest": descriptor_digest(contract),
        "limits_digest": descriptor_digest(PortableStateLimits()),
    }
    _check_golden("descriptor_vectors.json", actual)


def test_records_round_trip_and_are_json_and_weights_only_safe() -> None:
    for descriptor in (golden_manifest(), simple_contract(), PortableStateLimits(chunk_bytes=7)):
        record = to_primitive(descriptor)
        assert json.loads(json.dumps(record)) == record
        assert from_primitive(record, type(descriptor)) == descriptor
        assert from_primitive(json.loads(json.dumps(record))) == descriptor


def test_digest_distinguishes_types_and_values() -> None:
    digests = {canonical_digest(v) for v in (0, 0.0, -0.0, False, "0", [0], {"0": 0}, None)}
    assert len(digests) == 8
    assert canonical_digest({"a": 1, "b": 2}) == canonical_digest({"b": 2, "a": 1})
    assert canonical_digest([1, 2]) == canonical_digest((1, 2))
    with pytest.raises(CodecError, match="non-finite"):
        canonical_digest(float("nan"))
    with pytest.raises(CodecError, match="non-str"):
        canonical_digest({1: 2})
    with pytest.raises(CodecError, match="unsupported"):
        canonical_digest(object())


def test_codec_is_strict() -> None:
    record = to_primitive(ParameterIdentity("a", (2,)))
    for broken in (
        {**record, "extra": 1},
        {k: v for k, v in record.items() if k != "fqn"},
        {**record, "global_shape": [True]},
        {**record, "global_shape": (2,)},
        {**record, "schema_version": 1.0},
        {**record, "record": "nonsense"},
        {**record, "fqn": "a.."},
    ):
        with pytest.raises(CodecError):
            from_primitive(broken)
    with pytest.raises(CodecError, match="expected a ShardingManifest"):
        from_primitive(record, ShardingManifest)
    with pytest.raises(CodecError):
        to_primitive(object())
    contract_record = to_primitive(simple_contract())
    precisions = contract_record["capabilities"]["precisions"]
    contract_record["capabilities"]["precisions"] = precisions + precisions
    with pytest.raises(CodecError, match="unique and sorted"):
        from_primitive(contract_record, OptimizerContract)


def test_digest_matches_the_documented_byte_grammar() -> None:
    import hashlib
    import struct

    u64 = struct.Struct(">Q").pack
    expected = hashlib.sha256(
        b"gefen.digest.v1\x00"
        + b"D" + u64(1)
        + b"S" + u64(1) + b"a"
        + b"L" + u64(3)
        + b"I" + u64(2) + b"-7"
        + b"B\x01"
        + b"F" + struct.pack(">d", -0.0)
    ).hexdigest()  # fmt: skip
    assert canonical_digest({"a": [-7, True, -0.0]}) == expected


def test_equal_descriptors_have_one_record_and_one_digest() -> None:
    """``1``, ``True`` and ``1.0`` (and ``0.0`` and ``-0.0``) digest differently, so the maps that
    hold them compare and hash apart; a ``-0.0`` record is not canonical (its descriptor is
    ``0.0``)."""
    from gefen_contracts.capabilities import TopologyTransition
    from gefen_contracts.codec import from_primitive, to_primitive
    from gefen_contracts.digest import descriptor_digest
    from gefen_contracts.enums import ParameterLayout, TopologyChange
    from gefen_contracts.errors import CodecError
    from gefen_contracts.frozen import FrozenMap

    maps = [FrozenMap({"x": value}) for value in (1, True, 1.0, 0.0, -0.0)]
    assert len({*maps}) == 5 and all(a != b for i, a in enumerate(maps) for b in maps[i + 1 :])
    nested = FrozenMap({"x": (1, {"y": 2.0})})
    assert nested == {"x": (1, {"y": 2.0})} and nested != {"x": (1, {"y": 2})}
    layout, kind = ParameterLayout.REPLICATED, next(iter(TopologyChange))
    transition = TopologyTransition(frozenset({layout}), frozenset({layout}), frozenset({kind}), -0.0)
    assert repr(transition.update_rtol) == "0.0"
    record = to_primitive(transition)
    with pytest.raises(CodecError, match="canonical"):
        from_primitive({**record, "update_rtol": -0.0})
    assert descriptor_digest(from_primitive(record)) == descriptor_digest(transition)

"""The ``gefen.portable_state`` document, the catalog and PortableState: golden digests, strict
validation of every field, weights-only safety, no aliasing, and fragment integrity.

Regenerate the golden vectors with ``GEFEN_REGEN_GOLDEN=1`` after a deliberate format change
(and bump the format version).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts.codec import to_primitive
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.exchange import PortableLayout, PortableSlotLayout
from gefen_contracts.identity import LogicalRegion, LogicalSlice, ParameterIdentity, ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_portable import (
    Catalog,
    FieldSpec,
    FragmentRecord,
    ParameterRecord,
    PortableFragment,
    PortableIntegrityError,
    PortableLimitError,
    PortableState,
    PortableStateError,
    StateHeader,
    decode_wire,
    encode_wire,
    export_portable_state,
    fragment_digest,
    needed_fragments,
    parse_catalog,
    portable_state_digest,
    reseal_document,
)
from gefen_portable.document import parse_document
from hypothesis import given
from hypothesis import strategies as st
from portable_sgd_adopter import PortableSGD, flattened_manifest, group, initial_values, replicated_manifest

GOLDEN = Path(__file__).parent / "golden" / "portable_document_vectors.json"
REGEN = os.environ.get("GEFEN_REGEN_GOLDEN") == "1"
LIMITS = PortableStateLimits()
FP32, U8 = FieldSpec(torch.float32), FieldSpec(torch.uint8)
BLOCK = FieldSpec(torch.float32, blocked=True)


def _fragment(fqn: str, index: int, extent: LogicalSlice, period: int, fields: dict[str, torch.Tensor]) -> Any:
    digest = fragment_digest(fqn, extent, period, fields)
    nbytes = sum(t.numel() * t.element_size() for t in fields.values())
    return FragmentRecord(extent, period, digest, nbytes), PortableFragment(fqn, index, extent, period, fields, digest)


def golden_state() -> PortableState:
    """A hand-built state (no RNG): ``w`` (2x3) as two flattened fragments over two members
    with an fp32 and a uint8 element field and a block field (runs of 3, then 2), and a
    replicated ``b`` with one fp32 element field and a replica field."""
    pg = group(2, "dp2")
    shards = (
        flattened_manifest({"w": (2, 3)}, pg, {"w": [0, 4, 6]}).shards + replicated_manifest({"b": (3,)}, pg).shards
    )
    header = StateHeader(
        "gefen_test.Golden",
        {"schema": 1, "eps": 1e-8, "names": ["x", "y"]},
        {"global_step": 3, "table": torch.tensor([-1.0, -0.0, 1.0])},
        ShardingManifest(shards),
    )
    records = {
        "w": ParameterRecord(
            ParameterIdentity("w", (2, 3)),
            (0, 0),
            "w",
            {"lr": 0.1, "nesterov": False},
            "momentum",
            {"step": 3},
            {"codes": U8, "momentum": FP32, "scale": BLOCK},
            {},
            ParameterLayout.FLATTENED_ELEMENT_SHARD,
        ),
        "b": ParameterRecord(
            ParameterIdentity("b", (3,)),
            (0, 1),
            "b",
            {"lr": 0.1, "nesterov": False},
            "momentum_scaled",
            {"step": 3},
            {"momentum": FP32},
            {"lr_scale": torch.tensor([0.5])},
            ParameterLayout.REPLICATED,
        ),
    }
    momentum = torch.arange(6, dtype=torch.float32) / 4
    codes = torch.tensor([0, 7, 255, 3, 128, 9], dtype=torch.uint8)
    w0 = _fragment(
        "w",
        0,
        LogicalSlice(0, 4),
        3,
        {"codes": codes[:4].clone(), "momentum": momentum[:4].clone(), "scale": torch.tensor([0.5, 2.0])},
    )
    w1 = _fragment(
        "w",
        1,
        LogicalSlice(4, 2),
        2,
        {"codes": codes[4:].clone(), "momentum": momentum[4:].clone(), "scale": torch.tensor([-0.0])},
    )
    b0 = _fragment("b", 0, LogicalSlice(0, 3), 0, {"momentum": torch.tensor([-0.0, 1.5, -2.25])})
    catalog = Catalog.build(header, records, {"w": (w0[0], w1[0]), "b": (b0[0],)})
    return PortableState(catalog, [b0[1], w0[1], w1[1]])


def golden_document() -> dict[str, Any]:
    return golden_state().materialize()


def roundtrip(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_trees_bitwise(a: Any, b: Any, path: str = "doc") -> None:
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if type(a) is dict:
        assert set(a) == set(b), path
        for key in a:
            assert_trees_bitwise(a[key], b[key], f"{path}[{key!r}]")
    elif type(a) is list:
        assert len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            assert_trees_bitwise(x, y, f"{path}[{index}]")
    elif type(a) is float:
        assert a.hex() == b.hex(), path
    else:
        assert a == b, path


def w_fields(document: dict[str, Any], index: int) -> dict[str, torch.Tensor]:
    return document["parameters"]["w"]["fragments"][index]["fields"]  # type: ignore[no-any-return]


# -- golden vectors --------------------------------------------------------------------


def test_golden_document_catalog_fragment_and_wire_digests_are_stable() -> None:
    document = golden_document()
    state = PortableState.from_document(document, limits=LIMITS)
    payload = encode_wire(document, limits=LIMITS)
    current = {
        "document_digest": document["completion"]["digest"],
        "catalog_digest": state.catalog_digest,
        "fragment_digests": [f.digest for f in state.fragments],
        "wire_metadata_digest": payload.digest,
        "wire_metadata": payload.metadata.hex(),
    }
    if REGEN:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    assert current == json.loads(GOLDEN.read_text())


def test_document_is_weights_only_safe_and_reparses_to_the_same_state() -> None:
    document = golden_document()
    assert sorted(document) == sorted(
        [
            "format",
            "format_version",
            "coverage",
            "implementation",
            "policy",
            "common",
            "manifest",
            "parameters",
            "completion",
        ]
    )
    assert document["format"] == "gefen.portable_state" and document["format_version"] == 2
    assert w_fields(document, 0)["codes"].dtype is torch.uint8
    loaded = roundtrip(document)
    catalog, fragments = parse_document(loaded, limits=LIMITS)
    assert catalog.digest == document["completion"]["digest"] and len(fragments) == 3
    again = PortableState.from_document(loaded, limits=LIMITS).materialize()
    assert_trees_bitwise(again, document)


def test_a_version_1_document_is_refused_naming_both_versions() -> None:
    document = golden_document()
    document["format_version"] = 1
    with pytest.raises(PortableStateError, match=r"version 1.*version 2|version 2.*version 1"):
        PortableState.from_document(document, limits=LIMITS)


def test_parsing_neither_aliases_nor_mutates_the_input() -> None:
    document = golden_document()
    reference = copy.deepcopy(document)
    state = PortableState.from_document(document, limits=LIMITS)
    assert_trees_bitwise(document, reference)
    document["parameters"]["b"]["fragments"][0]["fields"]["momentum"].add_(1.0)
    assert state.materialize()["completion"]["digest"] == reference["completion"]["digest"]
    assert_trees_bitwise(state.materialize(), reference)


def test_digest_is_independent_of_key_order_and_sensitive_to_every_value() -> None:
    document = golden_document()
    payload = {k: v for k, v in document.items() if k != "completion"}
    reordered = {k: payload[k] for k in reversed(list(payload))}
    assert portable_state_digest(reordered) == document["completion"]["digest"]
    changed = copy.deepcopy(document)
    changed["parameters"]["b"]["fragments"][0]["fields"]["momentum"][0] = 0.0  # -0.0 -> +0.0
    reseal_document(changed)
    assert changed["completion"]["digest"] != document["completion"]["digest"]
    changed = copy.deepcopy(document)
    w_fields(changed, 1)["scale"][0] = 0.0  # a block field's -0.0 -> +0.0
    reseal_document(changed)
    assert changed["completion"]["digest"] != document["completion"]["digest"]


# -- strict validation -----------------------------------------------------------------

Edit = Callable[[dict[str, Any]], None]


def _set(path: tuple[Any, ...], value: Any) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


def _delete(path: tuple[Any, ...]) -> Edit:
    def edit(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return edit


_B = ("parameters", "b", "fragments", 0, "fields")
_W0 = ("parameters", "w", "fragments", 0)

SEMANTIC_EDITS: dict[str, Edit] = {
    "missing top-level key": _delete(("policy",)),
    "extra top-level key": _set(("provenance",), None),
    "format": _set(("format",), "gefen.portable_state_v3"),
    "format version bool": _set(("format_version",), True),
    "format version": _set(("format_version",), 3),
    "coverage": _set(("coverage",), "local"),
    "empty implementation": _set(("implementation",), ""),
    "policy not a dict": _set(("policy",), [1]),
    "common key with NUL": _set(("common", "a\x00b"), 1),
    "manifest not canonical": _set(("manifest", "schema_version"), 2),
    "extra parameter": _set(("parameters", "c"), {}),
    "missing parameter": _delete(("parameters", "w")),
    "identity names another fqn": _set(("parameters", "w", "identity", "fqn"), "b"),
    "identity shape": _set(("parameters", "w", "identity", "global_shape"), [3, 2]),
    "negative position": _set(("parameters", "w", "position"), [0, -1]),
    "duplicate position": _set(("parameters", "w", "position"), [0, 1]),
    "position as tuple-like dict": _set(("parameters", "w", "position"), {"0": 0}),
    "compatibility name type": _set(("parameters", "w", "compatibility_name"), 3),
    "empty variant": _set(("parameters", "w", "variant"), ""),
    "negative counter": _set(("parameters", "w", "counters", "step"), -1),
    "bool counter": _set(("parameters", "w", "counters", "step"), True),
    "options not a dict": _set(("parameters", "w", "options"), None),
    "replica field dtype": _set(
        ("parameters", "b", "replica_fields", "lr_scale"), torch.tensor([1], dtype=torch.int32)
    ),
    "replica field also a fragment field": _set(("parameters", "b", "replica_fields", "momentum"), torch.zeros(1)),
    "field spec dtype unknown": _set(("parameters", "w", "fields", "codes", "dtype"), "uint9"),
    "field spec blocked not bool": _set(("parameters", "w", "fields", "scale", "blocked"), 1),
    "field spec missing key": _delete(("parameters", "w", "fields", "codes", "blocked")),
    "field spec says fp32 for codes": _set(("parameters", "w", "fields", "codes", "dtype"), "float32"),
    "block period zero with block fields": _set((*_W0, "block_period"), 0),
    "block period changed": _set((*_W0, "block_period"), 1),
    "element field shape": _set((*_B, "momentum"), torch.zeros(4)),
    "element field dtype": _set((*_B, "momentum"), torch.zeros(3, dtype=torch.float64)),
    "element field non-finite": _set((*_B, "momentum"), torch.tensor([0.0, float("inf"), 1.0])),
    "block field length": _set((*_W0, "fields", "scale"), torch.tensor([0.5, 2.0, 1.0])),
    "block field non-finite": _set((*_W0, "fields", "scale"), torch.tensor([0.5, float("nan")])),
    "field missing from a fragment": _delete((*_W0, "fields", "codes")),
    "field name": _set((*_B, " momentum"), torch.zeros(3)),
    "hint source layout": _set(("parameters", "w", "projection_hints", "source_layout"), "replicated"),
    "hint unknown rule": _set(("parameters", "w", "projection_hints", "element_fields"), "shard_identity_v1"),
    "region of another rank": _set((*_W0, "extent"), to_primitive(LogicalRegion((0,), (4,)))),
    "region past the bounds": _set((*_W0, "extent"), to_primitive(LogicalRegion((0, 0), (2, 4)))),
    "completion status": _set(("completion", "status"), "partial"),
    "completion grammar": _set(("completion", "digest_grammar"), "repr"),
}


@pytest.mark.parametrize("name", sorted(SEMANTIC_EDITS))
def test_every_malformed_field_is_refused_even_with_a_recomputed_digest(name: str) -> None:
    document = golden_document()
    SEMANTIC_EDITS[name](document)
    # The digest grammar itself refuses some values (non-finite); parsing must refuse them too.
    with contextlib.suppress(Exception):
        reseal_document(document)
    with pytest.raises(PortableStateError) as raised:
        PortableState.from_document(document, limits=LIMITS)
    assert type(raised.value) is not PortableIntegrityError or name.startswith("completion")


@pytest.mark.parametrize("edit", ["counter", "tensor", "block tensor", "option", "digest text"])
def test_any_edit_without_a_matching_digest_is_an_integrity_error(edit: str) -> None:
    document = golden_document()
    if edit == "counter":
        document["parameters"]["w"]["counters"]["step"] = 4
    elif edit == "tensor":
        w_fields(document, 0)["codes"][0] = 1
    elif edit == "block tensor":
        w_fields(document, 0)["scale"][1] = 0.25
    elif edit == "option":
        document["parameters"]["w"]["options"]["lr"] = 0.2
    else:
        document["completion"]["digest"] = "f" * 64
    with pytest.raises(PortableIntegrityError):
        PortableState.from_document(document, limits=LIMITS)


def test_a_document_above_the_collective_limits_is_refused_before_its_tensors_are_copied() -> None:
    document = golden_document()
    tight = PortableStateLimits(max_fragment_tensor_bytes=8, max_collective_tensor_bytes=16)
    copied: list[int] = []
    from gefen_portable import wire

    original = wire.owned_cpu_copy
    wire.owned_cpu_copy = lambda tensor, **kw: copied.append(1) or original(tensor, **kw)  # type: ignore[assignment]
    try:
        with pytest.raises(PortableLimitError) as raised:
            PortableState.from_document(document, limits=tight)
    finally:
        wire.owned_cpu_copy = original
    assert raised.value.limit == "max_fragment_tensor_bytes"
    assert not copied


# -- catalog and fragments ---------------------------------------------------------------


def test_catalog_record_round_trips_and_is_weights_only_safe() -> None:
    state = golden_state()
    record = roundtrip(state.catalog_record())
    catalog = parse_catalog(record, limits=LIMITS)
    assert catalog.digest == state.catalog_digest
    assert catalog.to_record()["completion"] == record["completion"]
    assert catalog.fragment_tensors("w", 0) == {
        "codes": ((4,), torch.uint8),
        "momentum": ((4,), torch.float32),
        "scale": ((2,), torch.float32),
    }
    assert catalog.fragment_tensors("w", 1)["scale"] == ((1,), torch.float32)


def _catalog_edit(record: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    edited = copy.deepcopy(record)
    edit(edited)
    edited["completion"]["digest"] = portable_state_digest(edited)
    return edited


CATALOG_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "gap": lambda r: r["parameters"]["w"]["fragments"][1]["extent"].update(flat_offset=5, length=1),
    "overlap": lambda r: r["parameters"]["w"]["fragments"][1]["extent"].update(flat_offset=3, length=3),
    "out of order": lambda r: r["parameters"]["w"]["fragments"].reverse(),
    "nbytes": lambda r: r["parameters"]["w"]["fragments"][0].update(nbytes=1),
    "digest text": lambda r: r["parameters"]["w"]["fragments"][0].update(digest="XYZ"),
    "negative block period": lambda r: r["parameters"]["w"]["fragments"][0].update(block_period=-1),
    "fragments without fields": lambda r: r["parameters"]["w"].update(fields={}),
    "no fragments": lambda r: r["parameters"]["w"].update(fragments=[]),
    "version 1": lambda r: r.update(format_version=1),
}


@pytest.mark.parametrize("name", sorted(CATALOG_EDITS))
def test_catalog_fragments_must_tile_each_parameter_exactly_once(name: str) -> None:
    record = golden_state().catalog_record()
    assert parse_catalog(record, limits=LIMITS).fragment_keys() == (("b", 0), ("w", 0), ("w", 1))
    with pytest.raises(PortableStateError):
        parse_catalog(_catalog_edit(record, CATALOG_EDITS[name]), limits=LIMITS)


def test_a_partial_state_needs_its_peers_and_a_corrupted_fragment_is_refused() -> None:
    full = golden_state()
    record = full.catalog_record()
    partial = PortableState.from_parts(record, full.fragments[:1], limits=LIMITS)
    assert not partial.is_complete and full.is_complete
    with pytest.raises(PortableStateError, match="fragments"):
        partial.materialize()
    broken = full.fragments[1]
    tensor = broken.fields["codes"].clone()
    tensor.view(-1)[0] += 1
    forged = PortableFragment(
        broken.fqn, broken.index, broken.extent, broken.block_period, {**broken.fields, "codes": tensor}, broken.digest
    )
    corrupted = PortableState(full.catalog, [full.fragments[0], forged, full.fragments[2]])
    with pytest.raises(PortableIntegrityError):
        corrupted.materialize()
    with pytest.raises(PortableStateError):
        PortableState(full.catalog, [full.fragments[0], full.fragments[0]])
    wrong = PortableFragment("w", 0, LogicalSlice(0, 6), 3, broken.fields, "0" * 64)
    with pytest.raises(PortableStateError):
        PortableState(full.catalog, [wrong])
    other_period = PortableFragment("w", 0, broken.extent, 2, broken.fields, broken.digest)
    with pytest.raises(PortableStateError, match="block period"):
        PortableState(full.catalog, [other_period])
    assert isinstance(full.catalog, Catalog)


def test_a_member_needs_only_the_fragments_overlapping_its_pieces() -> None:
    full = golden_state()
    catalog = full.catalog
    manifest = flattened_manifest({"w": (2, 3), "b": (3,)}, group(2, "dp2"))
    wanted = {}
    for member in ("rank:0", "rank:1"):
        slots = tuple(PortableSlotLayout(s, (0, index), s.fqn) for index, s in enumerate(manifest.for_member(member)))
        wanted[member] = needed_fragments(catalog, PortableLayout("gefen_test.Golden", manifest, slots))
    assert wanted["rank:0"] == {("b", 0), ("w", 0)}
    assert wanted["rank:1"] == {("b", 0), ("w", 0), ("w", 1)}
    fields = dict(full.fragment("w", 1).fields)  # type: ignore[union-attr]
    fragment = PortableFragment.from_catalog(catalog, "w", 1, fields)
    state = PortableState(catalog, [fragment])
    assert not state.is_complete and state.local_bytes == 2 + 8 + 4
    with pytest.raises(PortableStateError):
        PortableFragment.from_catalog(catalog, "w", 2, fields)


_SHAPES = st.lists(st.integers(min_value=0, max_value=4), min_size=0, max_size=3).map(tuple)


@given(
    st.dictionaries(st.sampled_from(["a", "b.c", "d.e.f", "g"]), _SHAPES, min_size=1, max_size=4),
    st.integers(min_value=0, max_value=3),
    st.booleans(),
)
def test_any_exported_state_round_trips_through_document_catalog_and_wire(
    specs: dict[str, tuple[int, ...]], steps: int, scaled: bool
) -> None:
    optimizer = PortableSGD(replicated_manifest(specs, None), None, initial_values(specs), scaled=scaled)
    optimizer.train_steps(0, steps)
    binding = CheckpointProcessGroupBinding(ProcessGroupIdentity("solo", ("m",)), "m", None, "cpu")
    state = export_portable_state(optimizer, checkpoint_process_group=binding, transaction_id="h", limits=LIMITS)
    document = state.materialize()
    payload = encode_wire(document, limits=LIMITS)
    decoded = decode_wire(payload.metadata, list(payload.tensors), limits=LIMITS)
    again = PortableState.from_document(roundtrip(decoded), limits=LIMITS)
    assert again.catalog_digest == state.catalog_digest
    assert_trees_bitwise(again.materialize(), document)
    assert parse_catalog(roundtrip(state.catalog_record()), limits=LIMITS).digest == state.catalog_digest


def test_catalog_record_is_a_copy_that_cannot_change_the_state() -> None:
    state = golden_state()
    record = state.catalog_record()
    record["parameters"]["b"]["replica_fields"]["lr_scale"].mul_(2)
    record["common"]["table"].zero_()
    # the state still materialises under its own digest, with its own values
    document = state.materialize()
    assert torch.equal(state.catalog.parameters["b"].replica_fields["lr_scale"], torch.tensor([0.5]))
    assert PortableState.from_document(document, limits=LIMITS).catalog_digest == state.catalog_digest


def test_a_catalog_announcing_more_bytes_than_the_limits_is_refused_before_its_tiling_is_walked() -> None:
    # a hostile catalog of a few hundred bytes: a tall matrix cut into column regions, whose
    # tiling check walks one run per row; the bytes it announces are over the limits
    from portable_sgd_adopter import region_manifest

    rows = 200_000
    identity = ParameterIdentity("w", (rows, 2))
    header = StateHeader("gefen_test.Golden", {"schema": 1}, {}, region_manifest({"w": (rows, 2)}, group(2, "dp2")))
    record = ParameterRecord(
        identity,
        (0, 0),
        "w",
        {"lr": 0.1},
        "momentum",
        {},
        {"momentum": FP32},
        {},
        ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
    )
    whole = Catalog.build(
        header, {"w": record}, {"w": (FragmentRecord(LogicalSlice(0, 2 * rows), 0, "0" * 64, 8 * rows),)}
    )
    columns = [
        {
            "extent": to_primitive(LogicalRegion((0, c), (rows, 1))),
            "block_period": 0,
            "digest": "0" * 64,
            "nbytes": 4 * rows,
        }
        for c in (0, 1)
    ]
    hostile = _catalog_edit(whole.to_record(), lambda r: r["parameters"]["w"].update(fragments=columns))
    small = PortableStateLimits(max_fragment_tensor_bytes=1 << 20, max_collective_tensor_bytes=1 << 20)
    with pytest.raises(PortableLimitError) as raised:
        parse_catalog(hostile, limits=small)
    assert raised.value.limit == "max_collective_tensor_bytes"
    # within the limits the same catalog parses (its tiling is valid)
    assert parse_catalog(hostile, limits=LIMITS).total_fragment_bytes == 8 * rows


def test_needed_fragments_refuses_a_target_of_another_shape_by_name() -> None:
    catalog = golden_state().catalog
    manifest = flattened_manifest({"w": (3, 2), "b": (3,)}, group(2, "dp2"))
    slots = tuple(PortableSlotLayout(s, (0, index), s.fqn) for index, s in enumerate(manifest.for_member("rank:0")))
    with pytest.raises(PortableStateError, match="identity of 'w' differs"):
        needed_fragments(catalog, PortableLayout("gefen_test.Golden", manifest, slots))

"""The canonical wire codec: golden bytes, round trips, canonical form, limits, and a parser
that refuses every malformed input before it allocates anything.

Regenerate the golden vectors with ``GEFEN_REGEN_GOLDEN=1`` after a deliberate format change
(and bump ``WIRE_CODEC_VERSION``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from gefen_contracts import ContractTypeError
from gefen_contracts.limits import PortableStateLimits
from gefen_portable import (
    PortableIntegrityError,
    PortableLimitError,
    PortableStateError,
    WireFormatError,
    bounded_clone,
    decode_wire,
    encode_wire,
    parse_wire,
    reconstruct_wire,
)
from gefen_portable.tensors import DTYPE_BY_CODE
from gefen_portable.wire import _seal
from hypothesis import given
from hypothesis import strategies as st

GOLDEN = Path(__file__).parent / "golden" / "portable_wire_vectors.json"
REGEN = os.environ.get("GEFEN_REGEN_GOLDEN") == "1"
LIMITS = PortableStateLimits()


def golden_values() -> dict[str, Any]:
    return {
        "small": {"a": -1, "b": torch.tensor([1, -2], dtype=torch.int16)},
        "primitives": {
            "none": None,
            "bools": [True, False],
            "ints": [0, 1, -1, 255, 256, -(2**70)],
            "floats": [0.0, -0.0, 1.5, 5e-324, -1.7976931348623157e308],
            "text": ["", "x\u2603", "a\x00b"],
            "nested": {"z": [], "y": {}, "x": [[1], {"k": None}]},
        },
        "tensors": [
            torch.tensor(3.5),
            torch.zeros((0, 2), dtype=torch.float64),
            torch.tensor([[True, False]]),
            torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            torch.tensor(3 + 4j, dtype=torch.complex64),
        ],
    }


def _bitwise_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        ua = a.reshape(-1).view(torch.uint8) if a.dtype is not torch.bool else a.reshape(-1).to(torch.uint8)
        ub = b.reshape(-1).view(torch.uint8) if b.dtype is not torch.bool else b.reshape(-1).to(torch.uint8)
        return torch.equal(ua, ub)
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack(">d", a) == struct.pack(">d", b)  # type: ignore[arg-type]
    if type(a) is dict:
        return list(a) == list(b) and all(_bitwise_equal(a[k], b[k]) for k in a)  # type: ignore[call-overload]
    if type(a) is list:
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


def _sorted(value: object) -> object:
    if type(value) is dict:
        return {k: _sorted(value[k]) for k in sorted(value)}
    if type(value) is list:
        return [_sorted(v) for v in value]
    return value


@contextmanager
def no_allocation() -> Iterator[None]:
    """Any tensor factory called inside fails the test."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor was allocated")

    names = ("empty", "zeros", "ones", "tensor", "frombuffer", "empty_like", "zeros_like", "full")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(torch, name, forbidden))
        yield


# -- golden vectors --------------------------------------------------------------------


def test_golden_wire_bytes_and_digests_are_stable() -> None:
    current = {}
    for name, value in golden_values().items():
        payload = encode_wire(value, limits=LIMITS)
        current[name] = {"metadata": payload.metadata.hex(), "digest": payload.digest}
    if REGEN:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert current == expected


def test_the_small_golden_vector_is_laid_out_as_documented() -> None:
    payload = encode_wire({"a": -1, "b": torch.tensor([1, -2], dtype=torch.int16)}, limits=LIMITS)
    data = payload.metadata
    assert data[:8] == b"GFNPSW1\x00" and data[8:16] == bytes.fromhex("0001000000000000")
    assert data[16:25] == bytes([0x07]) + (2).to_bytes(8, "big")  # a dict of two
    assert data[25:35] == bytes([0x05]) + (1).to_bytes(8, "big") + b"a"
    assert data[35:45] == bytes([0x03, 0x01]) + (1).to_bytes(8, "big")  # -1: sign 1, length 1 ...
    assert data[45] == 0x01  # ... magnitude 1
    body, trailer = data[:-32], data[-32:]
    assert hashlib.sha256(b"gefen.portable_wire.metadata.v1\x00" + body).digest() == trailer
    assert payload.digest == trailer.hex()


# -- round trips -----------------------------------------------------------------------


def test_golden_values_round_trip_exactly_and_chunking_changes_no_byte() -> None:
    for value in golden_values().values():
        payload = encode_wire(value, limits=LIMITS)
        tiny = encode_wire(value, limits=PortableStateLimits(chunk_bytes=1), copy=True)
        assert tiny.metadata == payload.metadata
        decoded = decode_wire(payload.metadata, list(payload.tensors), limits=LIMITS)
        assert _bitwise_equal(decoded, _sorted(value))


def test_views_and_non_contiguous_tensors_are_copied_tight() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value = {
        "t": base.t(),
        "s": base[1:3, ::2],
        "c": torch.tensor([1 + 2j]).conj(),
        "n": torch.tensor([2.0])._neg_view(),
    }
    payload = encode_wire(value, limits=LIMITS)
    decoded = decode_wire(payload.metadata, list(payload.tensors), limits=LIMITS)
    assert isinstance(decoded, dict)
    assert torch.equal(decoded["t"], base.t().contiguous()) and decoded["t"].is_contiguous()
    assert torch.equal(decoded["s"], base[1:3, ::2].contiguous())
    assert decoded["c"].item() == 1 - 2j and not decoded["c"].is_conj()
    assert decoded["n"].item() == -2.0 and not decoded["n"].is_neg()


def test_bounded_clone_owns_every_tensor() -> None:
    source = {"x": torch.ones(3), "y": [torch.zeros(2, dtype=torch.int64)]}
    clone = bounded_clone(source, limits=LIMITS)
    assert isinstance(clone, dict)
    source["x"].add_(1)
    assert torch.equal(clone["x"], torch.ones(3))
    assert clone["x"].untyped_storage().data_ptr() != source["x"].untyped_storage().data_ptr()


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    row = DTYPE_BY_CODE[draw(st.integers(min_value=1, max_value=12))]
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=3), max_size=3)))
    numel = math.prod(shape)
    raw = draw(st.binary(min_size=numel * row.itemsize, max_size=numel * row.itemsize))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if numel else torch.zeros(0, dtype=torch.uint8)
    if row.dtype is torch.bool:
        tensor = (flat % 2).to(torch.bool).reshape(shape)
    else:
        tensor = flat.view(row.dtype).reshape(shape).clone()
    if tensor.is_floating_point() or tensor.is_complex():
        tensor = torch.where(torch.isfinite(tensor), tensor, torch.zeros((), dtype=tensor.dtype))
    return tensor


_values = st.recursive(
    st.one_of(_leaves, _tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


@given(_values)
def test_any_value_round_trips_bitwise_and_re_encodes_identically(value: object) -> None:
    payload = encode_wire(value, limits=LIMITS)
    decoded = decode_wire(payload.metadata, list(payload.tensors), limits=LIMITS)
    assert _bitwise_equal(decoded, _sorted(value))
    assert encode_wire(decoded, limits=LIMITS).metadata == payload.metadata


# -- the encoder refuses what the domain excludes --------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        (1, 2),
        {1: "x"},
        float("nan"),
        float("inf"),
        torch.tensor([1.0, float("nan")]),
        torch.zeros(2, dtype=torch.uint16),
        torch.nn.Parameter(torch.zeros(2)),
        object(),
        b"bytes",
        "\ud800",
        torch.zeros(3).to_sparse(),
    ],
    ids=[
        "tuple",
        "int-key",
        "nan",
        "inf",
        "nan-tensor",
        "uint16",
        "parameter",
        "object",
        "bytes",
        "surrogate",
        "sparse",
    ],
)
def test_encoder_rejects_values_outside_the_domain(value: object) -> None:
    with pytest.raises(PortableStateError):
        encode_wire({"v": value}, limits=LIMITS)


def test_limits_must_be_the_exact_type() -> None:
    with pytest.raises(ContractTypeError):
        encode_wire(1, limits=object())  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError):
        parse_wire(bytearray(b"x" * 64), limits=LIMITS)  # type: ignore[arg-type]


# -- limits on both sides ---------------------------------------------------------------

_BIG = PortableStateLimits()
LIMIT_CASES: list[tuple[str, dict[str, int], object]] = [
    ("max_tree_nodes", {"max_tree_nodes": 5}, [1, 2, 3, 4, 5, 6]),
    ("max_tree_depth", {"max_tree_depth": 2}, [[[1]]]),
    ("max_container_items", {"max_container_items": 3}, {"a": [1, 2, 3, 4]}),
    ("max_string_bytes", {"max_string_bytes": 3}, "\u2603\u2603"),
    ("max_integer_bytes", {"max_integer_bytes": 2}, 2**16),
    ("max_tensors", {"max_tensors": 1}, [torch.zeros(1), torch.zeros(1)]),
    ("max_tensor_rank", {"max_tensor_rank": 2}, torch.zeros(1, 1, 1)),
    ("max_fragment_tensor_bytes", {"max_fragment_tensor_bytes": 7}, [torch.zeros(1), torch.zeros(1)]),
    ("max_metadata_bytes", {"max_metadata_bytes": 80}, ["x" * 40]),
]


@pytest.mark.parametrize(("limit", "overrides", "value"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_every_limit_is_enforced_by_the_encoder_and_the_parser(
    limit: str, overrides: dict[str, int], value: object
) -> None:
    tight = PortableStateLimits(**overrides)
    with pytest.raises(PortableLimitError) as raised:
        encode_wire(value, limits=tight)
    assert raised.value.limit == limit and limit in str(raised.value)
    payload = encode_wire(value, limits=_BIG)
    with no_allocation(), pytest.raises(PortableLimitError) as parsed:
        parse_wire(payload.metadata, limits=tight)
    assert parsed.value.limit == limit


# -- the parser: canonical form, structure and integrity, before any allocation ---------


def _body(value: object) -> bytes:
    return encode_wire(value, limits=LIMITS).metadata[:-32]


def _header() -> bytes:
    return b"GFNPSW1\x00" + bytes.fromhex("0001000000000000")


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


MALFORMED: dict[str, bytes] = {
    "bad preamble": b"GFNPSW2\x00" + _body(None)[8:],
    "codec version": b"GFNPSW1\x00" + bytes.fromhex("0002000000000000") + _body(None)[16:],
    "header flags": b"GFNPSW1\x00" + bytes.fromhex("0001000100000000") + _body(None)[16:],
    "unknown tag": _header() + b"\x0b" + _u64(0),
    "truncated string": _header() + b"\x05" + _u64(5) + b"ab",
    "trailing bytes": _body(None) + b"\x00",
    "integer sign byte": _header() + b"\x03\x02" + _u64(0) + _u64(0),
    "integer leading zero": _header() + b"\x03\x00" + _u64(2) + b"\x00\x01" + _u64(0),
    "negative zero integer": _header() + b"\x03\x01" + _u64(0) + _u64(0),
    "non-finite float": _header() + b"\x04" + struct.pack(">d", math.inf) + _u64(0),
    "invalid utf-8": _header() + b"\x05" + _u64(2) + b"\xc3\x28" + _u64(0),
    "overlong utf-8": _header() + b"\x05" + _u64(2) + b"\xc0\xaf" + _u64(0),
    "unsorted keys": _header()
    + b"\x07"
    + _u64(2)
    + b"\x05"
    + _u64(1)
    + b"b\x00"
    + b"\x05"
    + _u64(1)
    + b"a\x00"
    + _u64(0),
    "duplicate keys": _header()
    + b"\x07"
    + _u64(2)
    + b"\x05"
    + _u64(1)
    + b"a\x00"
    + b"\x05"
    + _u64(1)
    + b"a\x00"
    + _u64(0),
    "non-string key": _header() + b"\x07" + _u64(1) + b"\x00\x00" + _u64(0),
    "reference out of order": _header() + b"\x08" + _u64(1) + _u64(1),
    "descriptor count": _header() + b"\x00" + _u64(1),
    "unknown dtype": _header()
    + b"\x08"
    + _u64(0)
    + _u64(1)
    + bytes.fromhex("000d000000000000")
    + _u64(0)
    + _u64(0)
    + bytes(32),
    "descriptor flags": _header()
    + b"\x08"
    + _u64(0)
    + _u64(1)
    + bytes.fromhex("0009000000000001")
    + _u64(0)
    + _u64(0)
    + bytes(32),
    "dimension above int64": _header()
    + b"\x08"
    + _u64(0)
    + _u64(1)
    + bytes.fromhex("0009000100000000")
    + _u64(2**63)
    + _u64(0)
    + _u64(0)
    + bytes(32),
    "numel mismatch": _header()
    + b"\x08"
    + _u64(0)
    + _u64(1)
    + bytes.fromhex("0009000100000000")
    + _u64(2)
    + _u64(3)
    + _u64(12)
    + bytes(32),
    "nbytes mismatch": _header()
    + b"\x08"
    + _u64(0)
    + _u64(1)
    + bytes.fromhex("0009000100000000")
    + _u64(2)
    + _u64(2)
    + _u64(9)
    + bytes(32),
    "list count beyond the bytes": _header() + b"\x06" + _u64(1000) + _u64(0),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_parser_rejects_malformed_or_non_canonical_metadata_without_allocating(name: str) -> None:
    data = _seal(MALFORMED[name])
    with no_allocation(), pytest.raises((WireFormatError, PortableLimitError)):
        parse_wire(data, limits=LIMITS)


def test_a_dimension_above_int64_is_rejected_even_when_another_dimension_is_zero() -> None:
    data = _seal(
        _header()
        + b"\x08"
        + _u64(0)
        + _u64(1)
        + bytes.fromhex("0009000200000000")
        + _u64(0)
        + _u64(2**63)
        + _u64(0)
        + _u64(0)
        + bytes(32)
    )
    with pytest.raises(WireFormatError, match="2\\*\\*63"):
        parse_wire(data, limits=LIMITS)


def test_parser_checks_the_trailer_digest() -> None:
    data = bytearray(encode_wire({"a": 1}, limits=LIMITS).metadata)
    data[-1] ^= 1
    with pytest.raises(PortableIntegrityError):
        parse_wire(bytes(data), limits=LIMITS)
    with pytest.raises(WireFormatError):
        parse_wire(bytes(data[:20]), limits=LIMITS)


def test_reconstruction_checks_every_payload_tensor_before_building_anything() -> None:
    value = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 2)}
    payload = encode_wire(value, limits=LIMITS)
    layout = parse_wire(payload.metadata, limits=LIMITS)
    good = [t.clone() for t in payload.tensors]
    corrupted = [good[0].clone(), good[1]]
    corrupted[0].view(torch.uint8)[3] ^= 1
    cases = {
        "count": [good[0]],
        "dtype": [good[0].double(), good[1]],
        "shape": [good[0].reshape(2, 2), good[1]],
        "not tight": [torch.arange(8, dtype=torch.float32)[::2], good[1]],
        "subclass": [torch.nn.Parameter(good[0]), good[1]],
        "non-finite": [torch.tensor([0.0, 1.0, float("nan"), 3.0]), good[1]],
        "digest": corrupted,
    }
    for name, tensors in cases.items():
        with pytest.raises(PortableStateError):
            reconstruct_wire(layout, tensors)
        assert name
    with pytest.raises(PortableIntegrityError):
        reconstruct_wire(layout, good, expected_digest="0" * 64)
    rebuilt = reconstruct_wire(layout, good, expected_digest=payload.digest)
    assert (
        isinstance(rebuilt, dict) and rebuilt["a"].untyped_storage().data_ptr() != good[0].untyped_storage().data_ptr()
    )


# -- exhaustive single-bit flips -----------------------------------------------------------


def _small_document() -> dict[str, Any]:
    from gefen_portable import export_portable_state
    from portable_sgd_adopter import PortableSGD, initial_values, replicated_manifest

    specs = {"w": (2, 3), "b": (3,)}
    optimizer = PortableSGD(replicated_manifest(specs, None), None, initial_values(specs), scaled=True)
    optimizer.train_steps(0, 2)
    from gefen_contracts.identity import ProcessGroupIdentity
    from gefen_contracts.torch_support import CheckpointProcessGroupBinding

    binding = CheckpointProcessGroupBinding(ProcessGroupIdentity("solo", ("m",)), "m", None, "cpu")
    state = export_portable_state(optimizer, checkpoint_process_group=binding, transaction_id="t", limits=LIMITS)
    return state.materialize()


def test_every_single_bit_flip_of_an_encoded_document_is_rejected_by_the_parser(capsys: Any) -> None:
    metadata = encode_wire(_small_document(), limits=LIMITS).metadata
    rejected = 0
    with no_allocation():
        for bit in range(len(metadata) * 8):
            flipped = bytearray(metadata)
            flipped[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(PortableStateError):
                parse_wire(bytes(flipped), limits=LIMITS)
            rejected += 1
    with capsys.disabled():
        print(f"\n[wire fuzz] {rejected} single-bit flips of a {len(metadata)}-byte document rejected at parse level")
    assert rejected == len(metadata) * 8


def test_resealed_bit_flips_are_rejected_or_decode_to_the_one_canonical_encoding(capsys: Any) -> None:
    """With the trailer recomputed, the structural parser alone must hold: any flip it accepts
    decodes (if its tensors still verify) to a value whose encoding is exactly the flipped bytes."""
    payload = encode_wire({"n": [1, -2, 3.5, "abc", None, True], "t": torch.tensor([1.0, 2.0])}, limits=LIMITS)
    body = payload.metadata[:-32]
    outcomes = {"rejected": 0, "accepted": 0}
    for bit in range(len(body) * 8):
        flipped = bytearray(body)
        flipped[bit // 8] ^= 1 << (bit % 8)
        data = _seal(bytes(flipped))
        try:
            with no_allocation():
                layout = parse_wire(data, limits=LIMITS)
            value = reconstruct_wire(layout, list(payload.tensors))
        except PortableStateError:
            outcomes["rejected"] += 1
            continue
        outcomes["accepted"] += 1
        assert encode_wire(value, limits=LIMITS).metadata == data
    with capsys.disabled():
        print(f"\n[wire fuzz] resealed flips: {outcomes}")
    assert outcomes["rejected"] > 0 and outcomes["accepted"] > 0

"""Tensor leaves for the digest grammar (:mod:`gefen_contracts.digest`), dtype names, the
one-pass finiteness check every state validator uses (:func:`finite_bounds`), the one
DTensor test every package uses (:func:`is_dtensor`, :func:`local_tensor`), the one way a local
piece becomes a DTensor (:func:`dtensor_from_local`), and host values
put on a device without synchronising it (:func:`on_device`)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..digest import DigestLeaf, canonical_digest
from ..errors import CodecError

__all__ = [
    "DIGESTED_DTYPES",
    "dtensor_from_local",
    "dtype_from_name",
    "dtype_name",
    "finite_bounds",
    "is_dtensor",
    "local_tensor",
    "on_device",
    "storage_overlap",
    "tensor_digest",
    "tensor_leaf",
]

_CHUNK_BYTES = 8 << 20
_NAMES = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}


_DTYPES = {name: dtype for dtype, name in _NAMES.items()}
#: The dtypes the digest grammar names (and so the only ones a digested document may hold).
DIGESTED_DTYPES = frozenset(_NAMES)


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``.

    A DTensor exists only once its module was imported, so this looks the class up in
    ``sys.modules`` instead of importing it (which costs seconds in processes that never use
    DTensors); plain tensors and parameters answer without the lookup."""
    cls = type(value)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    kind = getattr(module, "DTensor", None) if module is not None else None
    return isinstance(kind, type) and isinstance(value, kind)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This process's elements: a DTensor's local shard (taken under ``no_grad``, so it is the
    DTensor's own storage and writing into it writes into the DTensor; no collective), else
    ``value`` itself."""
    if is_dtensor(value):
        with torch.no_grad():
            local: torch.Tensor = value.to_local()  # type: ignore[attr-defined]
        return local
    return value


def dtensor_from_local(local: torch.Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> torch.Tensor:
    """``local`` as this rank's piece of a DTensor of global ``shape`` (contiguous strides) on
    ``mesh`` with ``placements``: the same storage, no copy, no collective, no check that the
    pieces agree (the caller derived ``shape`` from the placement).

    This is what ``DTensor.from_local(..., run_check=False, shape=..., stride=...)`` returns,
    built the way FSDP2 builds its parameters (``DTensor(local, spec)``): ``from_local`` goes
    through an autograd function, and state dicts build hundreds of these per save and per
    template (about 110 µs against 40 each on the 2-core VM). No autograd edge: ``local``'s
    ``requires_grad`` is carried, as ``from_local`` carries it for a leaf."""
    from torch._prims_common import make_contiguous_strides_for
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    size = torch.Size(int(d) for d in shape)
    meta = TensorMeta(size, tuple(make_contiguous_strides_for(size)), local.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=local.requires_grad)


def finite_bounds(tensor: torch.Tensor) -> tuple[float, float] | None:
    """``(min, max)`` of a non-empty real floating tensor when every element is finite, else
    ``None``. One ``aminmax`` pass (NaN propagates into it), about ten times cheaper than
    ``isfinite(t).all()``, which allocates a mask."""
    low, high = torch.aminmax(tensor.detach().reshape(-1))
    lo, hi = float(low), float(high)
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def dtype_name(dtype: torch.dtype) -> str:
    """The convention's name of a tensor dtype (``"bfloat16"``); ``CodecError`` if it has none."""
    name = _NAMES.get(dtype)
    if name is None:
        raise CodecError(f"dtype {dtype} has no name in the convention (one of {sorted(_DTYPES)})")
    return name


def dtype_from_name(name: object) -> torch.dtype:
    """The dtype :func:`dtype_name` names; ``CodecError`` for anything else."""
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise CodecError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return dtype


class _TensorLeaf:
    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def digest_dtype(self) -> str:
        return _NAMES[self._tensor.dtype]

    def digest_shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape)

    def digest_nbytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    def digest_chunks(self) -> Iterator[bytes | memoryview]:
        flat = self._tensor.detach().reshape(-1)
        if flat.is_conj():
            flat = flat.resolve_conj()
        if flat.is_neg():
            flat = flat.resolve_neg()
        per_chunk = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
        for start in range(0, flat.numel(), per_chunk):
            piece = flat[start : start + per_chunk].to("cpu").contiguous()
            raw = piece.view(torch.uint8) if piece.dtype is not torch.bool else piece.to(torch.uint8)
            if sys.byteorder == "big" and piece.element_size() > 1:
                data = raw.numpy().tobytes()
                component = piece.element_size() // (2 if piece.is_complex() else 1)
                yield b"".join(data[i : i + component][::-1] for i in range(0, len(data), component))
            else:  # the tensor's own bytes, not a copy (hashing reads the buffer)
                yield raw.numpy().data


def tensor_leaf(value: object) -> DigestLeaf | None:
    """A digest leaf for a plain strided tensor of a supported dtype (``None`` otherwise). A
    parameter over a tensor subclass (an FSDP2 parameter is a DTensor marked as a parameter,
    not an ``nn.Parameter`` subclass) is not plain."""
    if not isinstance(value, torch.Tensor) or not (
        type(value) is torch.Tensor or issubclass(type(value), torch.nn.Parameter)
    ):
        return None
    tensor = value
    if tensor.layout is not torch.strided or tensor.is_meta:
        raise CodecError("only materialized strided tensors can be digested")
    if tensor.dtype not in _NAMES:
        raise CodecError(f"dtype {tensor.dtype} cannot be digested")
    return _TensorLeaf(tensor)


def tensor_digest(value: object) -> str:
    """:func:`~gefen_contracts.digest.canonical_digest` with tensors accepted as leaves."""
    return canonical_digest(value, leaf_adapter=tensor_leaf)


def on_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on ``device``, without waiting for the device: on CUDA through
    pinned memory and an asynchronous copy (a copy from pageable memory first synchronises the
    stream, so a step would wait for every kernel queued before it; torch's pinned-memory cache
    keeps the buffer until the copy has run), directly elsewhere."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``tensor`` can touch, ``[first, last + 1)``: the hull of a strided view."""
    start = int(tensor.data_ptr())
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (int(last) + 1) * tensor.element_size()


#: Above this many elements between two strided tensors' hulls, their overlap is not marked
#: element by element and counts as one (conservatively).
_MARKED_ELEMENTS = 1 << 28


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose hulls overlap share an element: ``a``'s elements are marked in
    a scratch mask over both hulls and ``b``'s read back. Mixed element sizes, misaligned
    offsets or very large hulls count as an overlap."""
    size = a.element_size()
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    start, end = min(a_start, b_start), max(a_end, b_end)
    if b.element_size() != size or (a_start - start) % size or (b_start - start) % size:
        return True
    count = (end - start) // size
    if count > _MARKED_ELEMENTS:
        return True
    mask = torch.zeros(count, dtype=torch.bool)
    torch.as_strided(mask, a.shape, a.stride(), (a_start - start) // size).fill_(True)
    return bool(torch.as_strided(mask, b.shape, b.stride(), (b_start - start) // size).any())


def _has_memory(tensor: torch.Tensor) -> bool:
    """A plain tensor (or parameter) with an address: a fake, meta or wrapper-subclass tensor
    (torchao's, a FakeTensor model's) says nothing about memory through ``data_ptr()``."""
    plain = type(tensor) is torch.Tensor or issubclass(type(tensor), torch.nn.Parameter)
    return plain and not tensor.is_meta and tensor.numel() > 0 and tensor.data_ptr() != 0


def storage_overlap(labelled: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """Why two of the ``(label, tensor)`` pairs share memory, or ``None`` when they do not
    (empty, meta, fake and wrapper-subclass tensors are skipped). Tensors compare by the bytes
    they span on their device, so two storages over one buffer (``torch.from_numpy`` of
    overlapping arrays) are compared too; where a non-contiguous tensor's hull overlaps another,
    their elements are compared exactly (disjoint column halves of one buffer do not overlap)."""
    by_device: dict[str, list[tuple[int, int, str, torch.Tensor]]] = {}
    for label, tensor in labelled:
        if not _has_memory(tensor):
            continue
        start, end = _byte_span(tensor)
        by_device.setdefault(str(tensor.device), []).append((start, end, label, tensor))
    for spans in by_device.values():
        spans.sort(key=lambda span: (span[0], span[1]))
        active: list[tuple[int, int, str, torch.Tensor]] = []  # spans still open at this start
        for span in spans:
            active = [other for other in active if other[1] > span[0]]
            for other in active:
                first, second = sorted((other[2], span[2]))
                if other[3].is_contiguous() and span[3].is_contiguous():
                    return f"{first} and {second} overlap in storage"
                if other[3].device.type != "cpu" or _elements_overlap(other[3], span[3]):
                    return f"{first} and {second}: a non-contiguous tensor shares its memory with another"
            active.append(span)
    return None

"""Tensor rules shared by the wire codec, the document and the fragments.

A *tight CPU tensor* is exactly ``torch.Tensor`` (no subclass, no ``Parameter``), strided,
on the CPU, contiguous, at storage offset 0, owning exactly ``numel * element_size`` bytes
of storage, and neither a conjugate nor a negative view. Floating and complex tensors must
also be finite. Tight tensors are what every document and fragment holds, so they survive
``torch.save`` + ``torch.load(weights_only=True)`` unchanged and never alias a larger buffer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from gefen_contracts.torch_support import finite_bounds, tensor_digest

from .errors import PortableStateError

__all__ = [
    "DTYPE_BY_CODE",
    "DTYPE_CODES",
    "WireDtype",
    "check_finite",
    "is_tight_cpu",
    "owned_cpu_copy",
    "require_little_endian",
    "require_tight",
    "tensor_nbytes",
    "tensor_sha256",
]


@dataclass(frozen=True, slots=True)
class WireDtype:
    """One row of the dtype table: wire code, torch dtype, element size in bytes."""

    code: int
    dtype: torch.dtype
    itemsize: int


_TABLE = (
    WireDtype(1, torch.bool, 1),
    WireDtype(2, torch.uint8, 1),
    WireDtype(3, torch.int8, 1),
    WireDtype(4, torch.int16, 2),
    WireDtype(5, torch.int32, 4),
    WireDtype(6, torch.int64, 8),
    WireDtype(7, torch.float16, 2),
    WireDtype(8, torch.bfloat16, 2),
    WireDtype(9, torch.float32, 4),
    WireDtype(10, torch.float64, 8),
    WireDtype(11, torch.complex64, 8),
    WireDtype(12, torch.complex128, 16),
)
#: wire code -> row (codes are part of the wire format; never renumber)
DTYPE_BY_CODE: dict[int, WireDtype] = {row.code: row for row in _TABLE}
#: torch dtype -> row
DTYPE_CODES: dict[torch.dtype, WireDtype] = {row.dtype: row for row in _TABLE}


def require_little_endian() -> None:
    """Raise unless the host is little-endian (wire bytes are the native little-endian bytes)."""
    if sys.byteorder != "little":
        raise PortableStateError("gefen-portable's wire codec and collectives need a little-endian host")


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def is_tight_cpu(tensor: object) -> bool:
    """True for an exact, strided, contiguous CPU tensor owning exactly its bytes."""
    if type(tensor) is not torch.Tensor:
        return False
    if tensor.layout is not torch.strided or tensor.is_meta or tensor.device.type != "cpu":
        return False
    if tensor.is_conj() or tensor.is_neg() or not tensor.is_contiguous() or tensor.storage_offset() != 0:
        return False
    return bool(tensor.untyped_storage().nbytes() == tensor_nbytes(tensor))


def check_finite(tensor: torch.Tensor, where: str) -> None:
    """Raise :class:`PortableStateError` if a floating or complex tensor holds NaN or infinity."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return
    flat = tensor.detach().reshape(-1)
    if tensor.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    if finite_bounds(flat) is None:
        raise PortableStateError(f"{where} holds a non-finite value")


def owned_cpu_copy(tensor: torch.Tensor, *, chunk_bytes: int = 8 << 20) -> torch.Tensor:
    """A fresh tight CPU copy of ``tensor`` (conjugate/negative views resolved), copied in chunks."""
    source = tensor.detach()
    if source.is_conj():
        source = source.resolve_conj()
    if source.is_neg():
        source = source.resolve_neg()
    out = torch.empty(tuple(source.shape), dtype=source.dtype, device="cpu")
    if out.numel() == 0:
        return out
    flat_out = out.reshape(-1)
    flat_in = source.reshape(-1) if source.is_contiguous() else None
    if flat_in is None:
        out.copy_(source)
        return out
    step = max(1, chunk_bytes // max(1, source.element_size()))
    for start in range(0, flat_out.numel(), step):
        flat_out[start : start + step].copy_(flat_in[start : start + step])
    return out


def require_tight(value: object, shape: tuple[int, ...], dtype: torch.dtype, where: str) -> torch.Tensor:
    """Return ``value`` if it is a tight, finite CPU tensor of exactly ``shape`` and ``dtype``."""
    if type(value) is not torch.Tensor:
        raise PortableStateError(f"{where} must be a torch.Tensor (no subclass), got {type(value).__name__}")
    if value.dtype is not dtype:
        raise PortableStateError(f"{where} must be {dtype}, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise PortableStateError(f"{where} must have shape {shape}, got {tuple(value.shape)}")
    if not is_tight_cpu(value):
        raise PortableStateError(f"{where} must be a tight CPU tensor (contiguous, offset 0, owning its storage)")
    if value.requires_grad:
        raise PortableStateError(f"{where} must not require grad")
    check_finite(value, where)
    return value


def tensor_sha256(tensor: torch.Tensor) -> bytes:
    """The 32-byte digest of one tensor under the contracts' digest grammar (tensor as root)."""
    return bytes.fromhex(tensor_digest(tensor))

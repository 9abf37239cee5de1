"""How Gefen's state tensors follow their parameter in a checkpoint: shapes and DTensor placements.

Gefen steps blocked views of its state (codes ``uint8[B, P]``, scales ``fp32[B, 1]``); a
native state dict holds the same storage viewed *like the parameter*, so that under FSDP2 it
is a DTensor that torch's DCP reshards N -> M by relabelling, bit for bit:

=================  ==================================  ===================================
entry              shape (global)                      DTensor placement
=================  ==================================  ===================================
``m_codes``        the parameter's shape               the parameter's
``m_magnitude``,   ``[rows, row_length / P]`` for a    the parameter's (whole blocks lie
``vmean``          parameter of two or more dims,      in one row, so they shard with the
                   ``[ceil(numel / P)]`` otherwise     rows)
``v_row``          ``[rows]``                          the parameter's
``v_col``          ``[columns]``                       ``Replicate()`` (it is all-reduced)
``v``              the parameter's shape               the parameter's
=================  ==================================  ===================================

The table is what the declared geometry of each entry gives
(:data:`gefen_core.param_state.PARAMETER_FIELDS`, ``gefen_contracts.state_layout.parameter_state_shape`` and
``follows_parameter_placement``); nothing here restates it. The shapes depend on the
parameter's shape and the period only, and the period on the
shape (and whether the parameter is row-sharded, :func:`gefen_core.periods.shape_period`),
so the period is not stored: the scales' shape gives it back (:func:`period_from_scales`).
The zero-gradient template step of ``torch.distributed.checkpoint.state_dict`` makes
tensors of the saved shapes. The optimizer-wide codebook is a plain tensor, equal on every
rank of a mesh (DCP saves it once).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import StateGeometry
from gefen_contracts.state_layout import follows_parameter_placement, parameter_state_shape
from gefen_contracts.torch_support import dtensor_from_local

from .distributed import is_dtensor, local_tensor
from .native_records import check_state_tensor, fail
from .param_state import INDICES, PARAMETER_FIELDS, VARIANT_FIELDS, element_codes, period_of
from .periods import period_from_blocks

__all__ = ["export_tensors", "expected_shapes", "import_tensor", "period_from_scales", "state_dtype"]


def period_from_scales(shape: Sequence[int], scales: Sequence[int]) -> int | None:
    """The period whose block geometry (``gefen_contracts.state_layout.parameter_state_shape``) for a tensor of
    ``shape`` is ``scales`` (``None`` when there is none; 1 for a tensor without elements,
    where every period is the same)."""
    dims = tuple(int(d) for d in shape)
    numel = math.prod(dims)
    if numel == 0:
        return 1 if math.prod(scales) == 0 else None
    count = math.prod(dims[1:]) if len(scales) == 2 else numel
    period = period_from_blocks(count, int(scales[-1]) if scales else 0)
    if period is None:
        return None
    return period if parameter_state_shape(StateGeometry.BLOCK, dims, period) == tuple(map(int, scales)) else None


def expected_shapes(shape: Sequence[int], period: int, variant: str) -> dict[str, tuple[int, ...]]:
    """Every state tensor's shape for a tensor of ``shape`` (global or local) and ``period``, from
    the declared geometry of each of the variant's entries (:data:`gefen_core.param_state.PARAMETER_FIELDS`)."""
    fields = VARIANT_FIELDS[variant]
    shapes = {key: parameter_state_shape(PARAMETER_FIELDS[key].geometry, shape, period) for key in fields}
    return {key: shaped for key, shaped in shapes.items() if shaped is not None}


def state_dtype(key: str) -> torch.dtype:
    """The declared dtype of the state tensor ``key``."""
    return getattr(torch, PARAMETER_FIELDS[key].dtype)  # type: ignore[no-any-return]


def _placements(param: torch.Tensor, key: str) -> Any:
    from torch.distributed.tensor import Replicate

    if follows_parameter_placement(PARAMETER_FIELDS[key].geometry):
        return param.placements  # type: ignore[attr-defined]
    return (Replicate(),)


def export_tensors(param: torch.Tensor, state: Mapping[str, Any], variant: str) -> dict[str, torch.Tensor]:
    """The state's tensors viewed like the parameter (views of the live storage), as DTensors
    on the parameter's mesh when it is one."""
    period = period_of(state)
    local = local_tensor(param)
    local_shapes = expected_shapes(local.shape, period, variant)
    out = {key: state[key].reshape(shape) for key, shape in local_shapes.items() if key != INDICES}
    out[INDICES] = element_codes(state[INDICES], local.numel()).view(local_shapes[INDICES])  # no padding
    if not is_dtensor(param):
        return out
    global_shapes = expected_shapes(param.shape, period, variant)
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return {
        key: dtensor_from_local(view, mesh, _placements(param, key), global_shapes[key]) for key, view in out.items()
    }


def import_tensor(
    value: object,
    param: torch.Tensor,
    key: str,
    where: str,
    dtype: torch.dtype,
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    *,
    finite_nonnegative: bool,
) -> torch.Tensor:
    """The local piece of a saved state tensor, checked (dtype, shapes, placement, values).

    A DTensor parameter takes a DTensor of the global shape on a mesh of the parameter's size
    with the placement :func:`export_tensors` gives (what DCP loads into the template); a
    plain parameter takes a plain tensor. Raises :class:`~gefen_contracts.StateValidationError`.
    """
    if is_dtensor(param) != is_dtensor(value):
        wanted = "a DTensor" if is_dtensor(param) else "a plain tensor"
        raise fail(f"{where} must be {wanted} like its parameter, got {type(value).__name__}")
    if is_dtensor(value):
        assert isinstance(value, torch.Tensor)
        if tuple(value.shape) != global_shape:
            raise fail(f"{where} must have global shape {global_shape}, got {tuple(value.shape)}")
        wanted_placements = tuple(_placements(param, key))
        mesh_size = int(param.device_mesh.size())  # type: ignore[attr-defined]
        if tuple(value.placements) != wanted_placements or int(value.device_mesh.size()) != mesh_size:  # type: ignore[attr-defined]
            raise fail(
                f"{where} is placed {tuple(value.placements)} on a mesh of {int(value.device_mesh.size())}; "  # type: ignore[attr-defined]
                f"its parameter needs {wanted_placements} on a mesh of {mesh_size}"
            )
        value = value.to_local()  # type: ignore[attr-defined]
    return check_state_tensor(value, where, dtype, local_shape, finite_nonnegative=finite_nonnegative)

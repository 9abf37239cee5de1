"""Checks of an op call's arguments, shared by every backend.

Each ``check_*`` function looks only at tensor metadata (never at data, never syncing a
device) and returns ``None`` when the call is well formed, else a short reason naming the
argument. The provider answers ``supports`` with these, and each implementation runs the
same check before it hands raw pointers to a kernel (:class:`KernelArgumentError`).
"""

from __future__ import annotations

from typing import Any

import torch

from .signatures import CODEBOOK_SIZE, HISTOGRAM_BINS, MUON_NUM_SCALARS, NUM_SCALARS

__all__ = [
    "PARAM_DTYPES",
    "KernelArgumentError",
    "check_block_step",
    "check_factored_moments",
    "check_factored_stats",
    "check_factored_step",
    "check_histogram",
    "check_muon_momentum",
    "check_stochastic_uniform",
]

#: Parameter/gradient dtypes the kernels implement.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FLAGS = ("apply_decay", "maximize", "deterministic")


class KernelArgumentError(ValueError):
    """An op was called with arguments its kernels do not accept (the message names the argument)."""


def _tensor(value: Any, name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    if not isinstance(value, torch.Tensor):
        return f"{name} must be a tensor, got {type(value).__name__}"
    if value.dtype is not dtype:
        return f"{name} must be {dtype}, got {value.dtype}"
    if value.device != device:
        return f"{name} is on {value.device}, not on {device}"
    if not value.is_contiguous():
        return f"{name} must be contiguous"
    return None


def _flags(kwargs: dict[str, Any], names: tuple[str, ...]) -> str | None:
    if set(kwargs) != set(names):
        return f"keyword arguments must be exactly {sorted(names)}, got {sorted(kwargs)}"
    for name in names:
        if type(kwargs[name]) is not bool:
            return f"{name} must be a bool, got {type(kwargs[name]).__name__}"
    return None


def _param_grad(param: Any, grad: Any) -> str | None:
    if not isinstance(param, torch.Tensor) or not isinstance(grad, torch.Tensor):
        return "param and grad must be tensors"
    if param.dtype not in PARAM_DTYPES:
        return f"param dtype {param.dtype} is not one of {[str(d) for d in PARAM_DTYPES]}"
    if grad.dtype is not param.dtype:
        return f"grad dtype {grad.dtype} differs from param dtype {param.dtype}"
    if grad.device != param.device:
        return f"grad is on {grad.device} but param on {param.device}"
    if param.shape != grad.shape:
        return f"grad shape {tuple(grad.shape)} differs from param shape {tuple(param.shape)}"
    if not param.is_contiguous() or not grad.is_contiguous():
        return "param and grad must be contiguous"
    return None


def _momentum(
    param: torch.Tensor,
    indices: Any,
    magnitude: Any,
    codebook: Any,
    scalars: Any,
    sr_seed: Any,
    num_scalars: int = NUM_SCALARS,
) -> str | None:
    device = param.device
    reason = _tensor(indices, "indices", torch.uint8, device)
    if reason:
        return reason
    if indices.dim() != 2 or indices.numel() != param.numel():
        return f"indices must be [blocks, period] with {param.numel()} elements, got {tuple(indices.shape)}"
    blocks = indices.shape[0]
    reason = _tensor(magnitude, "magnitude", torch.float32, device) or _tensor(
        codebook, "codebook", torch.float32, device
    )
    if reason:
        return reason
    if magnitude.numel() != blocks:
        return f"magnitude must hold one value per block ({blocks}), got {magnitude.numel()}"
    if tuple(codebook.shape) != (CODEBOOK_SIZE,):
        return f"codebook must have shape ({CODEBOOK_SIZE},), got {tuple(codebook.shape)}"
    reason = _tensor(scalars, "scalars", torch.float32, device)
    if reason:
        return reason
    if scalars.numel() < num_scalars:
        return f"scalars must hold {num_scalars} values, got {scalars.numel()}"
    if sr_seed is not None:
        reason = _tensor(sr_seed, "sr_seed", torch.int64, device)
        if reason:
            return reason
        if sr_seed.numel() < 1:
            return "sr_seed must hold one value"
    return None


def check_block_step(*args: Any, **kwargs: Any) -> str | None:
    """``(param, grad, indices, magnitude, vmean, codebook, scalars, sr_seed, *, apply_decay, maximize, deterministic)``."""
    if len(args) != 8:
        return f"gefen::block_step.v2 takes 8 positional arguments, got {len(args)}"
    param, grad, indices, magnitude, vmean, codebook, scalars, sr_seed = args
    reason = _flags(kwargs, _FLAGS) or _param_grad(param, grad)
    if reason:
        return reason
    reason = _momentum(param, indices, magnitude, codebook, scalars, sr_seed)
    if reason:
        return reason
    reason = _tensor(vmean, "vmean", torch.float32, param.device)
    if reason:
        return reason
    if vmean.numel() != indices.shape[0]:
        return f"vmean must hold one value per block ({indices.shape[0]}), got {vmean.numel()}"
    return None


def check_factored_step(*args: Any, **kwargs: Any) -> str | None:
    """``(param, grad, indices, magnitude, row_factor, v_col, codebook, scalars, sr_seed, *, flags)``."""
    if len(args) != 9:
        return f"gefen::factored_step.v3 takes 9 positional arguments, got {len(args)}"
    param, grad, indices, magnitude, row_factor, v_col, codebook, scalars, sr_seed = args
    reason = _flags(kwargs, _FLAGS) or _param_grad(param, grad)
    if reason:
        return reason
    if param.dim() != 2:
        return f"param must be 2-D for the factored step, got {param.dim()}-D"
    reason = _momentum(param, indices, magnitude, codebook, scalars, sr_seed)
    if reason:
        return reason
    rows, cols = param.shape
    reason = _tensor(row_factor, "row_factor", torch.float32, param.device) or _tensor(
        v_col, "v_col", torch.float32, param.device
    )
    if reason:
        return reason
    if row_factor.numel() != rows or v_col.numel() != cols:
        return f"row_factor/v_col must hold {rows}/{cols} values, got {row_factor.numel()}/{v_col.numel()}"
    return None


def check_factored_stats(*args: Any, **kwargs: Any) -> str | None:
    """``(grad, *, deterministic)``: a contiguous 2-D gradient."""
    if len(args) != 1:
        return f"gefen::factored_stats.v1 takes 1 positional argument, got {len(args)}"
    (grad,) = args
    reason = _flags(kwargs, ("deterministic",))
    if reason:
        return reason
    if not isinstance(grad, torch.Tensor):
        return f"grad must be a tensor, got {type(grad).__name__}"
    if grad.dtype not in PARAM_DTYPES:
        return f"grad dtype {grad.dtype} is not supported"
    if grad.dim() != 2 or not grad.is_contiguous():
        return "grad must be a contiguous 2-D tensor"
    return None


def check_factored_moments(*args: Any, **kwargs: Any) -> str | None:
    """``(grad, v_row, v_col, scalars, *, deterministic)``: a contiguous ``R x K`` gradient and
    contiguous fp32 ``[R]``/``[K]`` moments and step scalars on its device."""
    if len(args) != 4:
        return f"gefen::factored_moments.v1 takes 4 positional arguments, got {len(args)}"
    grad, v_row, v_col, scalars = args
    reason = check_factored_stats(grad, **kwargs)
    if reason:
        return reason
    rows, cols = grad.shape
    for value, name in ((v_row, "v_row"), (v_col, "v_col"), (scalars, "scalars")):
        reason = _tensor(value, name, torch.float32, grad.device)
        if reason:
            return reason
    if v_row.numel() != rows or v_col.numel() != cols:
        return f"v_row/v_col must hold {rows}/{cols} values, got {v_row.numel()}/{v_col.numel()}"
    if scalars.numel() < NUM_SCALARS:
        return f"scalars must hold {NUM_SCALARS} values, got {scalars.numel()}"
    if v_row.data_ptr() == v_col.data_ptr() and rows and cols:
        return "v_row and v_col must not share memory"
    return None


def check_histogram(*args: Any, **kwargs: Any) -> str | None:
    """``(grad, period, counts, *, deterministic)``: int64 ``[4096]`` counts on grad's device."""
    if len(args) != 3:
        return f"gefen::histogram.v1 takes 3 positional arguments, got {len(args)}"
    grad, period, counts = args
    reason = _flags(kwargs, ("deterministic",))
    if reason:
        return reason
    if not isinstance(grad, torch.Tensor) or grad.dtype not in PARAM_DTYPES or not grad.is_contiguous():
        return "grad must be a contiguous floating-point tensor"
    if type(period) is not int or period < 1 or grad.numel() % period:
        return f"period must be a positive int dividing {grad.numel()}, got {period!r}"
    reason = _tensor(counts, "counts", torch.int64, grad.device)
    if reason:
        return reason
    if tuple(counts.shape) != (HISTOGRAM_BINS,):
        return f"counts must have shape ({HISTOGRAM_BINS},), got {tuple(counts.shape)}"
    return None


def check_stochastic_uniform(*args: Any, **kwargs: Any) -> str | None:
    """``(seed int64[1], index int64[...])``."""
    if len(args) != 2 or kwargs:
        return "gefen::stochastic_uniform.v1 takes (seed, index) and no keywords"
    seed, index = args
    if not isinstance(index, torch.Tensor) or index.dtype is not torch.int64:
        return "index must be an int64 tensor"
    reason = _tensor(seed, "seed", torch.int64, index.device)
    if reason:
        return reason
    if seed.numel() != 1:
        return f"seed must hold exactly one value, got {seed.numel()}"
    return None


def check_muon_momentum(*args: Any, **kwargs: Any) -> str | None:
    """``(grad, indices, magnitude, codebook, scalars, sr_seed, out, *, nesterov, deterministic)``."""
    if len(args) != 7:
        return f"gefen::muon_momentum.v1 takes 7 positional arguments, got {len(args)}"
    grad, indices, magnitude, codebook, scalars, sr_seed, out = args
    reason = _flags(kwargs, ("nesterov", "deterministic"))
    if reason:
        return reason
    if not isinstance(grad, torch.Tensor) or grad.dtype not in PARAM_DTYPES or not grad.is_contiguous():
        return "grad must be a contiguous floating-point tensor"
    if grad.dim() != 2:
        return f"grad must be a 2-D matrix, got {grad.dim()}-D"
    reason = _momentum(grad, indices, magnitude, codebook, scalars, sr_seed, MUON_NUM_SCALARS)
    if reason:
        return reason
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.bfloat16, torch.float32):
        return "out must be a bf16 or fp32 tensor"
    if out.device != grad.device or out.shape != grad.shape or not out.is_contiguous():
        return f"out must be contiguous, of shape {tuple(grad.shape)}, on {grad.device}"
    return None

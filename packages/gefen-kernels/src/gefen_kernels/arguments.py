"""Checks of an op call's arguments, shared by every backend.

Each ``check_*`` function looks only at tensor metadata (never at data, never syncing a
device) and returns ``None`` when the call is well formed, else a short reason naming the
argument (and, for the list ops, the entry). Each implementation runs its op's check before
it hands raw pointers to a kernel (:class:`KernelArgumentError`). A list op's entries pass one
boolean expression each (the per-tensor cost of a step); the detailed checks run only where
it fails, to say why.
"""

from __future__ import annotations

from typing import Any

import torch

from .signatures import CODEBOOK_SIZE, HISTOGRAM_BINS, MUON_NUM_SCALARS, NUM_SCALARS

__all__ = [
    "PARAM_DTYPES",
    "STEP_LISTS",
    "KernelArgumentError",
    "check_block_step",
    "check_codebook_solve",
    "check_element_step",
    "check_factored_moments",
    "check_factored_stats",
    "check_factored_step",
    "check_histogram",
    "check_muon_momentum",
    "check_step_head",
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


def _covers(codes_numel: int, period: int, numel: int) -> bool:
    """Whether blocked codes of ``codes_numel`` elements in rows of ``period`` hold ``numel``
    elements: every row full but the last, which may be partly padding (ragged blocks)."""
    return codes_numel - period < numel <= codes_numel


def _momentum(param: torch.Tensor, indices: Any, magnitude: Any, *, ragged: bool = False) -> str | None:
    """The quantised momentum of ``param``: uint8 codes ``[blocks, period]`` and one fp32 scale per
    block; with ``ragged`` the last block may be shorter (its row padded)."""
    device = param.device
    reason = _tensor(indices, "indices", torch.uint8, device)
    if reason:
        return reason
    if indices.dim() != 2 or indices.shape[1] < 1:  # a block of no elements has no scale to hold
        return f"indices must be [blocks, period] with a period >= 1, got {tuple(indices.shape)}"
    if ragged and not _covers(indices.numel(), indices.shape[1], param.numel()):
        return f"indices {tuple(indices.shape)} must be the ceil(n / period) blocks of {param.numel()} elements"
    if not ragged and indices.numel() != param.numel():
        return f"indices must be [blocks, period] with {param.numel()} elements, got {tuple(indices.shape)}"
    reason = _tensor(magnitude, "magnitude", torch.float32, device)
    if reason:
        return reason
    if magnitude.numel() != indices.shape[0]:
        return f"magnitude must hold one value per block ({indices.shape[0]}), got {magnitude.numel()}"
    return None


def _shared(
    device: torch.device, codebook: Any, scalars: Any, sr_seeds: Any, rows: int, num_scalars: int = NUM_SCALARS
) -> str | None:
    """The arguments every entry shares: the codebook, the scalar packet (``[num_scalars]``, or
    ``[rows, num_scalars]`` one row per entry) and one int64 seed per entry (or ``None``)."""
    reason = _tensor(codebook, "codebook", torch.float32, device) or _tensor(scalars, "scalars", torch.float32, device)
    if reason:
        return reason
    if tuple(codebook.shape) != (CODEBOOK_SIZE,):
        return f"codebook must have shape ({CODEBOOK_SIZE},), got {tuple(codebook.shape)}"
    if tuple(scalars.shape) not in ((num_scalars,), (rows, num_scalars)):
        return f"scalars must have shape ({num_scalars},) or ({rows}, {num_scalars}), got {tuple(scalars.shape)}"
    if sr_seeds is not None:
        reason = _tensor(sr_seeds, "sr_seeds", torch.int64, device)
        if reason:
            return reason
        if tuple(sr_seeds.shape) != (rows,):  # 1-D, as the reference indexes it
            return f"sr_seeds must have shape ({rows},), one seed per entry, got {tuple(sr_seeds.shape)}"
    return None


def _lists(op: str, lists: dict[str, Any]) -> str | None:
    """Each argument a list (or tuple), all of one length (their items are checked per entry)."""
    lengths = set()
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)):
            return f"{op}: {name} must be a list of tensors"
        lengths.add(len(value))
    if len(lengths) > 1:
        return f"{op}: the tensor lists differ in length ({', '.join(f'{n}={len(v)}' for n, v in lists.items())})"
    return None


def _entries(lists: dict[str, Any], device: torch.device, fast: Any, check: Any) -> str | None:
    """Check every entry of the lists (one tensor of each). ``fast(*entry, device)`` is one
    boolean expression that holds only for a well-formed entry (the step's per-tensor cost);
    where it does not hold (or cannot be evaluated: not a tensor), ``check(*entry)`` finds the
    reason, and the first one is returned naming its entry. ``check`` looks at one entry, so
    what only ``fast`` sees is an entry on another device than the list's first."""
    for index, entry in enumerate(zip(*lists.values(), strict=True)):
        try:
            if fast(*entry, device):
                continue
        except (AttributeError, TypeError):
            pass
        reason = check(*entry) or f"its tensors are not all on {device}, the device of the list's first entry"
        return f"entry {index}: {reason}"
    return None


_U8, _F32 = torch.uint8, torch.float32
_PARAM_DTYPE_SET = frozenset(PARAM_DTYPES)


def _block_fast(p: Any, g: Any, q: Any, m: Any, v: Any, device: torch.device) -> bool:
    return bool(
        p.dtype in _PARAM_DTYPE_SET
        and g.dtype is p.dtype
        and q.dtype is _U8
        and m.dtype is _F32
        and v.dtype is _F32
        and g.shape == p.shape
        and q.dim() == 2
        and q.numel() - q.shape[1] < p.numel() <= q.numel()
        and m.numel() == q.shape[0]
        and v.numel() == q.shape[0]
        and p.is_contiguous()
        and g.is_contiguous()
        and q.is_contiguous()
        and m.is_contiguous()
        and v.is_contiguous()
        and p.device == device
        and g.device == device
        and q.device == device
        and m.device == device
        and v.device == device
    )


def _factored_fast(p: Any, g: Any, q: Any, m: Any, r: Any, c: Any, device: torch.device) -> bool:
    return bool(
        p.dtype in _PARAM_DTYPE_SET
        and g.dtype is p.dtype
        and q.dtype is _U8
        and m.dtype is _F32
        and r.dtype is _F32
        and c.dtype is _F32
        and g.shape == p.shape
        and p.dim() == 2
        and q.dim() == 2
        and q.shape[1] >= 1
        and q.numel() == p.numel()
        and m.numel() == q.shape[0]
        and r.numel() == p.shape[0]
        and c.numel() == p.shape[1]
        and p.is_contiguous()
        and g.is_contiguous()
        and q.is_contiguous()
        and m.is_contiguous()
        and r.is_contiguous()
        and c.is_contiguous()
        and p.device == device
        and g.device == device
        and q.device == device
        and m.device == device
        and r.device == device
        and c.device == device
    )


def _moments_fast(g: Any, r: Any, c: Any, device: torch.device) -> bool:
    return bool(
        g.dtype in _PARAM_DTYPE_SET
        and r.dtype is _F32
        and c.dtype is _F32
        and g.dim() == 2
        and r.numel() == g.shape[0]
        and c.numel() == g.shape[1]
        and g.is_contiguous()
        and r.is_contiguous()
        and c.is_contiguous()
        and g.device == device
        and r.device == device
        and c.device == device
        and (r.data_ptr() != c.data_ptr() or not r.numel() or not c.numel())
    )


def _element_fast(p: Any, g: Any, q: Any, m: Any, v: Any, device: torch.device) -> bool:
    return bool(
        p.dtype in _PARAM_DTYPE_SET
        and g.dtype is p.dtype
        and q.dtype is _U8
        and m.dtype is _F32
        and v.dtype is _F32
        and g.shape == p.shape
        and v.shape == p.shape
        and q.dim() == 2
        and q.shape[1] >= 1
        and q.numel() == p.numel()
        and m.numel() == q.shape[0]
        and p.is_contiguous()
        and g.is_contiguous()
        and q.is_contiguous()
        and m.is_contiguous()
        and v.is_contiguous()
        and p.device == device
        and g.device == device
        and q.device == device
        and m.device == device
        and v.device == device
    )


def _element_entry(param: Any, grad: Any, indices: Any, magnitude: Any, v: Any) -> str | None:
    reason = _param_grad(param, grad) or _momentum(param, indices, magnitude)
    if reason:
        return reason
    reason = _tensor(v, "v", torch.float32, param.device)
    if reason:
        return reason
    if v.shape != param.shape:
        return f"v must have the parameter's shape {tuple(param.shape)}, got {tuple(v.shape)}"
    return None


def _block_entry(param: Any, grad: Any, indices: Any, magnitude: Any, vmean: Any) -> str | None:
    reason = _param_grad(param, grad) or _momentum(param, indices, magnitude, ragged=True)
    if reason:
        return reason
    reason = _tensor(vmean, "vmean", torch.float32, param.device)
    if reason:
        return reason
    if vmean.numel() != indices.shape[0]:
        return f"vmean must hold one value per block ({indices.shape[0]}), got {vmean.numel()}"
    return None


def _factored_entry(param: Any, grad: Any, indices: Any, magnitude: Any, row_factor: Any, v_col: Any) -> str | None:
    reason = _param_grad(param, grad)
    if reason:
        return reason
    if param.dim() != 2:
        return f"param must be 2-D for the factored step, got {param.dim()}-D"
    reason = _momentum(param, indices, magnitude)
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


#: The step ops' list arguments, by op (each is followed by ``codebook, scalars, sr_seeds``).
STEP_LISTS = {
    "gefen::block_step.v4": ("params", "grads", "indices", "magnitudes", "vmeans"),
    "gefen::element_step.v2": ("params", "grads", "indices", "magnitudes", "vs"),
    "gefen::factored_step.v5": ("params", "grads", "indices", "magnitudes", "row_factors", "v_cols"),
}


def _step_lists(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], fast: Any, check: Any) -> str | None:
    names = STEP_LISTS[op]
    expected = len(names) + 3
    if len(args) != expected:
        return f"{op} takes {expected} positional arguments, got {len(args)}"
    lists = dict(zip(names, args[: len(names)], strict=False))
    codebook, scalars, sr_seeds = args[len(names) :]
    reason = _flags(kwargs, _FLAGS) or _lists(op, lists)
    if reason or not args[0]:
        return reason
    first = args[0][0]
    if not isinstance(first, torch.Tensor):
        return f"entry 0: param must be a tensor, got {type(first).__name__}"
    device = first.device
    reason = _shared(device, codebook, scalars, sr_seeds, len(args[0]))
    return reason if reason or fast is None else _entries(lists, device, fast, check)


def check_step_head(op: str, *args: Any, **kwargs: Any) -> str | None:
    """The checks of a step op (``STEP_LISTS``) but its per-entry ones: for a backend that tests
    each entry while it reads the entry's pointers, and asks the op's ``check_*`` for the
    reason only when one fails."""
    return _step_lists(op, args, kwargs, None, None)


def check_block_step(*args: Any, **kwargs: Any) -> str | None:
    """``(params, grads, indices, magnitudes, vmeans, codebook, scalars, sr_seeds, *, apply_decay,
    maximize, deterministic)``: lists of equal length, every entry on one device."""
    return _step_lists("gefen::block_step.v4", args, kwargs, _block_fast, _block_entry)


def check_element_step(*args: Any, **kwargs: Any) -> str | None:
    """``(params, grads, indices, magnitudes, vs, codebook, scalars, sr_seeds, *, flags)``: each
    ``v`` fp32 of its parameter's shape, the codes tiling the parameter."""
    return _step_lists("gefen::element_step.v2", args, kwargs, _element_fast, _element_entry)


def check_factored_step(*args: Any, **kwargs: Any) -> str | None:
    """``(params, grads, indices, magnitudes, row_factors, v_cols, codebook, scalars, sr_seeds, *, flags)``."""
    return _step_lists("gefen::factored_step.v5", args, kwargs, _factored_fast, _factored_entry)


def _stats_entry(grad: Any) -> str | None:
    """One gradient of the statistics: a contiguous 2-D tensor of a supported dtype."""
    if not isinstance(grad, torch.Tensor):
        return f"grad must be a tensor, got {type(grad).__name__}"
    if grad.dtype not in PARAM_DTYPES:
        return f"grad dtype {grad.dtype} is not supported"
    if grad.dim() != 2 or not grad.is_contiguous():
        return "grad must be a contiguous 2-D tensor"
    return None


def check_factored_stats(*args: Any, **kwargs: Any) -> str | None:
    """``(grads, *, deterministic)``: contiguous 2-D gradients, all on one device."""
    op = "gefen::factored_stats.v2"
    if len(args) != 1:
        return f"{op} takes 1 positional argument, got {len(args)}"
    (grads,) = args
    reason = _flags(kwargs, ("deterministic",)) or _lists(op, {"grads": grads})
    if reason or not grads:
        return reason
    for index, grad in enumerate(grads):
        reason = _stats_entry(grad)
        if reason:
            return f"entry {index}: {reason}"
        if grad.device != grads[0].device:
            return f"entry {index}: grad is on {grad.device}, not on {grads[0].device} (the first entry's)"
    return None


def _moments_entry(grad: Any, v_row: Any, v_col: Any) -> str | None:
    reason = _stats_entry(grad)
    if reason:
        return reason
    rows, cols = grad.shape
    for value, name in ((v_row, "v_row"), (v_col, "v_col")):
        reason = _tensor(value, name, torch.float32, grad.device)
        if reason:
            return reason
    if v_row.numel() != rows or v_col.numel() != cols:
        return f"v_row/v_col must hold {rows}/{cols} values, got {v_row.numel()}/{v_col.numel()}"
    if v_row.data_ptr() == v_col.data_ptr() and rows and cols:
        return "v_row and v_col must not share memory"
    return None


def check_factored_moments(*args: Any, **kwargs: Any) -> str | None:
    """``(grads, v_rows, v_cols, scalars, *, deterministic)``: contiguous ``R x K`` gradients and
    contiguous fp32 ``[R]``/``[K]`` moments, the step scalars on their device."""
    op = "gefen::factored_moments.v3"
    if len(args) != 4:
        return f"{op} takes 4 positional arguments, got {len(args)}"
    grads, v_rows, v_cols, scalars = args
    lists = {"grads": grads, "v_rows": v_rows, "v_cols": v_cols}
    reason = _flags(kwargs, ("deterministic",)) or _lists(op, lists)
    if reason or not grads:
        return reason
    if not isinstance(grads[0], torch.Tensor):
        return f"entry 0: grad must be a tensor, got {type(grads[0]).__name__}"
    device = grads[0].device
    reason = _tensor(scalars, "scalars", torch.float32, device)
    if reason:
        return reason
    if tuple(scalars.shape) not in ((NUM_SCALARS,), (len(grads), NUM_SCALARS)):
        return f"scalars must have shape ({NUM_SCALARS},) or ({len(grads)}, {NUM_SCALARS}), got {tuple(scalars.shape)}"
    return _entries(lists, device, _moments_fast, _moments_entry)


def check_histogram(*args: Any, **kwargs: Any) -> str | None:
    """``(grads, periods, counts, *, deterministic)``: contiguous floating-point gradients, one
    positive int period each, int64 ``[4096]`` counts on their device."""
    op = "gefen::histogram.v2"
    if len(args) != 3:
        return f"{op} takes 3 positional arguments, got {len(args)}"
    grads, periods, counts = args
    reason = _flags(kwargs, ("deterministic",)) or _lists(op, {"grads": grads, "periods": periods})
    if reason:
        return reason
    if not isinstance(counts, torch.Tensor):
        return f"counts must be a tensor, got {type(counts).__name__}"
    for index, (grad, period) in enumerate(zip(grads, periods, strict=True)):
        if not isinstance(grad, torch.Tensor) or grad.dtype not in PARAM_DTYPES or not grad.is_contiguous():
            return f"entry {index}: grad must be a contiguous floating-point tensor"
        if type(period) is not int or not 1 <= period < 2**63:  # what C's int64 holds
            return f"entry {index}: period must be an int in [1, 2**63), got {period!r}"
        if grad.device != counts.device:
            return f"entry {index}: grad is on {grad.device} but counts on {counts.device}"
    return _counts(counts, counts.device)


def _counts(counts: Any, device: torch.device) -> str | None:
    """A histogram: a contiguous int64 ``[4096]`` tensor on ``device``."""
    return _tensor(counts, "counts", torch.int64, device) or (
        None
        if tuple(counts.shape) == (HISTOGRAM_BINS,)
        else f"counts must have shape ({HISTOGRAM_BINS},), got {tuple(counts.shape)}"
    )


def check_codebook_solve(*args: Any, **kwargs: Any) -> str | None:
    """``(counts int64[4096])`` on the CPU: a histogram of the codebook solve."""
    if len(args) != 1 or kwargs:
        return "gefen::codebook_solve.v2 takes (counts) and no keywords"
    return _counts(args[0], torch.device("cpu"))


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


_OUT_DTYPES = (torch.bfloat16, torch.float32)


def _muon_entry(grad: Any, indices: Any, magnitude: Any, out: Any) -> str | None:
    if not isinstance(grad, torch.Tensor) or grad.dtype not in PARAM_DTYPES or not grad.is_contiguous():
        return "grad must be a contiguous floating-point tensor"
    if grad.dim() != 2:
        return f"grad must be a 2-D matrix, got {grad.dim()}-D"
    reason = _momentum(grad, indices, magnitude)
    if reason:
        return reason
    if not isinstance(out, torch.Tensor) or out.dtype not in _OUT_DTYPES:
        return "out must be a bf16 or fp32 tensor"
    if out.device != grad.device or out.shape != grad.shape or not out.is_contiguous():
        return f"out must be contiguous, of shape {tuple(grad.shape)}, on {grad.device}"
    return None


def _muon_fast(g: Any, q: Any, m: Any, o: Any, device: torch.device) -> bool:
    return bool(
        g.dtype in _PARAM_DTYPE_SET
        and q.dtype is _U8
        and m.dtype is _F32
        and o.dtype in _OUT_DTYPES
        and g.dim() == 2
        and o.shape == g.shape
        and q.dim() == 2
        and q.shape[1] >= 1
        and q.numel() == g.numel()
        and m.numel() == q.shape[0]
        and g.is_contiguous()
        and q.is_contiguous()
        and m.is_contiguous()
        and o.is_contiguous()
        and g.device == device
        and q.device == device
        and m.device == device
        and o.device == device
    )


def check_muon_momentum(*args: Any, **kwargs: Any) -> str | None:
    """``(grads, indices, magnitudes, codebook, scalars, sr_seeds, outs, *, nesterov, deterministic)``."""
    op = "gefen::muon_momentum.v3"
    if len(args) != 7:
        return f"{op} takes 7 positional arguments, got {len(args)}"
    grads, indices, magnitudes, codebook, scalars, sr_seeds, outs = args
    lists = {"grads": grads, "indices": indices, "magnitudes": magnitudes, "outs": outs}
    reason = _flags(kwargs, ("nesterov", "deterministic")) or _lists(op, lists)
    if reason or not grads:
        return reason
    if not isinstance(grads[0], torch.Tensor):
        return f"entry 0: grad must be a tensor, got {type(grads[0]).__name__}"
    device = grads[0].device
    reason = _shared(device, codebook, scalars, sr_seeds, len(grads), MUON_NUM_SCALARS)
    return reason or _entries(lists, device, _muon_fast, _muon_entry)

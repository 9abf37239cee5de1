"""Gefen's ops on CPU tensors, through the compiled library of :mod:`gefen_kernels.cpu_build`.

Each function has its op's signature (``gefen_core.ops``), checks its arguments
(:mod:`gefen_kernels.arguments`), passes raw data pointers to the C kernel and bumps the
autograd version counter of every tensor it wrote, as the in-place torch ops of the
reference would. The kernels use ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

import array
import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import increment_version

from . import arguments
from .cpu_build import load_cpu_library
from .signatures import CODEBOOK_SIZE

__all__ = [
    "block_step",
    "codebook_solve",
    "element_step",
    "factored_moments",
    "factored_stats",
    "factored_step",
    "histogram",
    "muon_momentum",
    "nearest_rounding_path",
    "stochastic_uniform",
]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
#: Row chunks of the factored statistics (fixed, so the sum order does not depend on threads).
_STATS_CHUNKS = 16

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    "gefen_block_step": [_I64, _P, _P, _P, _I64, _P, _INT, _INT, _INT, _P],
    "gefen_element_step": [_I64, _P, _P, _P, _I64, _P, _INT, _INT, _INT, _P],
    "gefen_factored_step": [_I64, _P, _P, _P, _I64, _P, _INT, _INT, _INT, _P],
    "gefen_factored_stats": [_INT, _P, _I64, _I64, _P, _P, _P, _I64, _INT],
    "gefen_factored_moments": [_I64, _P, _P, _I64, _I64, _INT],
    "gefen_histogram": [_INT, _P, _I64, _I64, _P, _INT],
    "gefen_muon_momentum": [_I64, _P, _P, _P, _I64, _P, _INT, _INT, _P],
    "gefen_stochastic_uniform": [_P, _P, _P, _I64, _INT],
    "gefen_codebook_solve": [_P, _I64, _I64, _P],
    "gefen_uses_threshold_table": [_P, _P],
}
_BOUND: dict[str, Callable[..., int]] = {}
_BOUND_TO: list[ctypes.CDLL] = []
_TABLES = threading.local()


def _library() -> ctypes.CDLL:
    library = load_cpu_library()
    if library is None:
        raise RuntimeError("gefen-kernels: the CPU kernel library is unavailable (see the earlier warning)")
    return library


def _codebook_table() -> int:
    """This thread's codebook lookup table (the kernel rebuilds it when the codebook changes)."""
    library = _library()
    table = getattr(_TABLES, "buffer", None)
    if table is None or getattr(_TABLES, "library", None) is not library:
        library.gefen_table_bytes.restype = ctypes.c_int64
        table = ctypes.create_string_buffer(int(library.gefen_table_bytes()))
        _TABLES.buffer = table
        _TABLES.library = library
    return ctypes.addressof(table)


def _function(name: str) -> Callable[..., int]:
    library = _library()
    if not _BOUND_TO or _BOUND_TO[0] is not library:
        _BOUND.clear()
        _BOUND_TO[:] = [library]
    found = _BOUND.get(name)
    if found is None:
        raw = getattr(library, name)
        raw.argtypes = _SIGNATURES[name]
        raw.restype = ctypes.c_int
        found = raw
        _BOUND[name] = found
    return found


def _check(reason: str | None) -> None:
    if reason is not None:
        raise arguments.KernelArgumentError(reason)


def _on_cpu(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise arguments.KernelArgumentError(f"the CPU kernels need CPU tensors, got one on {tensor.device}")


def _checked(name: str, status: int) -> None:
    """Raise for a C entry point's nonzero status (called after the C function returned, so
    the path from an op to its arithmetic holds no extra frame)."""
    if status != 0:
        raise RuntimeError(f"gefen-kernels: {name} failed with status {status}")


def _seed_pointer(sr_seed: torch.Tensor | None) -> int | None:
    return None if sr_seed is None else sr_seed.data_ptr()


def _entries(rows: list[int]) -> array.array[int]:
    """The int64 entry table of a list op (see ``run_entries`` in the C source); pass
    ``entries.buffer_info()[0]`` and keep ``entries`` alive over the call."""
    return array.array("q", rows)


def _list_scalars(scalars: torch.Tensor) -> tuple[int, int]:
    """The packet's pointer and its stride between entries (0: one packet shared by all)."""
    return scalars.data_ptr(), (scalars.shape[1] if scalars.dim() == 2 else 0)


_U8, _F32 = torch.uint8, torch.float32
#: Why an entry failed the fused test when the detailed checks find nothing (a tensor off the CPU).
_OFF_CPU = "an entry holds a tensor that is not on the CPU"
_TEST_ERRORS = (KeyError, ValueError, TypeError, AttributeError)


def _blocked_rows(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    seconds: list[torch.Tensor],
    *,
    per_element: bool,
) -> array.array[int] | None:
    """The entry table of the block step (``seconds``: one fp32 value per block; the last block
    may be ragged) or the element step (one per element; the blocks tile the parameter), or
    ``None`` when an entry fails the test that makes its pointers safe to hand to C (the
    caller then asks :mod:`~gefen_kernels.arguments` why). The test and the table read each
    attribute once: this loop is the step's per-tensor cost."""
    rows: list[int] = []
    try:
        for p, g, q, m, v in zip(params, grads, indices, magnitudes, seconds, strict=True):
            dtype = p.dtype
            code = _DTYPE_CODES[dtype]
            blocks, period = q.shape
            shape = p.shape
            numel = p.numel()
            codes = blocks * period
            if not (
                period >= 1
                and g.dtype is dtype
                and q.dtype is _U8
                and m.dtype is _F32
                and v.dtype is _F32
                and g.shape == shape
                and m.numel() == blocks
                and (
                    (codes == numel and v.shape == shape)
                    if per_element
                    else (codes - period < numel <= codes and v.numel() == blocks)
                )
                and p.is_cpu
                and g.is_cpu
                and q.is_cpu
                and m.is_cpu
                and v.is_cpu
                and p.is_contiguous()
                and g.is_contiguous()
                and q.is_contiguous()
                and m.is_contiguous()
                and v.is_contiguous()
            ):
                return None
            # numel: the C code cuts a ragged last block from it
            rows += (code, numel, p.data_ptr(), g.data_ptr(), q.data_ptr(), m.data_ptr(), v.data_ptr(), blocks, period)
    except _TEST_ERRORS:  # not a tensor, codes that are not 2-D, a dtype the kernels lack
        return None
    return _entries(rows)


def _blocked_step(
    op: str, function: str, *, per_element: bool, check: Callable[..., str | None]
) -> Callable[..., None]:
    """The CPU implementation of a blocked step op: ``block_step`` (one ``v`` mean per block in
    ``seconds``) or ``element_step`` (Adam's ``v`` per element). One C call for every entry;
    deterministic always (a block is summed by one thread; the element path has no sum)."""

    def step(
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        indices: list[torch.Tensor],
        magnitudes: list[torch.Tensor],
        seconds: list[torch.Tensor],
        codebook: torch.Tensor,
        scalars: torch.Tensor,
        sr_seeds: torch.Tensor | None,
        *,
        apply_decay: bool,
        maximize: bool,
        deterministic: bool,
    ) -> None:
        args = (params, grads, indices, magnitudes, seconds, codebook, scalars, sr_seeds)
        flags = {"apply_decay": apply_decay, "maximize": maximize, "deterministic": deterministic}
        _check(arguments.check_step_head(op, *args, **flags))
        if not params:
            return
        _on_cpu(params[0])
        entries = _blocked_rows(params, grads, indices, magnitudes, seconds, per_element=per_element)
        if entries is None:
            raise arguments.KernelArgumentError(check(*args, **flags) or _OFF_CPU)
        status = _function(function)(
            len(params),
            entries.buffer_info()[0],
            codebook.data_ptr(),
            *_list_scalars(scalars),
            _seed_pointer(sr_seeds),
            int(apply_decay),
            int(maximize),
            torch.get_num_threads(),
            _codebook_table(),
        )
        _checked(function, status)
        increment_version([*params, *indices, *magnitudes, *seconds])

    step.__name__ = step.__qualname__ = op.split("::")[1].split(".", maxsplit=1)[0]
    step.__doc__ = f"``{op}`` on CPU (:func:`_blocked_step`)."
    return step


#: ``gefen::block_step.v4`` on CPU.
block_step = _blocked_step(
    "gefen::block_step.v4", "gefen_block_step", per_element=False, check=arguments.check_block_step
)
#: ``gefen::element_step.v2`` on CPU.
element_step = _blocked_step(
    "gefen::element_step.v2", "gefen_element_step", per_element=True, check=arguments.check_element_step
)


def _factored_rows(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    row_factors: list[torch.Tensor],
    v_cols: list[torch.Tensor],
) -> array.array[int] | None:
    """The factored step's entry table, or ``None`` when an entry fails its test (as
    :func:`_blocked_rows`)."""
    rows: list[int] = []
    try:
        for p, g, q, m, r, c in zip(params, grads, indices, magnitudes, row_factors, v_cols, strict=True):
            dtype = p.dtype
            code = _DTYPE_CODES[dtype]
            blocks, period = q.shape
            shape = p.shape
            height, width = shape
            if not (
                period >= 1
                and g.dtype is dtype
                and q.dtype is _U8
                and m.dtype is _F32
                and r.dtype is _F32
                and c.dtype is _F32
                and g.shape == shape
                and blocks * period == height * width
                and m.numel() == blocks
                and r.numel() == height
                and c.numel() == width
                and p.is_cpu
                and g.is_cpu
                and q.is_cpu
                and m.is_cpu
                and r.is_cpu
                and c.is_cpu
                and p.is_contiguous()
                and g.is_contiguous()
                and q.is_contiguous()
                and m.is_contiguous()
                and r.is_contiguous()
                and c.is_contiguous()
            ):
                return None
            rows += (
                code,
                blocks * period,
                p.data_ptr(),
                g.data_ptr(),
                q.data_ptr(),
                m.data_ptr(),
                r.data_ptr(),
                c.data_ptr(),
                blocks,
                period,
                width,
            )
    except _TEST_ERRORS:  # not a tensor, codes that are not 2-D, a dtype the kernels lack
        return None
    return _entries(rows)


def factored_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    row_factors: list[torch.Tensor],
    v_cols: list[torch.Tensor],
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seeds: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
    deterministic: bool,
) -> None:
    """``gefen::factored_step.v5`` on CPU: one C call for every entry."""
    args = (params, grads, indices, magnitudes, row_factors, v_cols, codebook, scalars, sr_seeds)
    flags = {"apply_decay": apply_decay, "maximize": maximize, "deterministic": deterministic}
    _check(arguments.check_step_head("gefen::factored_step.v5", *args, **flags))
    if not params:
        return
    _on_cpu(params[0])
    entries = _factored_rows(params, grads, indices, magnitudes, row_factors, v_cols)
    if entries is None:
        raise arguments.KernelArgumentError(arguments.check_factored_step(*args, **flags) or _OFF_CPU)
    status = _function("gefen_factored_step")(
        len(params),
        entries.buffer_info()[0],
        codebook.data_ptr(),
        *_list_scalars(scalars),
        _seed_pointer(sr_seeds),
        int(apply_decay),
        int(maximize),
        torch.get_num_threads(),
        _codebook_table(),
    )
    _checked("gefen_factored_step", status)
    increment_version([*params, *indices, *magnitudes])


def factored_stats(grads: list[torch.Tensor], *, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``gefen::factored_stats.v2`` on CPU: float64 row and column sums of ``g^2`` of every
    gradient, concatenated (one C call per gradient, each split over the threads).

    Rows are summed in 16 fixed chunks whose column partials are added in order, so the
    result does not depend on the thread count (always deterministic).
    """
    _check(arguments.check_factored_stats(grads, deterministic=deterministic))
    row_sums = torch.zeros(sum(grad.shape[0] for grad in grads), dtype=torch.float64)
    col_sums = torch.zeros(sum(grad.shape[1] for grad in grads), dtype=torch.float64)
    if not grads:
        return row_sums, col_sums
    _on_cpu(grads[0])
    stats = _function("gefen_factored_stats")
    row_at, col_at = row_sums.data_ptr(), col_sums.data_ptr()
    for grad in grads:
        rows, cols = grad.shape
        if grad.numel():
            chunks = min(_STATS_CHUNKS, rows)
            scratch = torch.empty(chunks * cols, dtype=torch.float64)
            status = stats(
                _DTYPE_CODES[grad.dtype],
                grad.data_ptr(),
                rows,
                cols,
                row_at,
                col_at,
                scratch.data_ptr(),
                chunks,
                torch.get_num_threads(),
            )
            _checked("gefen_factored_stats", status)
        row_at, col_at = row_at + 8 * rows, col_at + 8 * cols  # float64 runs, one per entry
    return row_sums, col_sums


def factored_moments(
    grads: list[torch.Tensor],
    v_rows: list[torch.Tensor],
    v_cols: list[torch.Tensor],
    scalars: torch.Tensor,
    *,
    deterministic: bool,
) -> torch.Tensor:
    """``gefen::factored_moments.v3`` on CPU: the statistics of :func:`factored_stats` and the
    ``v_row``/``v_col`` update of every entry in one C call; returns the entries' ``row_factor``
    concatenated (always deterministic)."""
    _check(arguments.check_factored_moments(grads, v_rows, v_cols, scalars, deterministic=deterministic))
    if not grads:
        return torch.empty(0, dtype=torch.float32)
    _on_cpu(grads[0])
    heights = [grad.shape[0] for grad in grads]
    flat = torch.empty(sum(heights), dtype=torch.float32)
    rows: list[int] = []
    offset = flat.data_ptr()
    for grad, v_row, v_col in zip(grads, v_rows, v_cols, strict=True):
        height, width = grad.shape
        rows += (
            _DTYPE_CODES[grad.dtype],
            height * width,
            grad.data_ptr(),
            height,
            width,
            v_row.data_ptr(),
            v_col.data_ptr(),
            offset,
        )
        offset += 4 * height  # fp32 row factors, one run per entry
    entries = _entries(rows)
    status = _function("gefen_factored_moments")(
        len(grads),
        entries.buffer_info()[0],
        *_list_scalars(scalars),
        _STATS_CHUNKS,
        torch.get_num_threads(),
    )
    _checked("gefen_factored_moments", status)
    increment_version([*v_rows, *v_cols])
    return flat


def histogram(grads: list[torch.Tensor], periods: list[int], counts: torch.Tensor, *, deterministic: bool) -> None:
    """``gefen::histogram.v2`` on CPU: adds every gradient's block-normalised bin counts to
    ``counts`` (one C call per gradient, each split over the threads)."""
    _check(arguments.check_histogram(grads, periods, counts, deterministic=deterministic))
    _on_cpu(counts)
    count = _function("gefen_histogram")
    for grad, period in zip(grads, periods, strict=True):
        if grad.numel():
            status = count(
                _DTYPE_CODES[grad.dtype],
                grad.data_ptr(),
                grad.numel(),
                period,
                counts.data_ptr(),
                torch.get_num_threads(),
            )
            _checked("gefen_histogram", status)
    increment_version(counts)


#: Why the C solve refused a histogram, by its status (the argument test catches the rest).
_SOLVE_ERRORS = {
    1: "counts must not be negative",
    2: "the histogram is empty",
    3: "the histogram's total is too large for exact int64 sums",
}


def codebook_solve(counts: torch.Tensor) -> torch.Tensor:
    """``gefen::codebook_solve.v2`` on CPU: the exact pinned k-means of ``counts``."""
    _check(arguments.check_codebook_solve(counts))
    out = torch.empty(CODEBOOK_SIZE, dtype=torch.float64)
    status = _function("gefen_codebook_solve")(counts.data_ptr(), counts.numel(), CODEBOOK_SIZE, out.data_ptr())
    if status == 4:
        raise MemoryError("gefen::codebook_solve.v2: out of memory")
    if status:
        raise arguments.KernelArgumentError(
            f"gefen::codebook_solve.v2: {_SOLVE_ERRORS.get(status, f'status {status}')}"
        )
    return out


def stochastic_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``gefen::stochastic_uniform.v1`` on CPU."""
    _check(arguments.check_stochastic_uniform(seed, index))
    _on_cpu(index)
    flat = index.contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32)
    if flat.numel():
        status = _function("gefen_stochastic_uniform")(
            seed.data_ptr(),
            flat.data_ptr(),
            out.data_ptr(),
            flat.numel(),
            torch.get_num_threads(),
        )
        _checked("gefen_stochastic_uniform", status)
    return out


def muon_momentum(
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seeds: torch.Tensor | None,
    outs: list[torch.Tensor],
    *,
    nesterov: bool,
    deterministic: bool,
) -> None:
    """``gefen::muon_momentum.v3`` on CPU: requantised momentum EMA of every entry, Newton-Schulz
    input in its ``out``; one C call for the list."""
    _check(
        arguments.check_muon_momentum(
            grads,
            indices,
            magnitudes,
            codebook,
            scalars,
            sr_seeds,
            outs,
            nesterov=nesterov,
            deterministic=deterministic,
        )
    )
    if not grads:
        return
    _on_cpu(grads[0])
    rows: list[int] = []
    for grad, codes, magnitude, out in zip(grads, indices, magnitudes, outs, strict=True):
        blocks, period = codes.shape
        rows += (
            _DTYPE_CODES[grad.dtype],
            blocks * period,
            grad.data_ptr(),
            codes.data_ptr(),
            magnitude.data_ptr(),
            out.data_ptr(),
            int(out.dtype is torch.bfloat16),
            blocks,
            period,
        )
    entries = _entries(rows)
    status = _function("gefen_muon_momentum")(
        len(grads),
        entries.buffer_info()[0],
        codebook.data_ptr(),
        *_list_scalars(scalars),
        _seed_pointer(sr_seeds),
        int(nesterov),
        torch.get_num_threads(),
        _codebook_table(),
    )
    _checked("gefen_muon_momentum", status)
    increment_version([*indices, *magnitudes, *outs])


def nearest_rounding_path(codebook: torch.Tensor) -> str:
    """How the CPU kernel rounds to the nearest codeword of ``codebook`` (fp32 ``[256]``).

    ``"thresholds"``: one fine-bucket load, one threshold compare and one codeword load per
    element, used when the codebook is sorted, spans ``[-1, 1]``, meets the reference's
    lookup precondition and has at most one decision threshold per 1/4096-wide bucket
    (every learned codebook); the table is verified against the reference rule when it is
    built. ``"bucket search"``: the reference's own bucket search, for any other codebook.
    Both give the reference's codes bit for bit.
    """
    if codebook.dtype is not torch.float32 or codebook.shape != (256,) or codebook.device.type != "cpu":
        raise arguments.KernelArgumentError(
            f"codebook must be a CPU float32 tensor of shape (256,), got {codebook.dtype} {tuple(codebook.shape)} "
            f"on {codebook.device}"
        )
    flat = codebook.contiguous()
    found = _function("gefen_uses_threshold_table")(flat.data_ptr(), _codebook_table())
    return "thresholds" if found == 1 else "bucket search"

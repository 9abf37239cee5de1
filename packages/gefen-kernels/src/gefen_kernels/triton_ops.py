"""Gefen's ops on CUDA tensors through the Triton kernels of :mod:`gefen_kernels.triton_kernels`.

Each function has its op's signature (``gefen_core.ops``), checks its arguments
(:mod:`gefen_kernels.arguments`), launches with ``enable_fp_fusion=False`` (no FMA
contraction) and bumps the autograd version counter of every tensor it wrote. The list ops
launch once per group of entries sharing a dtype and a tile, through a table of the entries'
addresses (:func:`_launch_list`), and once per entry under CUDA graph capture. Under
``TRITON_INTERPRET=1`` the same functions also accept CPU tensors, which is how the parity
tests run them on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton.language as tl  # type: ignore[import-untyped]
from gefen_contracts.torch_support import on_device
from torch.autograd.graph import increment_version

from . import arguments
from . import triton_elements as E
from . import triton_kernels as K
from . import triton_muon as M
from . import triton_statistics as S
from .triton_support import interpreting

__all__ = [
    "block_step",
    "element_step",
    "factored_moments",
    "factored_stats",
    "factored_step",
    "histogram",
    "muon_momentum",
    "stochastic_uniform",
]

#: Elements per program tile (ROWS x COLS).
_TILE = 1024
#: Row groups of the factored statistics (fixed per shape: the sum order never depends on the device).
_STATS_GROUPS = 64
_STATS_ROWS = 16
_STATS_COLS = 256
#: Elements per iteration of the one-program factored moments kernel.
_MOMENTS_BLOCK = 1024


def _next_pow2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _tile(blocks: int, period: int) -> tuple[int, int]:
    cols = min(_next_pow2(period), _TILE)
    rows = max(1, min(_next_pow2(blocks), _TILE // cols))
    return rows, cols


def _check(reason: str | None, *tensors: torch.Tensor) -> None:
    if reason is not None:
        raise arguments.KernelArgumentError(reason)
    for tensor in tensors:
        if tensor.device.type != "cuda" and not interpreting():
            raise arguments.KernelArgumentError(
                f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got one on {tensor.device}"
            )


def _scalars_of(scalars: torch.Tensor, index: int) -> torch.Tensor:
    return scalars[index] if scalars.dim() == 2 else scalars


def _seed_of(sr_seeds: torch.Tensor | None, index: int) -> torch.Tensor | None:
    return None if sr_seeds is None else sr_seeds[index : index + 1]


#: Parameter dtypes as the list kernel's pointers see them: bf16 through the uint16 pointer of its
#: bits (``triton_kernels._load_value``).
_POINTER_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.float64: tl.float64,
    torch.bfloat16: tl.uint16,
}


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``tensor``'s stream. A list launch reads its
    table from device memory copied from host memory, which a replayed graph would copy again
    from a buffer freed since; so a captured step launches once per entry (a graph replays
    launches at no host cost anyway)."""
    return tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch_list(
    kind: int,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    seconds: list[torch.Tensor],
    v_cols: list[torch.Tensor] | None,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seeds: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
) -> None:
    """One ``step_list_kernel`` launch per group of entries that share a dtype and a tile (and,
    factored, whether blocks lie in rows): a table of each entry's addresses and sizes, and the
    prefix sums of its programs."""
    groups: dict[tuple[torch.dtype, int, int, bool], list[int]] = {}
    for index, param in enumerate(params):
        if param.numel() == 0:
            continue
        blocks, period = indices[index].shape
        rows, cols = _tile(blocks, period)
        row_blocks = v_cols is not None and param.shape[1] % period == 0
        groups.setdefault((param.dtype, rows, cols, row_blocks), []).append(index)
    device = params[0].device
    scalar_row = 4 * (scalars.shape[1] if scalars.dim() == 2 else 0)  # bytes between entries' scalars
    for (dtype, rows, cols, row_blocks), members in groups.items():
        table: list[int] = []
        starts = [0]
        for index in members:
            param, codes, second = params[index], indices[index], seconds[index]
            blocks, period = codes.shape
            table += (
                param.data_ptr(),
                grads[index].data_ptr(),
                codes.data_ptr(),
                magnitudes[index].data_ptr(),
                second.data_ptr(),
                (second if v_cols is None else v_cols[index]).data_ptr(),
                scalars.data_ptr() + index * scalar_row,
                0 if sr_seeds is None else sr_seeds.data_ptr() + 8 * index,
                blocks,
                period,
                param.numel(),
                param.shape[1] if v_cols is not None else 0,
            )
            starts.append(starts[-1] + triton_cdiv(blocks, rows))
        K.step_list_kernel[(starts[-1],)](
            on_device(table, torch.int64, device),
            on_device(starts, torch.int64, device),
            len(members),
            codebook,
            -1.0 if maximize else 1.0,
            KIND=kind,
            P_DTYPE=_POINTER_DTYPES[dtype],
            ROWS=rows,
            COLS=cols,
            STOCHASTIC=sr_seeds is not None,
            APPLY_DECAY=apply_decay,
            F64=dtype is torch.float64,
            ROW_BLOCKS=row_blocks,
            SEARCH=len(members).bit_length(),
            enable_fp_fusion=False,
        )


def _blocked_step(op: str, path: int, check: Callable[..., str | None], *, per_element: bool) -> Callable[..., None]:
    """The Triton implementation of a blocked step op: ``block_step`` (one ``v`` mean per block
    in ``seconds``) or ``element_step`` (Adam's ``v`` per element). One launch per group of
    entries (:func:`_launch_list`), one per entry under CUDA graph capture; deterministic
    always (one program sums each block; the element path has no sum)."""

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
        _check(check(*args, **flags), *params[:1])
        if params and not _capturing(params[0]):
            _launch_list(
                path, params, grads, indices, magnitudes, seconds, None, codebook, scalars, sr_seeds,
                apply_decay=apply_decay, maximize=maximize,
            )  # fmt: skip
            increment_version([*params, *indices, *magnitudes, *seconds])
            return
        kernel = K.element_step_kernel if per_element else K.block_step_kernel
        for index, param in enumerate(params):
            if param.numel() == 0:
                continue
            blocks, period = indices[index].shape
            rows, cols = _tile(blocks, period)
            seed = _seed_of(sr_seeds, index)
            extent = () if per_element else (param.numel(),)  # a ragged last block ends there
            kernel[(triton_cdiv(blocks, rows),)](
                param, grads[index], indices[index], magnitudes[index], seconds[index], codebook,
                _scalars_of(scalars, index), seed, blocks, period, *extent, -1.0 if maximize else 1.0,
                ROWS=rows, COLS=cols, STOCHASTIC=seed is not None, APPLY_DECAY=apply_decay,
                F64=param.dtype is torch.float64, enable_fp_fusion=False,
            )  # fmt: skip
        increment_version([*params, *indices, *magnitudes, *seconds])

    step.__name__ = step.__qualname__ = op.split("::")[1].split(".", maxsplit=1)[0]
    step.__doc__ = f"``{op}`` with Triton (:func:`_blocked_step`)."
    return step


#: ``gefen::block_step.v4`` with Triton.
block_step = _blocked_step("gefen::block_step.v4", K.BLOCK_STEP.value, arguments.check_block_step, per_element=False)
#: ``gefen::element_step.v2`` with Triton.
element_step = _blocked_step(
    "gefen::element_step.v2", K.ELEMENT_STEP.value, arguments.check_element_step, per_element=True
)


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
    """``gefen::factored_step.v5`` with Triton (phase 2 of the factored update; per-element
    stepsizes in registers): one launch per group of entries (:func:`_launch_list`)."""
    args = (params, grads, indices, magnitudes, row_factors, v_cols, codebook, scalars, sr_seeds)
    flags = {"apply_decay": apply_decay, "maximize": maximize, "deterministic": deterministic}
    _check(arguments.check_factored_step(*args, **flags), *params[:1])
    if params and not _capturing(params[0]):
        _launch_list(
            K.FACTORED_STEP.value, params, grads, indices, magnitudes, row_factors, v_cols, codebook, scalars,
            sr_seeds, apply_decay=apply_decay, maximize=maximize,
        )  # fmt: skip
        increment_version([*params, *indices, *magnitudes])
        return
    for index, param in enumerate(params):
        if param.numel() == 0:
            continue
        blocks, period = indices[index].shape
        rows, cols = _tile(blocks, period)
        seed = _seed_of(sr_seeds, index)
        K.factored_step_kernel[(triton_cdiv(blocks, rows),)](
            param, grads[index], indices[index], magnitudes[index], row_factors[index], v_cols[index], codebook,
            _scalars_of(scalars, index), seed, blocks, period, param.shape[1], -1.0 if maximize else 1.0,
            ROWS=rows, COLS=cols, STOCHASTIC=seed is not None, APPLY_DECAY=apply_decay,
            F64=param.dtype is torch.float64, ROW_BLOCKS=param.shape[1] % period == 0, enable_fp_fusion=False,
        )  # fmt: skip
    increment_version([*params, *indices, *magnitudes])


def factored_stats(grads: list[torch.Tensor], *, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``gefen::factored_stats.v2`` with Triton (phase 1 of row-sharded matrices): float64 row and
    column sums of ``g^2`` of every gradient, concatenated. The partials of every matrix (one
    launch per dtype and column tile, :func:`_list_partials`), then one program per matrix adds
    them in a fixed order (one launch): deterministic. Per matrix under CUDA graph capture."""
    _check(arguments.check_factored_stats(grads, deterministic=deterministic), *grads[:1])
    if not grads:
        empty = torch.empty(0, dtype=torch.float64)
        return empty, empty.clone()
    device = grads[0].device
    row_sums = torch.zeros(sum(grad.shape[0] for grad in grads), dtype=torch.float64, device=device)
    col_sums = torch.zeros(sum(grad.shape[1] for grad in grads), dtype=torch.float64, device=device)
    if _capturing(grads[0]):
        for grad, row_out, col_out in zip(
            grads,
            torch.split(row_sums, [grad.shape[0] for grad in grads]),
            torch.split(col_sums, [grad.shape[1] for grad in grads]),
            strict=True,
        ):
            row_part, col_part = _stats(grad)
            row_out.copy_(row_part)
            col_out.copy_(col_part)
        return row_sums, col_sums
    shapes, _partials, offsets = _list_partials(grads)  # kept alive until its reader is queued
    table: list[int] = []
    row_at, col_at = row_sums.data_ptr(), col_sums.data_ptr()
    for grad, (groups, _, _, tiles), offset in zip(grads, shapes, offsets, strict=True):
        rows, cols = grad.shape
        table += (offset, offset + 8 * tiles * rows, row_at, col_at, tiles, groups, rows, cols)
        row_at, col_at = row_at + 8 * rows, col_at + 8 * cols
    S.sums_list_kernel[(len(grads),)](
        on_device(table, torch.int64, device), BLOCK=_MOMENTS_BLOCK, enable_fp_fusion=False
    )
    return row_sums, col_sums


def _stats(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    row_part, col_part = _stats_partials(grad)
    return row_part.sum(dim=0), col_part.sum(dim=0)


def _stats_shape(rows: int, cols: int) -> tuple[int, int, int, int]:
    """The statistics' row groups, rows per group, column tile and column tiles of a matrix."""
    groups = min(_STATS_GROUPS, triton_cdiv(rows, _STATS_ROWS))
    col_tile = min(_next_pow2(cols), _STATS_COLS)
    return groups, triton_cdiv(rows, groups), col_tile, triton_cdiv(cols, col_tile)


def _stats_partials(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix's float64 partials ``[tiles, rows]`` and ``[groups, cols]`` (zero rows when empty)."""
    rows, cols = grad.shape
    if grad.numel() == 0:
        empty = torch.zeros((0,), dtype=torch.float64, device=grad.device)
        return empty.view(0, rows), empty.view(0, cols)
    groups, per_group, col_tile, tiles = _stats_shape(rows, cols)
    row_part = torch.empty((tiles, rows), dtype=torch.float64, device=grad.device)
    col_part = torch.empty((groups, cols), dtype=torch.float64, device=grad.device)
    S.factored_stats_kernel[(groups, tiles)](
        grad, row_part, col_part, rows, cols, per_group, RB=_STATS_ROWS, CT=col_tile, enable_fp_fusion=False
    )
    return row_part, col_part


def _list_partials(
    grads: list[torch.Tensor],
) -> tuple[list[tuple[int, int, int, int]], torch.Tensor, list[int]]:
    """The statistics' partials of every matrix in one float64 buffer (``stats_list_kernel``, one
    launch per dtype and column tile): each matrix's shape (:func:`_stats_shape`), the buffer
    (keep it alive until its readers are launched) and the address of each matrix's row
    partials ``[tiles, rows]``, its column partials ``[groups, cols]`` following them."""
    shapes = [_stats_shape(*grad.shape) if grad.numel() else (0, 0, 1, 0) for grad in grads]
    sizes = [tiles * grad.shape[0] + groups * grad.shape[1] for grad, (groups, _, _, tiles) in zip(grads, shapes)]
    device = grads[0].device
    partials = torch.empty(max(1, sum(sizes)), dtype=torch.float64, device=device)
    stats: dict[tuple[torch.dtype, int], tuple[list[int], list[int]]] = {}
    offsets: list[int] = []
    offset = partials.data_ptr()
    for grad, (groups, per_group, col_tile, tiles), size in zip(grads, shapes, sizes, strict=True):
        rows, cols = grad.shape
        offsets.append(offset)
        if grad.numel():
            table, starts = stats.setdefault((grad.dtype, col_tile), ([], [0]))
            table += (grad.data_ptr(), offset, offset + 8 * tiles * rows, rows, cols, per_group, tiles)
            starts.append(starts[-1] + groups * tiles)
        offset += 8 * size
    for (dtype, col_tile), (table, starts) in stats.items():
        S.stats_list_kernel[(starts[-1],)](
            on_device(table, torch.int64, device), on_device(starts, torch.int64, device), len(starts) - 1,
            G_DTYPE=_POINTER_DTYPES[dtype], RB=_STATS_ROWS, CT=col_tile, SEARCH=(len(starts) - 1).bit_length(),
            enable_fp_fusion=False,
        )  # fmt: skip
    return shapes, partials, offsets


def factored_moments(
    grads: list[torch.Tensor],
    v_rows: list[torch.Tensor],
    v_cols: list[torch.Tensor],
    scalars: torch.Tensor,
    *,
    deterministic: bool,
) -> torch.Tensor:
    """``gefen::factored_moments.v3`` with Triton: the statistics' partials of every matrix (one
    launch per dtype and column tile), then one program per matrix adds them in a fixed order,
    updates ``v_row``/``v_col`` and writes its ``row_factor`` into the concatenated result (one
    launch); per matrix under CUDA graph capture (see :func:`_capturing`). Deterministic."""
    _check(arguments.check_factored_moments(grads, v_rows, v_cols, scalars, deterministic=deterministic), *grads[:1])
    if not grads:
        return torch.empty(0, dtype=torch.float32)
    device = grads[0].device
    flat = torch.empty(sum(grad.shape[0] for grad in grads), dtype=torch.float32, device=device)
    scalar_row = 4 * (scalars.shape[1] if scalars.dim() == 2 else 0)  # bytes between entries' scalars
    if _capturing(grads[0]):
        start = 0
        for index, grad in enumerate(grads):
            rows, cols = grad.shape
            row_part, col_part = _stats_partials(grad)
            S.factored_moments_kernel[(1,)](
                row_part, col_part, row_part.shape[0], col_part.shape[0], v_rows[index], v_cols[index],
                _scalars_of(scalars, index), flat[start : start + rows], rows, cols,
                BLOCK=_MOMENTS_BLOCK, enable_fp_fusion=False,
            )  # fmt: skip
            start += rows
        increment_version([*v_rows, *v_cols])
        return flat
    shapes, _partials, offsets = _list_partials(grads)  # kept alive until its reader is queued
    moments: list[int] = []
    start = 0
    for index, grad in enumerate(grads):
        (rows, cols), (groups, _, _, tiles), row_at = grad.shape, shapes[index], offsets[index]
        moments += (
            row_at,
            row_at + 8 * tiles * rows,
            v_rows[index].data_ptr(),
            v_cols[index].data_ptr(),
            scalars.data_ptr() + index * scalar_row,
            flat.data_ptr() + 4 * start,
            tiles,
            groups,
            rows,
            cols,
        )
        start += rows
    S.moments_list_kernel[(len(grads),)](
        on_device(moments, torch.int64, device), BLOCK=_MOMENTS_BLOCK, enable_fp_fusion=False
    )
    increment_version([*v_rows, *v_cols])
    return flat


def histogram(grads: list[torch.Tensor], periods: list[int], counts: torch.Tensor, *, deterministic: bool) -> None:
    """``gefen::histogram.v2`` with Triton (integer atomics: the counts are exact in any order):
    one launch per group of gradients sharing a dtype and a tile (per gradient under CUDA graph
    capture, see :func:`_capturing`)."""
    _check(arguments.check_histogram(grads, periods, counts, deterministic=deterministic), counts)
    groups: dict[tuple[torch.dtype, int, int], list[tuple[torch.Tensor, int, int]]] = {}
    for grad, period in zip(grads, periods, strict=True):
        if grad.numel():
            # a period beyond the gradient is one (ragged) block of it: the kernel's column
            # loops run to the period, masked past the end (2**30 empty passes for 2**40)
            period = min(period, grad.numel())
            blocks = triton_cdiv(grad.numel(), period)  # the last block may be ragged
            rows, cols = _tile(blocks, period)
            groups.setdefault((grad.dtype, rows, cols), []).append((grad, blocks, period))
    for (dtype, rows, cols), members in groups.items():
        if _capturing(counts):
            for grad, blocks, period in members:
                S.histogram_kernel[(triton_cdiv(blocks, rows),)](
                    grad, counts, blocks, period, grad.numel(), ROWS=rows, COLS=cols, enable_fp_fusion=False
                )
            continue
        table: list[int] = []
        starts = [0]
        for grad, blocks, period in members:
            table += (grad.data_ptr(), blocks, period, grad.numel())
            starts.append(starts[-1] + triton_cdiv(blocks, rows))
        S.histogram_list_kernel[(starts[-1],)](
            on_device(table, torch.int64, counts.device), on_device(starts, torch.int64, counts.device),
            len(members), counts, G_DTYPE=_POINTER_DTYPES[dtype], ROWS=rows, COLS=cols,
            SEARCH=len(members).bit_length(), enable_fp_fusion=False,
        )  # fmt: skip
    increment_version(counts)


def stochastic_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``gefen::stochastic_uniform.v1`` with Triton."""
    _check(arguments.check_stochastic_uniform(seed, index), index)
    flat = index.contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    if flat.numel():
        block = 1024
        E.uniform_kernel[(triton_cdiv(flat.numel(), block),)](seed, flat, out, flat.numel(), BLOCK=block)
    return out


def _launch_muon_list(
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seeds: torch.Tensor | None,
    outs: list[torch.Tensor],
    *,
    nesterov: bool,
) -> None:
    """One ``muon_list_kernel`` launch per group of matrices sharing a dtype, an output dtype
    and a tile (as :func:`_launch_list`)."""
    groups: dict[tuple[torch.dtype, bool, int, int], list[int]] = {}
    for index, grad in enumerate(grads):
        if grad.numel():
            rows, cols = _tile(*indices[index].shape)
            groups.setdefault((grad.dtype, outs[index].dtype is torch.bfloat16, rows, cols), []).append(index)
    device = grads[0].device
    scalar_row = 4 * (scalars.shape[1] if scalars.dim() == 2 else 0)  # bytes between entries' scalars
    for (dtype, out_bf16, rows, cols), members in groups.items():
        table: list[int] = []
        starts = [0]
        for index in members:
            blocks, period = indices[index].shape
            table += (
                grads[index].data_ptr(),
                indices[index].data_ptr(),
                magnitudes[index].data_ptr(),
                outs[index].data_ptr(),
                scalars.data_ptr() + index * scalar_row,
                0 if sr_seeds is None else sr_seeds.data_ptr() + 8 * index,
                blocks,
                period,
            )
            starts.append(starts[-1] + triton_cdiv(blocks, rows))
        M.muon_list_kernel[(starts[-1],)](
            on_device(table, torch.int64, device), on_device(starts, torch.int64, device), len(members), codebook,
            G_DTYPE=_POINTER_DTYPES[dtype], ROWS=rows, COLS=cols, STOCHASTIC=sr_seeds is not None,
            NESTEROV=nesterov, OUT_BF16=out_bf16, SEARCH=len(members).bit_length(), enable_fp_fusion=False,
        )  # fmt: skip


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
    """``gefen::muon_momentum.v3`` with Triton: per entry, one pass requantises and writes the
    Newton-Schulz input; one launch per group of entries sharing a dtype, an output dtype and a
    tile (per entry under CUDA graph capture, see :func:`_capturing`)."""
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
        ),
        *grads[:1],
    )
    if grads and not _capturing(grads[0]):
        _launch_muon_list(grads, indices, magnitudes, codebook, scalars, sr_seeds, outs, nesterov=nesterov)
        increment_version([*indices, *magnitudes, *outs])
        return
    for index, grad in enumerate(grads):
        if grad.numel() == 0:
            continue
        blocks, period = indices[index].shape
        rows, cols = _tile(blocks, period)
        seed = _seed_of(sr_seeds, index)
        M.muon_momentum_kernel[(triton_cdiv(blocks, rows),)](
            grad,
            indices[index],
            magnitudes[index],
            codebook,
            _scalars_of(scalars, index),
            seed,
            outs[index],
            blocks,
            period,
            ROWS=rows,
            COLS=cols,
            STOCHASTIC=seed is not None,
            NESTEROV=nesterov,
            OUT_BF16=outs[index].dtype is torch.bfloat16,
            enable_fp_fusion=False,
        )
    increment_version([*indices, *magnitudes, *outs])


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

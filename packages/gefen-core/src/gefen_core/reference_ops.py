"""Reference implementations of Gefen's kernel ops (plain PyTorch, fp32, chunked).

Every fast kernel is tested against these. The numerics contract they define, with
``fl(.)`` one rounding to fp32 (round to nearest even), no fused multiply-add, divisions
and square roots correctly rounded, and ``S`` the float64 ``scalars`` of
:mod:`gefen_core.step_scalars` rounded to fp32:

Second moment, block path (per block ``b`` of ``P`` elements)::

    mean_b = fl( (sum_i float64(g_i)^2) / P )        # float64 sum, any order
    v_b    = fl( fl(v_b * BETA2) + fl(mean_b * ONE_MINUS_BETA2) )
    h_i    = fl( fl( fl(sqrt(v_b)) * BC2 ) + EPS )   # every element i of block b

Second moment, factored path (``R x K`` matrix): :func:`factored_stats_tensor` returns
float64 row and column sums of ``g^2``; :mod:`gefen_core.second_moment` turns them into
``v_row``, ``v_col`` and the fp32 ``row_factor``; the square roots are taken per row and per
column, then per element::

    a_i = fl(sqrt(row_factor_i)) ;  b_j = fl(sqrt(v_col_j))
    h_ij = fl( fl(a_i * b_j) + EPS )

(``sqrt(r c) = sqrt(r) sqrt(c)`` in exact arithmetic; taking the roots of the factors costs
``R + K`` square roots instead of ``R K``, and ``a_i * b_j`` neither underflows nor overflows
where ``r c`` would.)

Second moment, element path (matrices too narrow to factor; Adam's ``v``, updated inside
:func:`element_step_tensor` so one op call does the whole step)::

    v_i = fl( fl(v_i * BETA2) + fl( fl(g_i * g_i) * ONE_MINUS_BETA2 ) )
    h_i = fl( fl(sqrt( fl(v_i * BC2) )) + EPS )

Momentum and write (both paths; ``C`` the codebook, ``q``/``M`` the stored indices and
block scale, ``g`` negated first when maximizing). The codes hold the EMA of the
*preconditioned* gradient ``g / h`` (LaProp's order of momentum and preconditioning), so every
element is rounded at the resolution of its own update; ``gefen::block_step.v1`` and
``gefen::factored_step.v2`` stored the EMA of ``g`` and divided after decoding::

    n_i  = fl(g_i / h_i)
    m_i  = fl(C[q_i] * M_b)
    u_i  = fl( fl(m_i * BETA1) + fl(n_i * ONE_MINUS_BETA1) )
    M_b' = max_i |u_i| ;  z_i = fl(u_i / M_b')  (0 when M_b' == 0) ;  q_i' = round(C, z_i)
    q_i' = q_i' - sign(C[q_i'])    # nearest rounding only, when g_i == 0, C[q_i'] != 0 and
                                   # |fl(C[q_i'] * M_b')| >= |m_i| > 0 (see requantized_momentum)
    d_i  = fl( fl( fl(C[q_i'] * M_b') * INV_BC1 ) * LR )
    p_i  = rp( c(p_i) * DECAY )      # only when weight_decay != 0
    p_i  = rp( c(p_i) - d_i )

``c`` is the parameter's compute type (fp32; fp64 for fp64 parameters, with fp32 values
widened exactly) and ``rp`` rounds to the parameter dtype (bf16/fp16 parameters are
rounded twice, as two separate in-place torch ops would). ``round`` is nearest or
stochastic rounding (:mod:`gefen_core.momentum_codec`). A kernel matching this contract
matches the reference bit for bit except where a float64 sum of squares rounds to fp32
differently because of summation order (at most one ulp in ``v``, very rarely).

GefenMuon's momentum op has its reference in :mod:`gefen_core.muon_reference_ops`.

Work is chunked in whole blocks (about ``2**22`` elements per chunk), so no full-size
temporary is made.
"""

from __future__ import annotations

import torch

from . import step_scalars as S
from .momentum_codec import dequantize, nearest_codeword, normalize_blocks, splitmix_uniform, stochastic_codeword
from .second_moment import fp32_sqrt as _sqrt
from .second_moment import update_factored_moments

__all__ = [
    "CHUNK_ELEMENTS",
    "HISTOGRAM_BINS",
    "block_step_reference",
    "block_step_tensor",
    "element_step_reference",
    "element_step_tensor",
    "factored_moments_reference",
    "factored_moments_tensor",
    "factored_stats_reference",
    "factored_stats_tensor",
    "factored_step_reference",
    "factored_step_tensor",
    "histogram_reference",
    "histogram_tensor",
    "requantized_momentum",
    "scalars_of",
    "stochastic_uniform_reference",
]

CHUNK_ELEMENTS = 1 << 22
HISTOGRAM_BINS = 4096


def _divide(total: torch.Tensor, count: int) -> torch.Tensor:
    """Correctly rounded float64 division by an integer (never a reciprocal multiply)."""
    return total / torch.full((1,), float(count), dtype=torch.float64, device=total.device)


def _chunk_rows(period: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, period))


def requantized_momentum(
    grad: torch.Tensor,
    denominator: torch.Tensor | None,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    codebook: torch.Tensor,
    beta1: torch.Tensor,
    one_minus_beta1: torch.Tensor,
    sr_seed: torch.Tensor | None,
    first_index: int,
) -> torch.Tensor:
    """One momentum EMA step on quantized state, in place; returns the new decoded momentum.

    ``grad`` fp32 ``[rows, P]`` (already negated when maximizing), divided by ``denominator``
    when one is given (Gefen's preconditioning; ``n = fl(g / h)``); ``indices`` uint8 and
    ``magnitude`` fp32 ``[rows, 1]`` are replaced by the requantized EMA
    ``u = fl(fl(C[q] * M * beta1) + fl(n * (1 - beta1)))``; the return value is
    ``C[q'] * M'`` (fp32), the momentum the update applies. ``first_index`` numbers the
    chunk's first element within its parameter (for stochastic rounding). Optimizers built
    on Gefen's momentum (GefenMuon) reuse this.

    Nearest rounding settles an element whose gradient is zero: when its new code is not zero
    and decodes to no less magnitude than its old, non-zero momentum (``|C[q'] M'| >= |C[q] M|
    > 0``: the momentum failed to decay), the code moves one place towards zero. Without this,
    a block that keeps training (its scale ``M`` steady) rounds ``0.9 C[q]`` back to ``C[q]``
    wherever the codewords are further apart than a tenth of ``C[q]``, and the element's
    parameter moves by the same amount at every step, forever. A block whose gradients are all zero decays through
    its scale alone (``M' = fl(beta1 M)``, codes kept), so the rule leaves it be. Stochastic
    rounding decays in expectation and is left as it is.
    """
    old = dequantize(codebook, indices, magnitude)
    momentum = old * beta1 + (grad if denominator is None else grad / denominator) * one_minus_beta1
    new_magnitude, z = normalize_blocks(momentum)
    if sr_seed is None:
        codes = nearest_codeword(codebook, z)
        still = grad == 0
        if grad.device.type != "cpu" or bool(still.any()):  # (no host sync on a device: a graph may be capturing)
            codes = _settled(codebook, codes, new_magnitude, old, still)
    else:
        codes = stochastic_codeword(codebook, z, sr_seed, first_index)
    indices.copy_(codes)
    magnitude.copy_(new_magnitude)
    return dequantize(codebook, codes, new_magnitude)


def _settled(
    codebook: torch.Tensor, codes: torch.Tensor, magnitude: torch.Tensor, old: torch.Tensor, still: torch.Tensor
) -> torch.Tensor:
    """``codes`` with nearest rounding's settling applied where ``still`` (a zero gradient): one
    code towards zero where the new momentum ``fl(C[q'] M')`` is no smaller than the old, non-zero
    ``old`` (:func:`requantized_momentum`; ``C[q'] != 0`` follows, and its sign is the value's)."""
    value = dequantize(codebook, codes, magnitude)
    stuck = still & (old != 0) & (value.abs() >= old.abs())
    towards_zero = stuck.to(torch.int16) * torch.sign(value).to(torch.int16)
    return (codes.to(torch.int16) - towards_zero).to(torch.uint8)


def _momentum_write(
    param: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    codebook: torch.Tensor,
    denominator: torch.Tensor,
    scalars: torch.Tensor,
    sr_seed: torch.Tensor | None,
    first_index: int,
    apply_decay: bool,
) -> None:
    """Momentum EMA of the preconditioned gradient ``grad / denominator``, requantisation and the
    parameter write for one chunk of rows."""
    momentum = requantized_momentum(
        grad,
        denominator,
        indices,
        magnitude,
        codebook,
        scalars[S.BETA1],
        scalars[S.ONE_MINUS_BETA1],
        sr_seed,
        first_index,
    )
    update = momentum * scalars[S.INV_BC1] * scalars[S.LR]
    if apply_decay:
        param.mul_(scalars[S.DECAY])
    param.sub_(update)


def _gradient_rows(grad: torch.Tensor, maximize: bool) -> torch.Tensor:
    rows = grad.to(torch.float32)
    return rows.neg() if maximize else rows


def block_step_tensor(
    param: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    vmean: torch.Tensor,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seed: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
    deterministic: bool,
) -> None:
    """One full block-path update of one parameter, in place (one tensor of ``gefen::block_step.v4``).

    ``param``/``grad``: contiguous, same shape and dtype (``n`` elements); ``indices``: uint8
    ``[B, P]`` with ``B = ceil(n / P)`` (a ragged last block holds ``n - (B - 1) P`` elements:
    it is a block of that length, and its row's remaining codes are padding, never touched);
    ``magnitude``/``vmean``: fp32 ``[B, 1]``; ``codebook``: fp32 ``[256]``; ``scalars``:
    fp32 ``[NUM_SCALARS]``; ``sr_seed``: int64 ``[1]`` for stochastic rounding or ``None``.
    Updates ``param``, ``indices``, ``magnitude`` and ``vmean``.
    """
    del deterministic  # the reference is deterministic on every device
    blocks, period = indices.shape
    numel = param.numel()
    whole = min(blocks, numel // period)
    p_flat, g_flat = param.view(-1), grad.view(-1)
    rows = _chunk_rows(period)
    for first in range(0, whole, rows):
        last = min(whole, first + rows)
        span = slice(first * period, last * period)
        _block_rows(
            p_flat[span].view(-1, period),
            g_flat[span].view(-1, period),
            slice(first, last),
            indices[first:last],
            magnitude,
            vmean,
            codebook,
            scalars,
            sr_seed,
            first * period,
            maximize,
            apply_decay,
        )
    if whole < blocks:  # the ragged last block: a block of its own length
        tail = numel - whole * period
        span = slice(whole * period, numel)
        _block_rows(
            p_flat[span].view(1, tail),
            g_flat[span].view(1, tail),
            slice(whole, blocks),
            indices[whole:, :tail],
            magnitude,
            vmean,
            codebook,
            scalars,
            sr_seed,
            whole * period,
            maximize,
            apply_decay,
        )


def _block_rows(
    param: torch.Tensor,
    grad: torch.Tensor,
    blocks: slice,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    vmean: torch.Tensor,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seed: torch.Tensor | None,
    first_element: int,
    maximize: bool,
    apply_decay: bool,
) -> None:
    """The block step of the ``blocks`` rows ``[rows, L]`` of one parameter (``L`` elements a
    block), the first of them at flat element ``first_element``."""
    g = _gradient_rows(grad, maximize)
    mean = _divide(g.to(torch.float64).square().sum(dim=1, keepdim=True), g.shape[1]).to(torch.float32)
    v = vmean[blocks] * scalars[S.BETA2] + mean * scalars[S.ONE_MINUS_BETA2]
    vmean[blocks] = v
    _momentum_write(
        param,
        g,
        indices,
        magnitude[blocks],
        codebook,
        _sqrt(v) * scalars[S.BC2] + scalars[S.EPS],
        scalars,
        sr_seed,
        first_element,
        apply_decay,
    )


def factored_stats_tensor(grad: torch.Tensor, *, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor of ``gefen::factored_stats.v2``: float64 row and column sums of ``g^2`` of an ``R x K`` gradient."""
    del deterministic
    rows_total, cols = grad.shape
    row_sums = torch.empty(rows_total, dtype=torch.float64, device=grad.device)
    col_sums = torch.zeros(cols, dtype=torch.float64, device=grad.device)
    rows = _chunk_rows(cols)
    for first in range(0, rows_total, rows):
        last = min(rows_total, first + rows)
        squares = grad[first:last].to(torch.float64).square()
        row_sums[first:last] = squares.sum(dim=1)
        col_sums += squares.sum(dim=0)
    return row_sums, col_sums


def factored_stats_reference(grads: list[torch.Tensor], *, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``gefen::factored_stats.v2``: :func:`factored_stats_tensor` of each gradient, the row sums
    of every entry concatenated (float64 ``[sum R]``) and the column sums likewise (``[sum K]``)."""
    sums = [factored_stats_tensor(grad, deterministic=deterministic) for grad in grads]
    if not sums:
        empty = torch.empty(0, dtype=torch.float64)
        return empty, empty.clone()
    return torch.cat([rows for rows, _ in sums]), torch.cat([cols for _, cols in sums])


def factored_moments_tensor(
    grad: torch.Tensor, v_row: torch.Tensor, v_col: torch.Tensor, scalars: torch.Tensor, *, deterministic: bool
) -> torch.Tensor:
    """One tensor of ``gefen::factored_moments.v3``: :func:`factored_stats_tensor` of a whole (not row-sharded)
    ``R x K`` gradient, then :func:`gefen_core.second_moment.update_factored_moments` with
    ``R`` global rows: advances ``v_row``/``v_col`` in place and returns the fp32 ``row_factor``.
    One call where a kernel can do both (a row-sharded parameter takes the two steps apart,
    for the column all-reduce between them)."""
    row_sums, col_sums = factored_stats_tensor(grad, deterministic=deterministic)
    return update_factored_moments(v_row, v_col, row_sums, col_sums, grad.shape[0], scalars)


def factored_step_tensor(
    param: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    row_factor: torch.Tensor,
    v_col: torch.Tensor,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seed: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
    deterministic: bool,
) -> None:
    """The factored-path update of one ``R x K`` parameter, in place (one tensor of ``gefen::factored_step.v5``).

    ``param``/``grad``: contiguous ``R x K``; ``indices``/``magnitude``: the momentum in
    blocks of the parameter's period (flattened row-major); ``row_factor``: fp32 ``[R]``
    from :func:`gefen_core.second_moment.update_factored_moments`; ``v_col``: fp32 ``[K]``.
    Updates ``param``, ``indices`` and ``magnitude``.
    """
    del deterministic
    cols = param.shape[1]
    blocks, period = indices.shape
    p_flat = param.view(-1)
    g_flat = grad.view(-1)
    per_chunk = _chunk_rows(period)
    row_roots, col_roots = _sqrt(row_factor), _sqrt(v_col)
    for first in range(0, blocks, per_chunk):
        last = min(blocks, first + per_chunk)
        start, stop = first * period, last * period
        row0, row1 = start // cols, (stop - 1) // cols + 1
        denominator_rows = row_roots[row0:row1, None] * col_roots[None, :] + scalars[S.EPS]
        denominator = denominator_rows.view(-1)[start - row0 * cols : stop - row0 * cols].view(-1, period)
        g = _gradient_rows(g_flat[start:stop].view(-1, period), maximize)
        _momentum_write(
            p_flat[start:stop].view(-1, period),
            g,
            indices[first:last],
            magnitude[first:last],
            codebook,
            denominator,
            scalars,
            sr_seed,
            start,
            apply_decay,
        )


def element_step_tensor(
    param: torch.Tensor,
    grad: torch.Tensor,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seed: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
    deterministic: bool,
) -> None:
    """The element-path update of one parameter, in place (one tensor of ``gefen::element_step.v2``).

    ``param``/``grad``: contiguous, of equal shape; ``indices``/``magnitude``: the momentum in
    blocks that tile the parameter (flattened row-major); ``v``: fp32 of the parameter's shape,
    Adam's per-element second moment. Per element (module docstring for the momentum and write)::

        v_i  = fl( fl(v_i * BETA2) + fl( fl(g_i * g_i) * ONE_MINUS_BETA2 ) )
        h_i  = fl( fl(sqrt( fl(v_i * BC2) )) + EPS )

    which is the factored path's ``h`` of the matrix seen as one column with ``v_col = [1]``
    (``BC2 = 1 / (1 - beta2^tau)``, as the factored path's). Updates ``param``, ``indices``,
    ``magnitude`` and ``v``.
    """
    del deterministic
    blocks, period = indices.shape
    p_flat, g_flat, v_flat = param.view(-1), grad.view(-1), v.view(-1)
    per_chunk = _chunk_rows(period)
    for first in range(0, blocks, per_chunk):
        last = min(blocks, first + per_chunk)
        start, stop = first * period, last * period
        g = g_flat[start:stop].view(-1, period).to(torch.float32)
        chunk = v_flat[start:stop].view(-1, period)
        chunk.mul_(scalars[S.BETA2]).add_((g * g).mul_(scalars[S.ONE_MINUS_BETA2]))
        denominator = _sqrt(chunk * scalars[S.BC2]).add_(scalars[S.EPS])
        _momentum_write(
            p_flat[start:stop].view(-1, period),
            g.neg() if maximize else g,
            indices[first:last],
            magnitude[first:last],
            codebook,
            denominator,
            scalars,
            sr_seed,
            start,
            apply_decay,
        )


def scalars_of(scalars: torch.Tensor, index: int) -> torch.Tensor:
    """Tensor ``index``'s step scalars in a list op: the shared ``[NUM_SCALARS]`` packet, or row
    ``index`` of an ``[N, NUM_SCALARS]`` one (parameters whose counters differ)."""
    return scalars[index] if scalars.dim() == 2 else scalars


def _seed_of(sr_seeds: torch.Tensor | None, index: int) -> torch.Tensor | None:
    return None if sr_seeds is None else sr_seeds[index : index + 1]


def block_step_reference(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    vmeans: list[torch.Tensor],
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seeds: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
    deterministic: bool,
) -> None:
    """``gefen::block_step.v4``: :func:`block_step_tensor` of each parameter of the lists.

    ``scalars`` is shared (``[NUM_SCALARS]``) or per tensor (``[N, NUM_SCALARS]``);
    ``sr_seeds`` is int64 ``[N]`` (one stochastic-rounding seed per tensor) or ``None``.
    """
    for index, param in enumerate(params):
        block_step_tensor(
            param.view(-1), grads[index].view(-1), indices[index], magnitudes[index], vmeans[index], codebook,
            scalars_of(scalars, index), _seed_of(sr_seeds, index),
            apply_decay=apply_decay, maximize=maximize, deterministic=deterministic,
        )  # fmt: skip


def factored_moments_reference(
    grads: list[torch.Tensor],
    v_rows: list[torch.Tensor],
    v_cols: list[torch.Tensor],
    scalars: torch.Tensor,
    *,
    deterministic: bool,
) -> torch.Tensor:
    """``gefen::factored_moments.v3``: :func:`factored_moments_tensor` of each gradient; returns
    their ``row_factor`` concatenated (``scalars`` as in :func:`block_step_reference`). One
    fresh tensor, not a list: AOT autograd cannot functionalise a ``Tensor[]`` result."""
    factors = [
        factored_moments_tensor(
            grad, v_rows[index], v_cols[index], scalars_of(scalars, index), deterministic=deterministic
        )
        for index, grad in enumerate(grads)
    ]
    return torch.cat(factors) if factors else torch.empty(0, dtype=torch.float32)


def factored_step_reference(
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
    """``gefen::factored_step.v5``: :func:`factored_step_tensor` of each parameter of the lists
    (``scalars`` and ``sr_seeds`` as in :func:`block_step_reference`)."""
    for index, param in enumerate(params):
        factored_step_tensor(
            param, grads[index], indices[index], magnitudes[index], row_factors[index], v_cols[index], codebook,
            scalars_of(scalars, index), _seed_of(sr_seeds, index),
            apply_decay=apply_decay, maximize=maximize, deterministic=deterministic,
        )  # fmt: skip


def element_step_reference(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    indices: list[torch.Tensor],
    magnitudes: list[torch.Tensor],
    vs: list[torch.Tensor],
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seeds: torch.Tensor | None,
    *,
    apply_decay: bool,
    maximize: bool,
    deterministic: bool,
) -> None:
    """``gefen::element_step.v2``: :func:`element_step_tensor` of each parameter of the lists
    (``scalars`` and ``sr_seeds`` as in :func:`block_step_reference`)."""
    for index, param in enumerate(params):
        element_step_tensor(
            param, grads[index], indices[index], magnitudes[index], vs[index], codebook,
            scalars_of(scalars, index), _seed_of(sr_seeds, index),
            apply_decay=apply_decay, maximize=maximize, deterministic=deterministic,
        )  # fmt: skip


def histogram_reference(
    grads: list[torch.Tensor], periods: list[int], counts: torch.Tensor, *, deterministic: bool
) -> None:
    """``gefen::histogram.v2``: :func:`histogram_tensor` of each gradient (with its period) into ``counts``."""
    for grad, period in zip(grads, periods, strict=True):
        histogram_tensor(grad, period, counts, deterministic=deterministic)


def histogram_tensor(grad: torch.Tensor, period: int, counts: torch.Tensor, *, deterministic: bool) -> None:
    """One gradient of ``gefen::histogram.v2``: add its block-normalised bin counts to ``counts``.

    ``counts`` is int64 ``[4096]``. Per block of ``period`` elements (flattened row-major; the
    last block is shorter when ``period`` does not divide the size):
    ``a = max |g|``, ``z = fl(g / a)`` (0 when ``a == 0``), bin
    ``clamp(floor(fl(z + 1) * 2048), 0, 4095)``.
    """
    del deterministic
    flat = grad.detach().reshape(-1)
    numel = flat.numel()
    rows = _chunk_rows(period)
    for first in range(0, numel, rows * period):
        g = flat[first : first + rows * period].to(torch.float32)
        whole = g.numel() // period * period
        for part in (g[:whole].view(-1, period), g[whole:].view(1, -1)):  # a ragged last block: its own length
            if part.numel():
                _, z = normalize_blocks(part)
                bins = ((z + 1.0) * float(HISTOGRAM_BINS // 2)).floor_().clamp_(0, HISTOGRAM_BINS - 1)
                counts += torch.bincount(bins.to(torch.int64).view(-1), minlength=HISTOGRAM_BINS)


def stochastic_uniform_reference(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``gefen::stochastic_uniform.v1``: the SplitMix64 uniforms for int64 ``index`` (fp32),
    shaped like ``index`` and contiguous, as the fake and the kernels (a 0-d index too)."""
    return splitmix_uniform(seed.reshape(()), index.contiguous())

"""The reference of GefenMuon's op, ``gefen::muon_momentum.v3`` (plain PyTorch, fp32,
chunked in whole blocks as :mod:`gefen_core.reference_ops` is, with its numerics contract).

GefenMuon's momentum (``gefen::muon_momentum.v3``, a list of matrices), per block ``b`` of the matrix's
row-major flattening (``B`` and ``OMB`` the ``MUON_BETA`` / ``MUON_ONE_MINUS_BETA`` scalars of
:func:`gefen_core.step_scalars.muon_scalars`)::

    g_i  = fl(grad_i)                                # exact widening of bf16/fp16; fp64 rounded
    m_i  = fl(C[q_i] * M_b)
    u_i  = fl( fl(m_i * B) + fl(g_i * OMB) )         # the stored EMA, before requantisation
    M_b' = max_i |u_i| ;  z_i = fl(u_i / M_b')  (0 when M_b' == 0) ;  q_i' = round(C, z_i)
    h_i  = fl(C[q_i'] * M_b')                        # the requantised momentum
    n_i  = fl( fl(h_i * B) + fl(g_i * OMB) )  if nesterov  else  h_i
    out_i = ro(n_i)                                  # one rounding to out's dtype (bf16: RNE)

The state (``q``, ``M``) is the same with and without Nesterov; only ``out`` differs. ``out``
is the Newton-Schulz input, so the quantisation error is part of the update (as in the
reference design). Stochastic rounding numbers elements row-major over the whole matrix
(``first_index = 0``), so a chunked or tiled kernel draws the same uniforms.
"""

from __future__ import annotations

import torch

from . import step_scalars as S
from .reference_ops import _chunk_rows, _seed_of, requantized_momentum, scalars_of

__all__ = ["muon_momentum_reference", "muon_momentum_tensor"]


def muon_momentum_tensor(
    grad: torch.Tensor,
    indices: torch.Tensor,
    magnitude: torch.Tensor,
    codebook: torch.Tensor,
    scalars: torch.Tensor,
    sr_seed: torch.Tensor | None,
    out: torch.Tensor,
    *,
    nesterov: bool,
    deterministic: bool,
) -> None:
    """Advance one matrix's quantized momentum and write the NS input (one entry of
    ``gefen::muon_momentum.v3``).

    ``grad``: contiguous ``[R, C]`` (fp32, bf16, fp16 or fp64); ``indices``: uint8 ``[B, P]``
    and ``magnitude``: fp32 ``[B, 1]`` with ``B * P == R * C`` (blocks of the row-major
    flattening); ``codebook``: fp32 ``[256]``; ``scalars``: fp32 ``[MUON_NUM_SCALARS]``;
    ``sr_seed``: int64 ``[1]`` for stochastic rounding or ``None``; ``out``: contiguous
    ``[R, C]`` bf16 or fp32 on grad's device. Updates ``indices`` and ``magnitude`` and writes
    ``out`` (module docstring for the exact arithmetic).
    """
    del deterministic  # the reference is deterministic on every device
    blocks, period = indices.shape
    g2 = grad.view(blocks, period)
    o2 = out.view(blocks, period)
    beta = scalars[S.MUON_BETA]
    one_minus_beta = scalars[S.MUON_ONE_MINUS_BETA]
    rows = _chunk_rows(period)
    for first in range(0, blocks, rows):
        last = min(blocks, first + rows)
        g = g2[first:last].to(torch.float32)
        momentum = requantized_momentum(
            g, None, indices[first:last], magnitude[first:last], codebook, beta, one_minus_beta, sr_seed, first * period
        )
        if nesterov:
            momentum = momentum * beta + g * one_minus_beta
        o2[first:last] = momentum


def muon_momentum_reference(
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
    """``gefen::muon_momentum.v3``: :func:`muon_momentum_tensor` of each matrix of the lists
    (``scalars``: ``[MUON_NUM_SCALARS]`` shared or one row per entry; one seed per entry)."""
    for index, grad in enumerate(grads):
        muon_momentum_tensor(
            grad,
            indices[index],
            magnitudes[index],
            codebook,
            scalars_of(scalars, index),
            _seed_of(sr_seeds, index),
            outs[index],
            nesterov=nesterov,
            deterministic=deterministic,
        )

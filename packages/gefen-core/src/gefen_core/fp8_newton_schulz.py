"""Newton-Schulz with e4m3 (fp8) GEMMs and per-row scales, and its CPU twin.

``fp8_ns=True`` runs the three GEMMs of each iteration on ``float8_e4m3fn`` operands with
one fp32 scale per row (per column for the right-hand operand) and bf16 outputs. The
normalisation and transposition of :func:`gefen_core.newton_schulz.newton_schulz` are done in
bf16 first; then, per ``(a, b, c)``::

    Xq, sx = rows(X)                         # sx_r = max(amax_r / 448, 1e-12); Xq = e4m3(clamp(X / sx, +-448))
    A  = mm(Xq, sx, Xq^T, sx^T)              # X X^T, bf16
    Aq, sa = rows(A) ;  A2 = mm(Aq, sa, Aq^T, sa^T)     # A A^T = A A (A is symmetric), bf16
    B  = bf16(fp32(b * A) + fp32(c * A2))    # in fp32, rounded once
    Bq, sb = rows(B) ;  Tq, st = rows(X^T)   # X quantised per column, as the rows of X^T
    BX = mm(Bq, sb, Tq^T, st^T)              # bf16
    X  = bf16(a * fp32(X) + fp32(BX))

``mm(P, sp, Q, sq) = bf16((fp32(P) @ fp32(Q)) * sp * sq)``: on a GPU it is
``torch._scaled_mm`` (row-wise scaling, fp32 accumulation; the right operand column-major);
:func:`emulated_scaled_mm` computes the same thing with fp32 matmuls of the exactly decoded
e4m3 values, so the whole fp8 iteration runs (slowly) on any device, and its numerics can be
tested on CPU. The two differ only in fp32 accumulation order.

Gating (:func:`fp8_eligible`): a CUDA device of compute capability at least (8, 9), both
dimensions multiples of 16 (``_scaled_mm``'s rule) and ``min(rows, cols) >= 1536`` (the measured
break-even of the reference: 1024 -> 0.77x, 1536 -> 1.23x, 2048 -> 1.31x against bf16 on an
RTX 5090). Anywhere else the optimizer warns once and runs the bf16 iteration. The fp8 path
is not bit-compatible with bf16: its relative L2 distance from the bf16 output is about 0.1
(a stated bound is tested on the CPU twin).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .newton_schulz import Schedule

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_CAPABILITY",
    "FP8_MIN_DIM",
    "FP8_MIN_SCALE",
    "ScaledMatmul",
    "emulated_scaled_mm",
    "fp8_capable",
    "fp8_eligible",
    "newton_schulz_fp8",
    "quantize_rows",
    "torch_scaled_mm",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1e-12
FP8_MIN_CAPABILITY = (8, 9)
FP8_MIN_DIM = 1536
_ALIGN = 16

#: ``mm(p_q, p_scale[M, 1], q_q[K, N], q_scale[1, N]) -> bf16[M, N]``.
ScaledMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantisation: ``(e4m3 [M, K], fp32 scales [M, 1])`` with ``x ~ q * scale``.

    ``q`` is row-major whatever ``x``'s strides (``quantize_rows(x.T)`` is the transpose's own
    copy), so ``q.T`` is the column-major right operand ``torch._scaled_mm`` takes."""
    wide = x.to(torch.float32, memory_format=torch.contiguous_format)
    scale = torch.clamp(wide.abs().amax(dim=1, keepdim=True) / FP8_MAX, min=FP8_MIN_SCALE)
    return torch.clamp(wide / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def emulated_scaled_mm(
    p_q: torch.Tensor, p_scale: torch.Tensor, q_q: torch.Tensor, q_scale: torch.Tensor
) -> torch.Tensor:
    """The CPU twin of ``torch._scaled_mm`` with row-wise scales (fp32 matmul of decoded e4m3).

    It refuses the operand layouts cuBLASLt refuses (``p_q`` row-major, ``q_q`` column-major),
    so a layout that only a GPU would reject fails on CPU too."""
    _check_layouts(p_q, q_q)
    return ((p_q.to(torch.float32) @ q_q.to(torch.float32)) * p_scale * q_scale).to(torch.bfloat16)


def _check_layouts(p_q: torch.Tensor, q_q: torch.Tensor) -> None:
    if not p_q.is_contiguous() or not q_q.T.is_contiguous():
        raise RuntimeError(
            "scaled fp8 matmul takes a row-major left and a column-major right operand, got strides "
            f"{p_q.stride()} and {q_q.stride()} for shapes {tuple(p_q.shape)} and {tuple(q_q.shape)}"
        )


def torch_scaled_mm(p_q: torch.Tensor, p_scale: torch.Tensor, q_q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales and a bf16 result (``q_q`` column-major)."""
    return torch._scaled_mm(p_q, q_q, scale_a=p_scale, scale_b=q_scale, out_dtype=torch.bfloat16)


def _fp8_iterations(x: torch.Tensor, schedule: Schedule, mm: ScaledMatmul) -> torch.Tensor:
    for a, b, c in schedule:
        xq, sx = quantize_rows(x)
        gram = mm(xq, sx, xq.T, sx.T)
        gq, sg = quantize_rows(gram)
        gram2 = mm(gq, sg, gq.T, sg.T)
        update = (gram.to(torch.float32) * b + gram2.to(torch.float32) * c).to(torch.bfloat16)
        uq, su = quantize_rows(update)
        tq, st = quantize_rows(x.T)
        product = mm(uq, su, tq.T, st.T)
        x = (x.to(torch.float32) * a + product.to(torch.float32)).to(torch.bfloat16)
    return x


_COMPILED: dict[str, Any] = {}


def _compiled_iterations() -> Callable[[torch.Tensor, Schedule, ScaledMatmul], torch.Tensor]:
    compiled = _COMPILED.get("iterations")
    if compiled is None:
        compiled = torch.compile(_fp8_iterations, mode="max-autotune-no-cudagraphs", dynamic=False)
        _COMPILED["iterations"] = compiled
    return compiled


def newton_schulz_fp8(
    matrix: torch.Tensor,
    schedule: Schedule,
    eps: float,
    *,
    scaled_mm: ScaledMatmul | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """The fp8 iteration of the module docstring (bf16 result in ``matrix``'s orientation).

    ``scaled_mm`` defaults to ``torch._scaled_mm`` on a capable CUDA device and to
    :func:`emulated_scaled_mm` elsewhere. ``compile`` runs the iterations through
    ``torch.compile`` (cached once per process), the fast form on a GPU.
    """
    if matrix.dim() != 2:
        raise ValueError(f"newton_schulz_fp8 needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    if scaled_mm is None:
        scaled_mm = torch_scaled_mm if fp8_capable(matrix.device) else emulated_scaled_mm
    x = matrix.to(dtype=torch.bfloat16, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    run = _compiled_iterations() if compile else _fp8_iterations
    x = run(x.contiguous(), schedule, scaled_mm)
    return x.T if tall else x


def fp8_capable(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device of compute capability at least (8, 9)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def fp8_eligible(shape: tuple[int, int], device: torch.device) -> bool:
    """Whether a matrix of ``shape`` on ``device`` takes the fp8 iteration (module docstring)."""
    rows, cols = shape
    return fp8_capable(device) and min(rows, cols) >= FP8_MIN_DIM and rows % _ALIGN == 0 and cols % _ALIGN == 0

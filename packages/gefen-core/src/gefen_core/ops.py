"""Gefen's named kernel ops, their signatures, and dispatch between kernels and reference.

gefen-core owns these op ids; a kernel provider (for example gefen-kernels) implements some
of them and registers through the ``gefen.kernels`` entry points of
:mod:`gefen_contracts.kernels`. Signatures are versioned by the ``/N`` suffix and never
change under a given id. All tensors are passed explicitly, scalars arrive packed in an fp32
device tensor (:mod:`gefen_core.step_scalars`), and the numerics every implementation must
reproduce are stated in :mod:`gefen_core.reference_ops`.

=============================  ==============================================================
op id                          signature (``*`` starts keyword-only arguments)
=============================  ==============================================================
``gefen.block_step/2``         ``(param, grad, indices, magnitude, vmean, codebook, scalars,
                               sr_seed, *, apply_decay, maximize, deterministic) -> None``
``gefen.factored_stats/1``     ``(grad, *, deterministic) -> (row_sumsq f64[R], col_sumsq f64[K])``
``gefen.factored_moments/1``   ``(grad, v_row, v_col, scalars, *, deterministic) -> row_factor fp32[R]``
                               (the statistics and the ``v_row``/``v_col`` update in one call)
``gefen.factored_step/3``      ``(param, grad, indices, magnitude, row_factor, v_col, codebook,
                               scalars, sr_seed, *, apply_decay, maximize, deterministic) -> None``
``gefen.histogram/1``          ``(grad, period, counts, *, deterministic) -> None`` (adds to int64 counts)
``gefen.stochastic_uniform/1`` ``(seed int64[1], index int64[...]) -> fp32[...]``
``gefen.muon_momentum/1``      ``(grad, indices, magnitude, codebook, scalars, sr_seed, out, *,
                               nesterov, deterministic) -> None`` (GefenMuon; writes ``out``)
=============================  ==============================================================

``param`` and ``grad`` are contiguous and of equal shape and dtype (fp32, bf16, fp16 or
fp64); for ``gefen.muon_momentum/1`` ``grad`` is a contiguous 2-D matrix, ``out`` a contiguous
bf16 (or fp32) tensor of its shape and ``scalars`` the Muon packet of
:func:`gefen_core.step_scalars.muon_scalars`; a provider's ``supports(op_id, *args, **kwargs)`` decides from the real arguments
and must not touch them. ``deterministic=True`` asks for a fixed reduction order.

Dispatch (``fused``): ``None`` uses a registered provider that supports the call, else the
reference; ``True`` requires one (:class:`~gefen_contracts.KernelUnavailableError` naming
the reason); ``False`` always runs the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gefen_contracts import KernelRegistry, default_kernel_registry

from .reference_ops import (
    block_step_reference,
    factored_moments_reference,
    factored_stats_reference,
    factored_step_reference,
    histogram_reference,
    muon_momentum_reference,
    stochastic_uniform_reference,
)

__all__ = [
    "BLOCK_STEP",
    "DISPATCHED_OPS",
    "FACTORED_MOMENTS",
    "FACTORED_STATS",
    "FACTORED_STEP",
    "HISTOGRAM",
    "MUON_DISPATCHED_OPS",
    "MUON_MOMENTUM",
    "OPS",
    "STOCHASTIC_UNIFORM",
    "KernelDispatch",
    "OpSpec",
]

BLOCK_STEP = "gefen.block_step/2"
FACTORED_STATS = "gefen.factored_stats/1"
FACTORED_MOMENTS = "gefen.factored_moments/1"
FACTORED_STEP = "gefen.factored_step/3"
HISTOGRAM = "gefen.histogram/1"
STOCHASTIC_UNIFORM = "gefen.stochastic_uniform/1"
MUON_MOMENTUM = "gefen.muon_momentum/1"


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op: its id, a one-line promise, and its reference implementation."""

    op_id: str
    summary: str
    reference: Callable[..., Any]


#: Every op gefen-core names, by id.
OPS: dict[str, OpSpec] = {
    spec.op_id: spec
    for spec in (
        OpSpec(BLOCK_STEP, "block-path second moment, momentum requantisation and write", block_step_reference),
        OpSpec(FACTORED_STATS, "float64 row and column sums of g^2", factored_stats_reference),
        OpSpec(FACTORED_MOMENTS, "factored statistics and v_row/v_col update in one call", factored_moments_reference),
        OpSpec(FACTORED_STEP, "factored-path momentum requantisation and write", factored_step_reference),
        OpSpec(HISTOGRAM, "block-normalised gradient histogram, 4096 bins", histogram_reference),
        OpSpec(STOCHASTIC_UNIFORM, "SplitMix64 counter-based uniforms", stochastic_uniform_reference),
        OpSpec(MUON_MOMENTUM, "GefenMuon momentum requantisation and Newton-Schulz input", muon_momentum_reference),
    )
}


#: The ops ``Gefen.step`` dispatches (``stochastic_uniform`` is named for parity tests only).
DISPATCHED_OPS = (BLOCK_STEP, FACTORED_MOMENTS, FACTORED_STATS, FACTORED_STEP, HISTOGRAM)

#: The ops ``GefenMuon.step`` dispatches.
MUON_DISPATCHED_OPS = (HISTOGRAM, MUON_MOMENTUM)


class KernelDispatch:
    """Chooses, per call, a provider's implementation or the reference (see module docs)."""

    __slots__ = ("_fused", "_registry")

    def __init__(self, fused: bool | None, registry: KernelRegistry | None = None) -> None:
        self._fused = fused
        self._registry = registry

    def __deepcopy__(self, memo: dict[int, Any]) -> KernelDispatch:
        return KernelDispatch(self._fused, self._registry)  # a registry is a shared service, not state

    def __reduce__(self) -> tuple[Any, ...]:
        return (KernelDispatch, (self._fused,))  # unpickled in another process: its default registry

    @property
    def registry(self) -> KernelRegistry:
        return self._registry if self._registry is not None else default_kernel_registry()

    def available(self, op_id: str) -> bool:
        """Whether any registered provider offers ``op_id`` at all (no tensors needed)."""
        return any(op_id in provider.op_ids() for provider in self.registry.providers)

    def resolve(self, op_id: str, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """The implementation to run for these arguments (raises only when ``fused=True``)."""
        reference = OPS[op_id].reference
        if self._fused is False:
            return reference
        if self._fused is True:
            return self.registry.require(op_id, *args, **kwargs)
        found = self.registry.lookup(op_id, *args, **kwargs)
        return found if found is not None else reference

    def __call__(self, op_id: str, *args: Any, **kwargs: Any) -> Any:
        return self.resolve(op_id, *args, **kwargs)(*args, **kwargs)

"""Gefen's kernel ops: torch custom ops in the ``gefen`` namespace, and the ``fused`` choice.

gefen-core declares each op once with ``torch.library``: its schema, its reference
implementation (:mod:`gefen_core.reference_ops`, registered for
``CompositeExplicitAutograd`` so every device has one) and a fake implementation, so
``torch.compile`` traces the op as one opaque node. A kernel package (gefen-kernels)
registers ``CPU`` and ``CUDA`` implementations of the same ops through ``torch.library``
and is found through the ``gefen.kernels`` entry points (:mod:`gefen_contracts.kernels`);
torch's dispatcher prefers them to the reference. The op's overload name is its signature
version: a changed signature or changed numerics is a new overload, never an edit.

=================================  ==========================================================
op                                 schema (after the name; ``*`` starts keyword-only arguments)
=================================  ==========================================================
``gefen::block_step.v4``           ``(params![], grads[], indices![], magnitudes![], vmeans![],
                                   codebook, scalars, sr_seeds?, *, apply_decay, maximize,
                                   deterministic)``
``gefen::element_step.v2``         ``(params![], grads[], indices![], magnitudes![], vs![], codebook,
                                   scalars, sr_seeds?, *, apply_decay, maximize, deterministic)``
                                   (Adam's per-element ``v`` of narrow matrices, advanced in
                                   the same pass)
``gefen::factored_stats.v2``       ``(grads[], *, deterministic) -> (row_sumsq f64[sum R],
                                   col_sumsq f64[sum K])`` (every entry's sums, concatenated;
                                   the row-sharded matrices' phase 1)
``gefen::factored_moments.v3``     ``(grads[], v_rows![], v_cols![], scalars, *, deterministic)
                                   -> row_factors fp32[sum R]`` (the statistics and the
                                   ``v_row``/``v_col`` update in one call; the row factors
                                   of every entry, concatenated)
``gefen::factored_step.v5``        ``(params![], grads[], indices![], magnitudes![], row_factors[],
                                   v_cols[], codebook, scalars, sr_seeds?, *, apply_decay,
                                   maximize, deterministic)``
``gefen::histogram.v2``            ``(grads[], periods int[], counts!, *, deterministic)`` (adds every
                                   gradient's counts to int64 ``counts``)
``gefen::stochastic_uniform.v1``   ``(seed int64[1], index int64[...]) -> fp32[...]``
``gefen::muon_momentum.v3``        ``(grads[], indices![], magnitudes![], codebook, scalars, sr_seeds?,
                                   outs![], *, nesterov, deterministic)`` (GefenMuon; writes ``outs``)
``gefen::codebook_solve.v2``       ``(counts int64[4096]) -> f64[256]`` (the exact codebook solve of
                                   a CPU histogram, :mod:`gefen_core.exact_dp`; a host op:
                                   kernel packages register it for the CPU only)
=================================  ==========================================================

``!`` marks an argument the op writes in place, ``[]`` a list of tensors. The step ops
(Gefen's five and GefenMuon's momentum) take one list entry per parameter, so a step makes
one call per parameter group and second-moment variant (as ``torch._fused_adamw_`` does;
GefenMuon: per batch of Newton-Schulz inputs), not one per tensor; each
parameter and its gradient are contiguous and of equal shape and dtype (fp32, bf16, fp16
or fp64; the dtype may differ between entries). The step scalars arrive packed in an fp32
device tensor (:mod:`gefen_core.step_scalars`), ``[NUM_SCALARS]`` shared by every entry or
``[N, NUM_SCALARS]`` one row per entry, so a learning-rate schedule changes values, never
the call; ``sr_seeds`` holds one int64 stochastic-rounding seed per entry. ``fused=True``
does not require the codebook solve's kernel (a host op, whose kernel's codebook is the
reference's bit for bit): a step that learns runs it where registered, the reference elsewhere.
``deterministic=True`` asks for a fixed reduction order.

``fused`` (:class:`Kernels`): ``None`` calls the op, so the dispatcher runs a registered
kernel for the tensors' device and the reference elsewhere; ``True`` first requires a
registered kernel (:class:`~gefen_contracts.KernelUnavailableError` naming why there is
none); ``False`` calls the op's reference twin (:func:`reference_name`), the same reference
behind an op no kernel package registers, so that the compiler keeps it opaque too.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import KernelUnavailableError
from gefen_contracts.kernels import kernel_unavailable_reasons, load_kernel_plugins

from .errors import GefenOptionTypeError
from .exact_dp import codebook_solve_reference
from .muon_reference_ops import muon_momentum_reference
from .reference_ops import (
    block_step_reference,
    element_step_reference,
    factored_moments_reference,
    factored_stats_reference,
    factored_step_reference,
    histogram_reference,
    stochastic_uniform_reference,
)

__all__ = [
    "BLOCK_STEP",
    "CODEBOOK_SOLVE",
    "DISPATCHED_OPS",
    "ELEMENT_STEP",
    "FACTORED_MOMENTS",
    "FACTORED_STATS",
    "FACTORED_STEP",
    "HOST_OPS",
    "HISTOGRAM",
    "MUON_DISPATCHED_OPS",
    "MUON_MOMENTUM",
    "NAMESPACE",
    "OPS",
    "STOCHASTIC_UNIFORM",
    "Kernels",
    "OpSpec",
    "PartialKernelsWarning",
    "kernel_registered",
    "reference_name",
    "warn_on_partial_kernels",
]

NAMESPACE = "gefen"
BLOCK_STEP = "gefen::block_step.v4"
ELEMENT_STEP = "gefen::element_step.v2"
FACTORED_STATS = "gefen::factored_stats.v2"
FACTORED_MOMENTS = "gefen::factored_moments.v3"
FACTORED_STEP = "gefen::factored_step.v5"
HISTOGRAM = "gefen::histogram.v2"
STOCHASTIC_UNIFORM = "gefen::stochastic_uniform.v1"
MUON_MOMENTUM = "gefen::muon_momentum.v3"
CODEBOOK_SOLVE = "gefen::codebook_solve.v2"
#: Ops whose inputs live on the host: a kernel package registers them for the CPU only.
HOST_OPS = frozenset({CODEBOOK_SOLVE})

_STEP_FLAGS = "bool apply_decay, bool maximize, bool deterministic"


def _none(*args: Any, **kwargs: Any) -> None:
    return None


def _stats_fake(grads: list[torch.Tensor], *, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not grads:
        return torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64)
    rows, cols = sum(grad.shape[0] for grad in grads), sum(grad.shape[1] for grad in grads)
    return grads[0].new_empty(rows, dtype=torch.float64), grads[0].new_empty(cols, dtype=torch.float64)


def _moments_fake(
    grads: list[torch.Tensor],
    v_rows: list[torch.Tensor],
    v_cols: list[torch.Tensor],
    scalars: torch.Tensor,
    *,
    deterministic: bool,
) -> torch.Tensor:
    rows = sum(grad.shape[0] for grad in grads)
    return grads[0].new_empty(rows, dtype=torch.float32) if grads else torch.empty(0, dtype=torch.float32)


def _uniform_fake(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return index.new_empty(index.shape, dtype=torch.float32)


def _solve_fake(counts: torch.Tensor) -> torch.Tensor:
    return counts.new_empty(256, dtype=torch.float64)


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One op: its qualified name, schema (after the name), and its reference and fake
    implementations (the module docstring says what each op does)."""

    name: str
    schema: str
    reference: Callable[..., Any]
    fake: Callable[..., Any]


#: Every op gefen-core declares, by qualified name.
OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            BLOCK_STEP,
            "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] indices, Tensor(c!)[] magnitudes, "
            f"Tensor(d!)[] vmeans, Tensor codebook, Tensor scalars, Tensor? sr_seeds, *, {_STEP_FLAGS}) -> ()",
            block_step_reference,
            _none,
        ),
        OpSpec(
            ELEMENT_STEP,
            "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] indices, Tensor(c!)[] magnitudes, "
            f"Tensor(d!)[] vs, Tensor codebook, Tensor scalars, Tensor? sr_seeds, *, {_STEP_FLAGS}) -> ()",
            element_step_reference,
            _none,
        ),
        OpSpec(
            FACTORED_STATS,
            "(Tensor[] grads, *, bool deterministic) -> (Tensor, Tensor)",
            factored_stats_reference,
            _stats_fake,
        ),
        OpSpec(
            FACTORED_MOMENTS,
            "(Tensor[] grads, Tensor(a!)[] v_rows, Tensor(b!)[] v_cols, Tensor scalars, *, bool deterministic) "
            "-> Tensor",
            factored_moments_reference,
            _moments_fake,
        ),
        OpSpec(
            FACTORED_STEP,
            "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] indices, Tensor(c!)[] magnitudes, "
            "Tensor[] row_factors, Tensor[] v_cols, Tensor codebook, Tensor scalars, Tensor? sr_seeds, *, "
            f"{_STEP_FLAGS}) -> ()",
            factored_step_reference,
            _none,
        ),
        OpSpec(
            HISTOGRAM,
            "(Tensor[] grads, int[] periods, Tensor(a!) counts, *, bool deterministic) -> ()",
            histogram_reference,
            _none,
        ),
        OpSpec(
            STOCHASTIC_UNIFORM,
            "(Tensor seed, Tensor index) -> Tensor",
            stochastic_uniform_reference,
            _uniform_fake,
        ),
        OpSpec(
            MUON_MOMENTUM,
            "(Tensor[] grads, Tensor(a!)[] indices, Tensor(b!)[] magnitudes, Tensor codebook, Tensor scalars, "
            "Tensor? sr_seeds, Tensor(c!)[] outs, *, bool nesterov, bool deterministic) -> ()",
            muon_momentum_reference,
            _none,
        ),
        OpSpec(
            CODEBOOK_SOLVE,
            "(Tensor counts) -> Tensor",
            codebook_solve_reference,
            _solve_fake,
        ),
    )
}

#: The ops ``Gefen.step`` dispatches that ``fused=True`` requires (also the codebook solve, a host op
#: it does not require; ``stochastic_uniform`` is named for parity tests only).
DISPATCHED_OPS = (BLOCK_STEP, ELEMENT_STEP, FACTORED_MOMENTS, FACTORED_STATS, FACTORED_STEP, HISTOGRAM)

#: The ops ``GefenMuon.step`` dispatches.
MUON_DISPATCHED_OPS = (HISTOGRAM, MUON_MOMENTUM)


def reference_name(name: str) -> str:
    """The reference-only twin of op ``name`` (``gefen::block_step.v4`` ->
    ``gefen::block_step_reference.v4``): the same schema, reference and fake, for which no kernel
    package registers a kernel. ``fused=False`` calls it, so that ``torch.compile`` keeps the
    reference one opaque node too (traced through, inductor rewrote its int64 SplitMix hash
    into wrong numbers, a compile error or a segfault, and kept bf16 intermediates in fp32)."""
    base, version = name.split(".")
    return f"{base}_reference.{version}"


def _declare() -> torch.library.Library:
    library = torch.library.Library(NAMESPACE, "DEF")  # type: ignore[no-untyped-call]
    for spec in OPS.values():
        for qualified in (spec.name, reference_name(spec.name)):
            local = qualified.split("::")[1]
            library.define(local + spec.schema)  # type: ignore[no-untyped-call]
            library.impl(local, spec.reference, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
            torch.library.register_fake(qualified, spec.fake, lib=library)
    return library


#: Kept alive for the process: dropping a ``Library`` unregisters its ops.
_LIBRARY = _declare()


def _overload(name: str) -> Any:
    base, version = name.split("::")[1].split(".")
    return getattr(getattr(getattr(torch.ops, NAMESPACE), base), version)


#: The ``torch.ops`` overload of each op (what the dispatcher runs), and of its reference twin.
_OVERLOADS: dict[str, Any] = {name: _overload(name) for name in OPS}
_REFERENCE_OVERLOADS: dict[str, Any] = {name: _overload(reference_name(name)) for name in OPS}
_PLUGINS: list[bool] = []


def _load_plugins() -> None:
    if not _PLUGINS:
        load_kernel_plugins()
        _PLUGINS.append(True)
        warn_on_partial_kernels()


class PartialKernelsWarning(UserWarning):
    """A device has kernels for some of Gefen's ops but not all: the others run the reference."""


def warn_on_partial_kernels() -> list[str]:
    """Warn when a device type has kernels for some ops but not for others (a kernel package
    built for other op versions than this gefen-core's: the missing ops would run the
    reference, many times slower, without a word). Returns the ops missing per device."""
    missing_all = []
    for key in ("CPU", "CUDA"):
        ops = [op for op in OPS if key == "CPU" or op not in HOST_OPS]
        present = [op for op in ops if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]
        missing = [op for op in ops if op not in present]
        if present and missing:
            missing_all += [f"{key}: {op}" for op in missing]
            warnings.warn(
                f"kernels are registered for {len(present)} of gefen-core's ops on {key} but not for {missing}: "
                "those run the PyTorch reference (many times slower); the installed kernel package was built "
                "for other op versions than this gefen-core's, so install matching releases",
                PartialKernelsWarning,
                stacklevel=3,
            )
    return missing_all


@functools.cache
def _dispatch_key(device_type: str) -> str:
    # torch's own spelling ("CPU", "CUDA", "Meta", "PrivateUse1"...): upper-casing the device
    # type made "META", which the dispatcher cannot parse (fused=True on a meta model crashed)
    return str(torch._C._dispatch_key_for_device(device_type))


def kernel_registered(op: str, device: torch.device) -> bool:
    """Whether a kernel package registered ``op`` for ``device``'s type (plugins load first).
    On the meta device the op's fake implementation answers: a model built there and
    materialised later (``to_empty``) is checked again on its real device at its first step."""
    _load_plugins()
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, _dispatch_key(device.type)))
    except RuntimeError:  # a device type the dispatcher has no key for
        return False


class Kernels:
    """Runs Gefen's ops the way ``fused`` says (see the module docs)."""

    __slots__ = ("_fused",)

    def __init__(self, fused: bool | None) -> None:
        if fused is not None and type(fused) is not bool:
            raise GefenOptionTypeError(f"fused must be None, True or False, got {fused!r}")
        self._fused = fused

    @property
    def fused(self) -> bool | None:
        return self._fused

    def require(self, op: str, device: torch.device) -> None:
        """Raise :class:`~gefen_contracts.KernelUnavailableError` unless a kernel for ``op`` is
        registered for ``device`` (what ``fused=True`` needs), saying why there is none."""
        if kernel_registered(op, device):
            return
        reasons = "; ".join(kernel_unavailable_reasons(device.type))
        raise KernelUnavailableError(
            f"fused=True needs a {device.type} kernel for {op}, and none is registered: {reasons}"
        )

    def op(self, name: str) -> Callable[..., Any]:
        """The callable that runs op ``name`` the way ``fused`` says: the torch op (the
        dispatcher picks a registered kernel or the reference), or its reference twin
        (:func:`reference_name`)."""
        if self._fused is False:
            return _REFERENCE_OVERLOADS[name]  # type: ignore[no-any-return]
        _load_plugins()
        return _OVERLOADS[name]  # type: ignore[no-any-return]

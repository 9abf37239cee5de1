"""The quality ladder: AdamW with Gefen's approximations switched on one at a time.

:class:`LadderAdamW` is a small plain-PyTorch AdamW (decoupled weight decay, bias
correction, ``eps`` outside the root) in which each of Gefen's approximations is an
independent switch (:class:`Approximations`), so ``gefen bench quality --ladder`` can
measure what each one costs on its own. It is a measuring instrument, not an optimizer to
train with: it keeps its state in whatever form the switches say (fp32 where exact) and is
slow. Its approximations are Gefen's own, built from gefen-core's documented building
blocks (:mod:`gefen_core.periods`, :mod:`gefen_core.codebook`,
:mod:`gefen_core.momentum_codec`), and the rung with every switch at Gefen's default is
checked against ``gefen_core.Gefen`` in the tests.

Switches (per element ``i`` of a parameter, ``b`` its block):

* ``v_2d`` / ``v_1d``: the second moment of 2-D / 1-D parameters: ``"exact"`` (Adam's
  per-element EMA), ``"factored"`` (2-D only: EMAs of row and column means of ``g^2``,
  ``V = v_row v_col / mean(v_col)``) or ``"block"`` (one EMA of the block mean of ``g^2``).
* ``min_dim_size_to_factor``: a ``"factored"`` ``v_2d`` applies to matrices whose two
  dimensions are at least this; narrower ones keep the exact ``v`` (Gefen's option, 128 in
  its defaults; ``0`` factors every matrix).
* ``clip_threshold``: Adafactor's update clipping of factored 2-D parameters (``0``: off): the
  preconditioned gradient ``g / (sqrt(V) + eps)`` of a matrix is scaled down to RMS
  ``clip_threshold`` over the whole matrix before it enters the first moment (Gefen's
  ``clip_threshold``, on its factored matrices; off in Gefen's defaults).
* ``momentum``: ``"exact"`` (fp32) or ``"quantized"``: ``u = b1 m + (1 - b1) g`` stored as
  a uint8 code into a 256-entry codebook times one fp32 scale ``max |u|`` per block.
* ``quantize_1d``: whether 1-D parameters' momentum is quantised too.
* ``block_cap``: blocks follow Gefen's shape rule (:func:`gefen_core.periods.shape_period`:
  the row, cut at 2048); a cap splits each block into the largest divisor not above it
  (finer momentum scales).
* ``codebook``: ``"learned"`` (exact DP on the first gradient's block-normalised histogram),
  ``"uniform"`` (256 evenly spaced codewords on ``[-1, 1]``) or ``"relearned"`` (learned,
  then learned again every ``refresh_every`` steps from the momentum's own histogram).
* ``rounding``: ``"nearest"`` or ``"stochastic"`` (unbiased).
* ``error_feedback``: carry each element's quantisation residual into the next step's
  EMA (a diagnostic: the residual is a dense fp32 buffer, 4 more bytes per element).
* ``apply``: what the update applies: ``"stored"`` (the requantised momentum, as Gefen 0.1)
  or ``"exact"`` (the EMA ``u`` before requantisation, as torchao's low-bit AdamW: the
  rounding error then reaches the parameters only through the next step's ``beta1 m``).
* ``quantize``: what the first moment holds: ``"momentum"`` (``u`` itself, Gefen up to native format v3),
  ``"preconditioned-adam"`` (the codes hold ``u / (sqrt(V_t) + eps)`` at the resolution of the update, but are
  decoded with the denominator they were stored with, ``V_t``, so the decoded value is Adam's EMA of ``g``
  itself: Adam's order of momentum and preconditioning; a real optimizer recomputes ``V_t`` from the second
  moment before advancing it, no extra state; the instrument keeps it) or
  ``"preconditioned"`` (``u / (sqrt(V) + eps)``, the update's direction, so every element is
  rounded to the same *update* resolution; decoded with the current step's ``V``, no extra
  state; Gefen's default since native format v4). Decoding with the current ``V`` makes the stored value the
  EMA of ``g / (sqrt(V) + eps)`` (LaProp's order of momentum and preconditioning); with exact
  momentum the switch measures that order alone. The codebook is learned from the gradient's
  histogram either way, as Gefen learns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from gefen_core.codebook import codebook_from_counts
from gefen_core.momentum_codec import dequantize, nearest_codeword, normalize_blocks, stochastic_codeword
from gefen_core.periods import largest_divisor_at_most, shape_period
from gefen_core.reference_ops import histogram_tensor

__all__ = ["GEFEN_APPROXIMATIONS", "LADDER_RUNGS", "Approximations", "LadderAdamW"]

SecondMoment = Literal["exact", "factored", "block"]


@dataclass(frozen=True, slots=True)
class Approximations:
    """Which of Gefen's approximations are on (the defaults: none, i.e. AdamW)."""

    v_2d: SecondMoment = "exact"
    v_1d: SecondMoment = "exact"
    momentum: Literal["exact", "quantized"] = "exact"
    quantize_1d: bool = True
    block_cap: int = 0
    codebook: Literal["learned", "uniform", "relearned"] = "learned"
    refresh_every: int = 0
    rounding: Literal["nearest", "stochastic"] = "nearest"
    error_feedback: bool = False
    apply: Literal["stored", "exact"] = "stored"
    quantize: Literal["momentum", "preconditioned", "preconditioned-adam"] = "momentum"
    clip_threshold: float = 0.0
    min_dim_size_to_factor: int = 0

    def __post_init__(self) -> None:
        if self.v_1d == "factored":
            raise ValueError("a 1-D parameter has no factored second moment")
        if self.codebook == "relearned" and self.refresh_every <= 0:
            raise ValueError("codebook='relearned' needs refresh_every > 0")
        if self.block_cap < 0 or self.clip_threshold < 0 or self.min_dim_size_to_factor < 0:
            raise ValueError(
                "block_cap, clip_threshold and min_dim_size_to_factor must be >= 0, got "
                f"{self.block_cap}, {self.clip_threshold}, {self.min_dim_size_to_factor}"
            )

    def but(self, **changes: Any) -> Approximations:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


#: Every switch where ``gefen_core.Gefen``'s defaults put it.
GEFEN_APPROXIMATIONS = Approximations(
    v_2d="factored", v_1d="block", momentum="quantized", quantize="preconditioned", min_dim_size_to_factor=128
)

_EXACT = Approximations()
#: The ladder's rungs by name (registered as optimizers ``ladder-<name>``): the climb from
#: AdamW to Gefen one approximation at a time, single changes to AdamW, then single changes to
#: Gefen.
LADDER_RUNGS: dict[str, Approximations] = {
    "exact": _EXACT,
    "v2d-factored": _EXACT.but(v_2d="factored"),
    "laprop": _EXACT.but(quantize="preconditioned"),
    "gefen": GEFEN_APPROXIMATIONS,
    "v2d-block": _EXACT.but(v_2d="block"),
    "m-quantized": _EXACT.but(momentum="quantized", quantize_1d=False),
    "gefen-v1d-exact": GEFEN_APPROXIMATIONS.but(v_1d="exact", quantize_1d=False),
    "gefen-v2d-exact": GEFEN_APPROXIMATIONS.but(v_2d="exact"),
    "gefen-factor-all": GEFEN_APPROXIMATIONS.but(min_dim_size_to_factor=0),
    "gefen-clipped": GEFEN_APPROXIMATIONS.but(clip_threshold=1.0),
    "gefen-cap128": GEFEN_APPROXIMATIONS.but(block_cap=128),
    "gefen-uniform": GEFEN_APPROXIMATIONS.but(codebook="uniform"),
    "gefen-relearned": GEFEN_APPROXIMATIONS.but(codebook="relearned", refresh_every=50),
    "gefen-stochastic": GEFEN_APPROXIMATIONS.but(rounding="stochastic"),
    "gefen-feedback": GEFEN_APPROXIMATIONS.but(error_feedback=True),
    "v2d-factored-laprop": _EXACT.but(v_2d="factored", quantize="preconditioned"),
    "v2d-factored-laprop-clipped": _EXACT.but(v_2d="factored", quantize="preconditioned", clip_threshold=1.0),
    "gefen-apply-exact": GEFEN_APPROXIMATIONS.but(apply="exact"),
    "gefen-momentum-codes": GEFEN_APPROXIMATIONS.but(quantize="momentum"),
    "gefen-adam-order": GEFEN_APPROXIMATIONS.but(quantize="preconditioned-adam"),
}


def _period(approx: Approximations, shape: torch.Size) -> int:
    period = shape_period(tuple(shape), shape.numel())
    if approx.block_cap and period > approx.block_cap:
        period = largest_divisor_at_most(period, approx.block_cap)
    return period


class LadderAdamW(torch.optim.Optimizer):
    """AdamW with the switched-on :class:`Approximations` (module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        approximations: Approximations,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.approx = approximations
        self.codebook: torch.Tensor | None = None
        self._steps = 0

    def _quantizes(self, p: torch.Tensor) -> bool:
        return self.approx.momentum == "quantized" and (p.ndim >= 2 or self.approx.quantize_1d)

    def _second_moment_kind(self, p: torch.Tensor) -> SecondMoment:
        if p.ndim == 2:
            narrow = min(p.shape) < self.approx.min_dim_size_to_factor
            return "exact" if self.approx.v_2d == "factored" and narrow else self.approx.v_2d
        return self.approx.v_1d if p.ndim == 1 else "exact"

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = {"step": 0}
        kind = self._second_moment_kind(p)
        needs_blocks = kind == "block" or self._quantizes(p)
        period = _period(self.approx, p.shape) if needs_blocks else 1
        state["period"] = period
        if kind == "factored":
            state["v_row"] = torch.zeros(p.shape[0])
            state["v_col"] = torch.zeros(p.shape[1])
        elif kind == "block":
            state["vmean"] = torch.zeros(p.numel() // period, 1)
        else:
            state["v"] = torch.zeros_like(p, dtype=torch.float32)
        if self._quantizes(p):
            state["codes"] = torch.zeros(p.numel() // period, period, dtype=torch.uint8)
            state["scale"] = torch.zeros(p.numel() // period, 1)
            if self.approx.error_feedback:
                state["residual"] = torch.zeros(p.numel() // period, period)
        else:
            state["m"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def _learn_codebook(self, items: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
        if self.approx.codebook == "uniform":
            return torch.linspace(-1.0, 1.0, 256)
        counts = torch.zeros(4096, dtype=torch.int64)
        for tensor, period in items:
            histogram_tensor(tensor, period, counts, deterministic=True)
        return codebook_from_counts(counts)

    def _refresh_codebook(self) -> None:
        assert self.codebook is not None
        items = []
        entries = []
        for state in self.state.values():
            if "codes" in state:
                momentum = dequantize(self.codebook, state["codes"], state["scale"])
                items.append((momentum, state["period"]))
                entries.append((state, momentum))
        new = self._learn_codebook(items)
        if new is None:
            return
        for state, momentum in entries:
            scale, z = normalize_blocks(momentum)
            state["codes"] = nearest_codeword(new, z)
            state["scale"] = scale
        self.codebook = new

    def _second_moment(self, state: dict[str, Any], g: torch.Tensor, beta2: float, bc2: float) -> torch.Tensor:
        """Advance the second moment; return the bias-corrected per-element estimate (p's shape)."""
        if "v_row" in state:
            g2 = g.square()
            state["v_row"].mul_(beta2).add_(g2.mean(dim=1), alpha=1 - beta2)
            state["v_col"].mul_(beta2).add_(g2.mean(dim=0), alpha=1 - beta2)
            norm = state["v_col"].mean().clamp(min=torch.finfo(torch.float32).tiny)
            factored: torch.Tensor = torch.outer(state["v_row"], state["v_col"]) / norm / bc2
            return factored
        if "vmean" in state:
            blocks = g.reshape(-1, state["period"])
            state["vmean"].mul_(beta2).add_(blocks.square().mean(dim=1, keepdim=True), alpha=1 - beta2)
            shared: torch.Tensor = state["vmean"].expand_as(blocks).reshape(g.shape) / bc2
            return shared
        v: torch.Tensor = state["v"]
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        return v / bc2

    def _momentum(self, state: dict[str, Any], g: torch.Tensor, beta1: float, denom: torch.Tensor) -> torch.Tensor:
        """Advance the first moment; return what the update applies. ``denom`` is the step's
        ``sqrt(V) + eps`` (used when the codes hold the preconditioned momentum)."""
        if "m" in state:
            m: torch.Tensor = state["m"]
            if self.approx.quantize == "preconditioned":  # LaProp's order: the EMA of g / denom
                return m.mul_(beta1).add_(g / denom, alpha=1 - beta1) * denom
            return m.mul_(beta1).add_(g, alpha=1 - beta1)
        assert self.codebook is not None
        blocks = g.reshape(-1, state["period"])
        unit = denom.reshape(blocks.shape) if self.approx.quantize != "momentum" else None
        decoded = dequantize(self.codebook, state["codes"], state["scale"])
        unit_then = unit
        if self.approx.quantize == "preconditioned-adam":
            # Decode with the denominator the codes were stored with (Adam's order).
            unit_then = state.get("stored_unit", unit)
            state["stored_unit"] = unit
        u = (decoded if unit_then is None else decoded * unit_then) * beta1 + blocks * (1 - beta1)
        exact = u
        if unit is not None:
            u = u / unit
        if "residual" in state:
            u = u + state["residual"]
        scale, z = normalize_blocks(u)
        if self.approx.rounding == "stochastic":
            seed = (self._steps * 1_000_003 + id(state) % 1_000_003) & 0x7FFFFFFFFFFF
            codes = stochastic_codeword(self.codebook, z, seed, 0)
        else:
            codes = nearest_codeword(self.codebook, z)
        state["codes"], state["scale"] = codes, scale
        stored = dequantize(self.codebook, codes, scale)
        if "residual" in state:
            state["residual"] = u - stored
        if self.approx.apply == "exact":
            return exact.reshape(g.shape)
        return (stored if unit is None else stored * unit).reshape(g.shape)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        new: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p in self.state or not bool(p.grad.ne(0).any()):
                    continue
                self.state[p] = self._init_state(p)
                new.append(p)
        self._steps += 1
        denoms: dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            beta2 = group["betas"][1]
            for p in group["params"]:
                if p in self.state and p.grad is not None:
                    state = self.state[p]
                    state["step"] += 1
                    v_hat = self._second_moment(state, p.grad.float(), beta2, 1 - beta2 ** state["step"])
                    denoms[p] = v_hat.sqrt() + group["eps"]
        if self.codebook is None:
            items = []
            for p in new:
                if self._quantizes(p):
                    assert p.grad is not None  # a new state is made from a gradient
                    items.append((p.grad.float(), self.state[p]["period"]))
            if items:
                self.codebook = self._learn_codebook(items)
        if self.approx.codebook == "relearned" and self._steps % self.approx.refresh_every == 0:
            self._refresh_codebook()
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                if p not in self.state or p.grad is None:
                    if p.grad is not None:
                        p.mul_(1 - group["lr"] * group["weight_decay"])
                    continue
                state = self.state[p]
                g = p.grad.float()
                if self.approx.clip_threshold and p.ndim == 2 and self._second_moment_kind(p) == "factored":
                    preconditioned = g / denoms[p]
                    rms = preconditioned.square().mean().sqrt()
                    g = preconditioned / (rms / self.approx.clip_threshold).clamp(min=1.0) * denoms[p]
                m = self._momentum(state, g, beta1, denoms[p])
                update = m / denoms[p] / (1 - beta1 ** state["step"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(update.to(p.dtype), alpha=group["lr"])
        return loss

    def state_bytes_per_element(self) -> float:
        """Bytes of state per parameter element as Gefen would store it (fp32 for exact fields)."""
        total = 0
        elements = 0
        for p, state in self.state.items():
            elements += p.numel()
            # ``stored_unit`` is the instrument's copy of what a real optimizer recomputes from v.
            total += sum(
                t.numel() * t.element_size()
                for key, t in state.items()
                if isinstance(t, torch.Tensor) and key != "stored_unit"
            )
        return total / elements if elements else math.nan

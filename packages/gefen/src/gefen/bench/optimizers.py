"""The optimizers the demo and the benchmarks compare, by name.

Each entry builds an optimizer from named parameters, a learning rate and a weight decay,
and says why it cannot be built here (missing optional package) instead of failing late.
Optional baselines (torchao's low-bit AdamW) appear only when their package is installed:
``pip install 'gefen[bench]'``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_core import Gefen
from gefen_hybrid import DEFAULT_BACKUP_SUBSTRINGS

__all__ = [
    "HYBRID_BACKUP_SUBSTRINGS",
    "OptimizerEntry",
    "UnknownOptimizerError",
    "build_optimizer",
    "get_optimizer",
    "optimizer_names",
    "unavailable_reason",
]

NamedParameters = Sequence[tuple[str, torch.nn.Parameter]]


class UnknownOptimizerError(ValueError):
    """An optimizer name that is not in the registry."""


@dataclass(frozen=True, slots=True)
class OptimizerEntry:
    """One comparable optimizer: ``build(named_parameters, lr, weight_decay)`` and availability."""

    name: str
    description: str
    build: Callable[[NamedParameters, float, float], torch.optim.Optimizer]
    unavailable: Callable[[], str | None]


def _always_available() -> str | None:
    return None


def _build_adamw(named: NamedParameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    params = [p for _, p in named]
    # torch's fused AdamW is its fastest path on CPU and CUDA (the for-loop default is ~10x slower on CPU).
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def _gefen_builder(**options: Any) -> Callable[[NamedParameters, float, float], torch.optim.Optimizer]:
    def build(named: NamedParameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        # Named parameters give Gefen stable names (used by name-based options and in checkpoints).
        return Gefen(list(named), lr=lr, weight_decay=weight_decay, **options)

    return build


#: The hybrid arms route names containing these to the backup (the registry's defaults plus the
#: demo decoder's untied ``head``, which a name-and-shape routing would otherwise give to Muon).
HYBRID_BACKUP_SUBSTRINGS = (*DEFAULT_BACKUP_SUBSTRINGS, "head")


def _hybrid_builder(backup: str, **muon: Any) -> Callable[[NamedParameters, float, float], torch.optim.Optimizer]:
    def build(named: NamedParameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        # Imported here: gefen.hybrid pulls in gefen-hybrid, which the other arms do not need.
        from ..hybrid import GefenMuonHybrid

        return GefenMuonHybrid(
            list(named),
            lr=lr,
            weight_decay=weight_decay,
            backup_optimizer=backup,
            backup_substrings=HYBRID_BACKUP_SUBSTRINGS,
            **muon,
        )

    return build


Builder = Callable[[NamedParameters, float, float], torch.optim.Optimizer]


class _MuonWith(torch.optim.Optimizer):
    """``torch.optim.Muon`` for the hidden matrices and ``backup`` for the rest (the hybrid's
    routing), as one optimizer: its ``param_groups`` are the children's own group dicts, so an
    LR scheduler drives both. With torch's AdamW as the backup it is the reference arm
    GefenMuonHybrid is compared against; with a ladder rung it measures what each of Gefen's
    compressions costs on the backup's parameters alone (embeddings, head, norms, biases)."""

    def __init__(self, named: NamedParameters, lr: float, weight_decay: float, backup: Builder) -> None:
        from gefen_hybrid import RoutingRules

        rules = RoutingRules(backup_substrings=HYBRID_BACKUP_SUBSTRINGS)
        muon = [p for name, p in named if rules.role_for(name, p) == "muon"]
        rest = [(name, p) for name, p in named if rules.role_for(name, p) != "muon"]
        self.children = (
            torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
            backup(rest, lr, weight_decay),
        )
        super().__init__([p for _, p in named], {"lr": lr})
        # The children's own group dicts: a scheduler writing ``lr`` here drives both.
        self.param_groups = [group for child in self.children for group in child.param_groups]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for child in self.children:
            child.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for child in self.children:
            child.zero_grad(set_to_none=set_to_none)


def _ladder_builder(rung: str) -> Callable[[NamedParameters, float, float], torch.optim.Optimizer]:
    def build(named: NamedParameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        from .ladder import LADDER_RUNGS, LadderAdamW

        return LadderAdamW([p for _, p in named], LADDER_RUNGS[rung], lr=lr, weight_decay=weight_decay)

    return build


def _ladder_entries() -> list[OptimizerEntry]:
    from .ladder import LADDER_RUNGS

    return [
        OptimizerEntry(
            f"ladder-{rung}",
            f"quality ladder: AdamW with {approx} (gefen.bench.ladder; a measuring instrument)",
            _ladder_builder(rung),
            _always_available,
        )
        for rung, approx in LADDER_RUNGS.items()
    ]


def _muon_with(backup: Builder) -> Builder:
    def build(named: NamedParameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        return _MuonWith(named, lr, weight_decay, backup)

    return build


#: The ladder rungs measured on the hybrid's backup parameters: AdamW, then Gefen's
#: compressions one at a time, then all of them (what the Gefen backup runs).
BACKUP_LADDER_RUNGS = ("exact", "v2d-factored", "m-quantized", "laprop", "gefen-v1d-exact", "gefen")


def _backup_ladder_entries() -> list[OptimizerEntry]:
    gefen = OptimizerEntry(
        "muon-gefen",
        "backup ladder: torch Muon for hidden matrices + gefen.Gefen (defaults) for the hybrid's backup parameters",
        _muon_with(_gefen_builder()),
        _always_available,
    )
    rungs = [
        OptimizerEntry(
            f"muon-ladder-{rung}",
            f"backup ladder: torch Muon for hidden matrices + ladder rung {rung!r} for the hybrid's backup parameters",
            _muon_with(_ladder_builder(rung)),
            _always_available,
        )
        for rung in BACKUP_LADDER_RUNGS
    ]
    return [gefen, *rungs]


def _torchao_unavailable() -> str | None:
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'gefen[bench]')"
    return None


def _torchao_builder(class_name: str) -> Callable[[NamedParameters, float, float], torch.optim.Optimizer]:
    def build(named: NamedParameters, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        cls: Any = getattr(importlib.import_module("torchao.optim"), class_name)
        optimizer: torch.optim.Optimizer = cls([p for _, p in named], lr=lr, weight_decay=weight_decay)
        return optimizer

    return build


_REGISTRY: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry(
            "adamw", "torch.optim.AdamW (fused where torch supports it), fp32 state", _build_adamw, _always_available
        ),
        OptimizerEntry(
            "gefen",
            "gefen_core.Gefen, defaults (factored v for matrices at least 128 wide, Adam's v for narrower ones, block-shared state for 1-D tensors)",
            _gefen_builder(),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-clipped",
            "gefen_core.Gefen(clip_threshold=1.0): Adafactor's update clipping of factored matrices",
            _gefen_builder(clip_threshold=1.0),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-factor-all",
            "ablation: Gefen with min_dim_size_to_factor=0 (every matrix factored, as before 0.3)",
            _gefen_builder(min_dim_size_to_factor=0),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-block",
            "gefen_core.Gefen(factored_v_2d=False): block-shared v everywhere",
            _gefen_builder(factored_v_2d=False),
            _always_available,
        ),
        # Ablations of Gefen's compressions (each switches one of them off, see docs/benchmarks.md).
        OptimizerEntry(
            "gefen-dense-1d",
            "ablation: Gefen with per-element v and exact momentum for 1-D tensors (norms, biases)",
            _gefen_builder(force_1d_period_one=True),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-dense-embed",
            "ablation: Gefen with exact momentum (per-element blocks) for the embeddings and the output head; "
            "their v stays factored (per-element only with factored_v_2d=False)",
            _gefen_builder(period_one_substrings=("embedding", "head")),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-exact-m",
            "ablation: Gefen with exact (unquantised) momentum everywhere; v stays factored/blocked by kind",
            _gefen_builder(force_1d_period_one=True, force_2d_period_one=True),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-sr",
            "ablation: Gefen with unbiased stochastic rounding of the momentum codes",
            _gefen_builder(stochastic_round=True),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-p1",
            "ablation: Gefen with every compression off (per-element v and exact momentum): AdamW through Gefen's code",
            _gefen_builder(force_1d_period_one=True, force_2d_period_one=True, factored_v_2d=False),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-muon-hybrid",
            "gefen.GefenMuonHybrid: GefenMuon for hidden matrices, Gefen (defaults) for the rest",
            _hybrid_builder("gefen"),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-muon-hybrid-adamw",
            "gefen.GefenMuonHybrid(backup_optimizer='adamw'): GefenMuon plus ContractedAdamW (fp32 state)",
            _hybrid_builder("adamw"),
            _always_available,
        ),
        # The Muon options the hybrid's defaults leave out, one at a time and together.
        OptimizerEntry(
            "gefen-muon-hybrid-tuned3",
            "ablation: gefen.GefenMuonHybrid with 3 tuned Newton-Schulz steps (ns_schedule='tuned3') instead of 5",
            _hybrid_builder("gefen", ns_schedule="tuned3"),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-muon-hybrid-normuon",
            "ablation: gefen.GefenMuonHybrid with NorMuon's row normalisation (normuon=True)",
            _hybrid_builder("gefen", normuon=True),
            _always_available,
        ),
        OptimizerEntry(
            "gefen-muon-hybrid-reference",
            "ablation: gefen.GefenMuonHybrid with the reference hybrid's defaults (tuned3 and NorMuon)",
            _hybrid_builder("gefen", ns_schedule="tuned3", normuon=True),
            _always_available,
        ),
        OptimizerEntry(
            "muon-adamw",
            "torch.optim.Muon (match_rms_adamw) for hidden matrices + torch AdamW for the rest, the hybrid's routing",
            _muon_with(_build_adamw),
            _always_available,
        ),
        OptimizerEntry(
            "adamw-4bit",
            "torchao.optim.AdamW4bit (optional dependency)",
            _torchao_builder("AdamW4bit"),
            _torchao_unavailable,
        ),
        OptimizerEntry(
            "adamw-8bit",
            "torchao.optim.AdamW8bit (optional dependency)",
            _torchao_builder("AdamW8bit"),
            _torchao_unavailable,
        ),
        *_ladder_entries(),
        *_backup_ladder_entries(),
    )
}


def optimizer_names() -> tuple[str, ...]:
    """Every registered name, available here or not."""
    return tuple(_REGISTRY)


def get_optimizer(name: str) -> OptimizerEntry:
    """The entry for ``name`` (:class:`UnknownOptimizerError` lists the known names)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownOptimizerError(f"unknown optimizer {name!r}; known: {', '.join(_REGISTRY)}") from None


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot be built in this environment, or ``None`` when it can."""
    return get_optimizer(name).unavailable()


def build_optimizer(
    name: str, named_parameters: NamedParameters, *, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over ``named_parameters``; ``RuntimeError`` says why if unavailable."""
    entry = get_optimizer(name)
    reason = entry.unavailable()
    if reason is not None:
        raise RuntimeError(f"optimizer {name!r} is not available here: {reason}")
    return entry.build(list(named_parameters), lr, weight_decay)

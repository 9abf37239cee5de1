"""Optimizer arms of the checkpoint benchmarks (``bench dcp``, ``bench portable``), by name.

An arm is a name of :mod:`gefen.bench.optimizers` (``gefen``, ``adamw``, ...), one of the
extra names below, or ``MODULE:FACTORY`` where ``FACTORY(named_parameters)`` returns an
optimizer (the conformance kit's factory). :func:`claim_status` builds the arm on a tiny
model and says whether its contract claims a feature, so a benchmark can skip an arm with
the contract's own reason until the optimizer implements the Protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from gefen_contracts.protocols import ContractProvider
from gefen_contracts.testing import import_attribute

__all__ = ["EXTRA_ARMS", "MAX_RANKS", "build_arm", "build_status", "check_arm", "check_ranks", "claim_status"]

NamedParameters = Sequence[tuple[str, torch.nn.Parameter]]


def _contracted_adamw(named: NamedParameters) -> torch.optim.Optimizer:
    from gefen_hybrid import ContractedAdamW

    return ContractedAdamW(list(named), lr=1e-3, weight_decay=0.01)


def _int8_sgd(named: NamedParameters) -> torch.optim.Optimizer:
    from gefen_dcp.testing import conformance_factory

    return conformance_factory(list(named))


#: Arms that are not in the training registry of :mod:`gefen.bench.optimizers`:
#: ``contracted-adamw`` (gefen-hybrid's ``ContractedAdamW``) and ``int8-sgd`` (gefen-dcp's
#: reference parameter-shaped adopter ``Int8MomentumSGD``, about 1 B/param of state).
EXTRA_ARMS: dict[str, Callable[[NamedParameters], torch.optim.Optimizer]] = {
    "contracted-adamw": _contracted_adamw,
    "int8-sgd": _int8_sgd,
}


def _resolve(spec: str) -> Callable[..., Any]:
    target: Any = import_attribute(spec)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


#: The most ranks a checkpoint benchmark starts (each is a process of its own).
MAX_RANKS = 8


def check_arm(name: str) -> None:
    """``ValueError`` when arm ``name`` names nothing: neither a registered optimizer nor an
    extra arm, or a ``MODULE:FACTORY`` that does not import. A typo would otherwise run the
    whole baseline and end in a note, as an arm that cannot run *here* (no GPU) rightly does."""
    if ":" in name:
        try:
            _resolve(name)
        except Exception as exc:
            raise ValueError(f"arm {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
        return
    from .optimizers import optimizer_names

    if name not in EXTRA_ARMS and name not in optimizer_names():
        known = ", ".join((*optimizer_names(), *EXTRA_ARMS))
        raise ValueError(f"unknown arm {name!r}; known: {known}, or MODULE:FACTORY")


def check_ranks(ranks: Sequence[int], where: str) -> None:
    """World sizes: ints in ``[1, MAX_RANKS]``, at least one."""
    if not ranks or any(type(n) is not int or not 1 <= n <= MAX_RANKS for n in ranks):
        raise ValueError(f"{where} must be ints from 1 to {MAX_RANKS} (each rank is a process), got {list(ranks)!r}")


def build_arm(name: str, named: NamedParameters) -> torch.optim.Optimizer:
    """Build arm ``name`` over ``named`` (module docstring)."""
    if ":" in name:
        optimizer: torch.optim.Optimizer = _resolve(name)(list(named))
        return optimizer
    if name in EXTRA_ARMS:
        return EXTRA_ARMS[name](named)
    from .optimizers import build_optimizer

    return build_optimizer(name, named, lr=1e-3, weight_decay=0.01)


def _toy_build(name: str) -> torch.optim.Optimizer | str:
    """Arm ``name`` built over a toy model, or why it cannot be built here."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    try:
        return build_arm(name, list(model.named_parameters()))
    except Exception as exc:
        return f"cannot be built here ({type(exc).__name__}: {exc})"


def build_status(name: str) -> str | None:
    """``None`` when arm ``name`` can be built here; otherwise why not."""
    built = _toy_build(name)
    return built if isinstance(built, str) else None


def claim_status(name: str, feature: str) -> str | None:
    """``None`` when arm ``name``'s contract claims ``feature``; otherwise why not."""
    optimizer = _toy_build(name)
    if isinstance(optimizer, str):
        return optimizer
    if not isinstance(optimizer, ContractProvider):
        return "it publishes no optimizer contract"
    status = optimizer.optimizer_contract().capabilities.feature(feature)
    if status.supported:
        return None
    return f"its contract does not claim {feature} ({'; '.join(status.reasons) or 'no reason given'})"

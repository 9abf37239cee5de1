"""What a conformance check receives, and the Protocol a contributed check implements."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..contract import OptimizerContract
from .target import ConformanceTarget

__all__ = ["CheckContext", "ConformanceCheck", "Unverifiable", "assert_tensors_bitwise_equal"]


class Unverifiable(Exception):
    """Raised by a check that cannot execute in this environment; the claim stays UNVERIFIED."""


@runtime_checkable
class ConformanceCheck(Protocol):
    """A check the kit runs. Packages contribute them through ``gefen.conformance``.

    ``name`` is unique and stable (used in reports and waivers). ``covers(claims)`` returns
    the subset of the contract's claims this check verifies (empty: not applicable; the
    name ``"contract"`` is always among the claims). ``run(context)`` raises
    ``AssertionError`` (or any exception) on failure and :class:`Unverifiable` when it
    cannot execute here.
    """

    name: str

    def covers(self, claims: frozenset[str]) -> frozenset[str]: ...

    def run(self, context: CheckContext) -> None: ...


@dataclass
class CheckContext:
    """Helpers shared by checks: fresh twins, deterministic training, state round trips."""

    target: ConformanceTarget
    contract: OptimizerContract
    claims: frozenset[str]
    notes: list[str] = field(default_factory=list)

    def fresh(self, seed: int = 0, dtype: torch.dtype | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A new model (in ``dtype`` when given) and optimizer; equal seeds give bit-identical twins."""
        torch.manual_seed(seed)
        return self.target.build(seed, dtype)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step_index: int) -> torch.Tensor:
        """One deterministic training step (zero_grad, loss, backward, step)."""
        optimizer.zero_grad(set_to_none=True)
        loss = self.target.loss_fn(model, step_index)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return loss.detach()

    def train(self, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
        for index in range(start, start + steps):
            self.step(model, optimizer, index)

    def trained(self, steps: int | None = None, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optimizer = self.fresh(seed)
        self.train(model, optimizer, self.target.steps if steps is None else steps)
        return model, optimizer

    @staticmethod
    def weights_only_roundtrip(value: Any) -> Any:
        """Serialise with ``torch.save`` and load back with ``weights_only=True``."""
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    @staticmethod
    def copy_parameters(source: nn.Module, target: nn.Module) -> None:
        with torch.no_grad():
            for (name_a, a), (name_b, b) in zip(source.named_parameters(), target.named_parameters(), strict=True):
                assert name_a == name_b
                b.copy_(a)

    @staticmethod
    def assert_models_bitwise_equal(a: nn.Module, b: nn.Module, what: str) -> None:
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert_tensors_bitwise_equal(pa, pb, f"{what}: parameter {name!r}")


def assert_tensors_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    # flat first: a byte view of a 0-dim tensor (a temperature, a logit scale) is refused
    ua, ub = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if not torch.equal(ua.view(torch.uint8), ub.view(torch.uint8)):
        diff = (ua.double() - ub.double()).abs().max().item() if ua.numel() else 0.0
        raise AssertionError(f"{what}: values differ (max abs diff {diff:.3e})")

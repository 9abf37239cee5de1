"""What the kit runs against: an optimizer factory plus, optionally, a model builder."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .model import kit_loss, make_kit_model

__all__ = ["ConformanceTarget", "Factory", "import_attribute", "load_target"]

Factory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


@dataclass(frozen=True)
class ConformanceTarget:
    """An optimizer under test.

    ``factory(named_parameters)`` builds the optimizer; ``model_builder(seed)`` builds the
    model whose parameters it gets (the kit's :class:`~gefen_contracts.testing.model.KitModel`
    by default) and ``loss_fn(model, step)`` a deterministic loss. ``spec`` is the importable
    ``"MODULE:ATTRIBUTE"`` the target came from, which multi-process checks need (a spawned
    rank cannot receive a closure). ``waive`` names claims or checks the caller accepts as
    unverified, each with a reason (``{"claim-or-check": "why"}``).
    """

    factory: Factory
    name: str = "optimizer"
    model_builder: Callable[[int], nn.Module] = make_kit_model
    loss_fn: Callable[[nn.Module, int], torch.Tensor] = kit_loss
    spec: str | None = None
    waive: dict[str, str] = field(default_factory=dict)
    steps: int = 3

    def build(self, seed: int = 0, dtype: torch.dtype | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh model (deterministic for ``seed``; cast to ``dtype`` when given) and the
        optimizer over its named parameters."""
        model = self.model_builder(seed)
        if dtype is not None:
            model = model.to(dtype)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        return model, self.factory(named)

    def with_waivers(self, waive: Iterable[str] | dict[str, str]) -> ConformanceTarget:
        extra = dict(waive) if isinstance(waive, dict) else {name: "waived on the command line" for name in waive}
        return ConformanceTarget(
            self.factory, self.name, self.model_builder, self.loss_fn, self.spec, {**self.waive, **extra}, self.steps
        )


def import_attribute(spec: str) -> Any:
    """The object ``"MODULE:ATTRIBUTE"`` names (``ATTRIBUTE`` may be dotted).

    The current directory is importable, as for ``python -m``, so a module next to the user's
    script is found by ``gefen conformance``, ``pytest --gefen-conformance`` (whose ``pytest``
    script does not put it on ``sys.path``) and the kit's rank processes alike. ``ValueError``
    for a spec that is not of that form; the import's own ``ImportError`` or
    ``AttributeError`` otherwise (callers turn them into their usage errors).
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected MODULE:ATTRIBUTE, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


def load_target(spec: str) -> ConformanceTarget:
    """Resolve ``"MODULE:ATTRIBUTE"`` to a target.

    The attribute may be a :class:`ConformanceTarget`, or a factory callable; a factory may
    carry ``conformance_model_builder`` / ``conformance_loss`` / ``conformance_waive``
    attributes to customise the target.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:  # checked here: the import's own ValueError is the user's
        raise ValueError(f"a conformance target must be given as MODULE:FACTORY, got {spec!r}")
    obj = import_attribute(spec)
    if isinstance(obj, ConformanceTarget):
        return obj if obj.spec is not None else _respec(obj, spec)
    if not callable(obj):
        raise TypeError(f"{spec} is neither a ConformanceTarget nor a callable factory")
    return ConformanceTarget(
        factory=obj,
        name=spec,
        model_builder=getattr(obj, "conformance_model_builder", make_kit_model),
        loss_fn=getattr(obj, "conformance_loss", kit_loss),
        spec=spec,
        waive=dict(getattr(obj, "conformance_waive", {})),
    )


def _respec(target: ConformanceTarget, spec: str) -> ConformanceTarget:
    return ConformanceTarget(
        target.factory, target.name, target.model_builder, target.loss_fn, spec, target.waive, target.steps
    )

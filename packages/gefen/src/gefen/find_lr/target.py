"""What ``gefen find-lr`` runs on: a model, a stream of batches and a loss.

A user target is ``MODULE:FUNCTION``; ``FUNCTION()`` returns ``(model, batches)`` or
``(model, batches, loss_fn)``. ``batches`` is any iterable (an iterator, a ``DataLoader``,
a generator); the test draws one batch per step. ``loss_fn(model, batch)`` returns a scalar
loss tensor; without it the model's own output is the loss: ``model(*batch)`` for a tuple or
list batch, ``model(**batch)`` for a dict, ``model(batch)`` otherwise.

The default target, :func:`demo_target`, is ``gefen demo``'s ``small`` decoder (0.81M
parameters) on tinylang characters, 16 random windows of 64 tokens per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts.testing import import_attribute

__all__ = ["DEFAULT_TARGET", "LRTestTarget", "TargetError", "default_loss", "demo_target", "load_target"]

DEFAULT_TARGET = "gefen.find_lr.target:demo_target"


class TargetError(ValueError):
    """A target that cannot be loaded or does not return what the range test needs."""


def default_loss(model: torch.nn.Module, batch: object) -> torch.Tensor:
    """The model's output on ``batch`` (module docstring), which must be the scalar loss."""
    if isinstance(batch, (tuple, list)):
        out = model(*batch)
    elif isinstance(batch, Mapping):
        out = model(**batch)
    else:
        out = model(batch)
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise TargetError(
            "without a loss function the model's output must be a scalar loss tensor; return "
            "(model, batches, loss_fn) from the target to compute one"
        )
    return out


@dataclass(frozen=True, slots=True)
class LRTestTarget:
    """A loaded target: the model, its batches and the loss function."""

    model: torch.nn.Module
    batches: Iterable[object]
    loss_fn: Callable[[torch.nn.Module, object], torch.Tensor]
    name: str


def load_target(spec: str) -> LRTestTarget:
    """Import ``MODULE:FUNCTION``, call it and check what it returned (:class:`TargetError` says why not)."""
    try:
        target: Any = import_attribute(spec)
    except ValueError:
        raise TargetError(f"a target must be MODULE:FUNCTION, got {spec!r}") from None
    except (ImportError, AttributeError) as exc:
        raise TargetError(f"cannot load {spec}: {type(exc).__name__}: {exc}") from None
    if not callable(target):
        raise TargetError(f"{spec} is not callable")
    returned = target()
    if not isinstance(returned, tuple) or len(returned) not in (2, 3):
        raise TargetError(f"{spec}() must return (model, batches) or (model, batches, loss_fn)")
    model, batches = returned[0], returned[1]
    loss_fn = returned[2] if len(returned) == 3 else default_loss
    if not isinstance(model, torch.nn.Module):
        raise TargetError(f"{spec}() returned a {type(model).__name__} as the model; expected a torch.nn.Module")
    if not isinstance(batches, Iterable):
        raise TargetError(f"{spec}() returned a {type(batches).__name__} as the batches; expected an iterable")
    if not callable(loss_fn):
        raise TargetError(f"{spec}() returned a non-callable loss function")
    return LRTestTarget(model, batches, loss_fn, spec)


def _demo_batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from ..demo.data import load_tinylang, sample_batch

    tokens = load_tinylang("char").train
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield sample_batch(tokens, 16, 64, generator)


def _decoder_loss(model: torch.nn.Module, batch: object) -> torch.Tensor:
    assert isinstance(batch, tuple) and len(batch) == 2
    loss: torch.Tensor = model.loss(batch[0], batch[1])  # type: ignore[operator]
    return loss


def demo_target() -> tuple[torch.nn.Module, Iterator[tuple[torch.Tensor, torch.Tensor]], Callable[..., torch.Tensor]]:
    """``gefen demo``'s small decoder on tinylang characters (seeded)."""
    from ..demo.data import load_tinylang
    from ..demo.model import TinyDecoder, preset

    torch.manual_seed(0)
    model = TinyDecoder(preset("small").with_vocab(load_tinylang("char").tokenizer.vocab_size))
    return model, _demo_batches(0), _decoder_loss

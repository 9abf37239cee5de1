"""Decoder shapes for the checkpoint benchmarks: presets and "N million parameters".

``bench_decoder("decoder-50m")`` is a preset of :mod:`gefen.demo.model` with its vocabulary
filled in (256 tokens for ``tiny``, 2048 for the other small presets); ``bench_decoder("100m")``
is a decoder with an 8192-token vocabulary, context 256 and heads of 64 dimensions near 100
million parameters: the width (256 to 1024 in steps of 128) whose usual depth of width / 64
layers comes nearest, then as many layers (at least one) as come nearest. A size the family
cannot come within a quarter of (below about 4 million: one layer of width 256 has 5.05
million) is refused rather than measured as another size.
"""

from __future__ import annotations

import math
import re

from ..demo.model import MODEL_PRESETS, DecoderConfig

__all__ = ["bench_decoder", "sized_decoder"]

_SIZED = re.compile(r"^(\d+(?:\.\d+)?)m$")
_SIZED_VOCAB = 8192
_SIZED_CONTEXT = 256
#: How far (relative) the decoder built may be from the size asked for.
_SIZE_TOLERANCE = 0.25


def _config(width: int, layers: int) -> DecoderConfig:
    return DecoderConfig(width, layers, width // 64, _SIZED_CONTEXT, _SIZED_VOCAB)


def sized_decoder(parameters: int) -> DecoderConfig:
    """The decoder of about ``parameters`` parameters with a usual aspect (module docstring)."""
    if type(parameters) is not int or parameters < 1:
        raise ValueError(f"parameters must be a positive int, got {parameters!r}")
    # The width whose usual depth (width / 64 layers) comes nearest in log scale, then the depth.
    widths = range(256, 1025, 128)
    width = min(widths, key=lambda w: abs(math.log(_config(w, w // 64).parameter_count() / parameters)))
    one = _config(width, 1).parameter_count()
    per_layer = _config(width, 2).parameter_count() - one
    config = _config(width, max(1, round((parameters - one) / per_layer) + 1))
    built = config.parameter_count()
    if abs(built - parameters) > _SIZE_TOLERANCE * parameters:
        raise ValueError(
            f"no decoder of the sized family comes within {_SIZE_TOLERANCE:.0%} of {parameters:,} parameters "
            f"(the nearest has {built:,}, the smallest {_config(256, 1).parameter_count():,}); use a larger size or a preset"
        )
    return config


def bench_decoder(name: str) -> DecoderConfig:
    """A preset (vocabulary filled in) or ``"<N>m"`` (``ValueError`` names the known forms)."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name].with_vocab(256 if name == "tiny" else 2048)
    match = _SIZED.match(name)
    if match is None:
        raise ValueError(f"unknown model {name!r}; use a preset ({', '.join(MODEL_PRESETS)}) or a size such as 10m")
    return sized_decoder(round(float(match.group(1)) * 1_000_000))

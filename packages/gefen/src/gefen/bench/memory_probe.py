"""The fresh-process side of ``gefen bench memory``: one model, one optimizer, a few real steps.

``python -m gefen.bench.memory_probe SPEC.json RESULT.json``. The parent starts it with
glibc's malloc told to map large blocks directly (``MALLOC_MMAP_THRESHOLD_``) so freed
buffers go back to the system and a step's transient shows up as new resident pages
instead of hiding in reused heap space.

Per step it computes real gradients (forward and backward on a batch), then measures the
optimizer step alone: resident memory just before ``step()`` (after a garbage collection
and ``malloc_trim``) and the peak during it. State bytes are counted after the last step.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ProbeResult", "ProbeSpec"]


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """One measurement: a model preset and an optimizer, ``steps`` steps of real gradients."""

    model_size: str
    optimizer: str
    steps: int = 3
    batch_size: int = 2
    sequence_length: int = 64
    seed: int = 0
    threads: int = 0


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Bytes are exact storage sizes (state) or resident-set differences (steps)."""

    parameters: int
    state_bytes: int
    state_bytes_by_kind: dict[str, int]
    step_transient_bytes: list[int]
    resident_before_step_bytes: list[int]
    peak_resettable: bool


def _trim_heap() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _main(spec_path: str, result_path: str) -> int:
    import torch
    from gefen_contracts.torch_support import count_state_bytes

    from ..demo.data import load_tinylang, sample_batch
    from ..demo.model import TinyDecoder, preset
    from .optimizers import build_optimizer
    from .rss import ResidentMemory

    spec = ProbeSpec(**json.loads(Path(spec_path).read_text(encoding="utf-8")))
    if spec.threads:
        torch.set_num_threads(spec.threads)
    shape = preset(spec.model_size)
    generator = torch.Generator().manual_seed(spec.seed)
    tokens: torch.Tensor | None = None
    if not shape.vocab_size:  # a demo-sized model trains on tinylang characters
        data = load_tinylang("char")
        shape = shape.with_vocab(data.tokenizer.vocab_size)
        tokens = data.train
    length = min(spec.sequence_length, shape.context)
    torch.manual_seed(spec.seed)
    model = TinyDecoder(shape)
    named = list(model.named_parameters())
    optimizer = build_optimizer(spec.optimizer, named, lr=1e-3, weight_decay=0.01)

    transients: list[int] = []
    before: list[int] = []
    resettable = True
    for _ in range(spec.steps):
        if tokens is not None:
            x, y = sample_batch(tokens, spec.batch_size, length, generator)
        else:
            x = torch.randint(0, shape.vocab_size, (spec.batch_size, length), generator=generator)
            y = torch.randint(0, shape.vocab_size, (spec.batch_size, length), generator=generator)
        optimizer.zero_grad(set_to_none=False)
        torch.autograd.backward(model.loss(x, y))
        _trim_heap()
        start = ResidentMemory.current() or 0
        resettable = ResidentMemory.reset_peak() and resettable
        optimizer.step()
        peak = ResidentMemory.peak()
        before.append(start)
        transients.append(max(0, peak - start))
    counted = count_state_bytes(optimizer, parameter_names={id(p): n for n, p in named})
    result = ProbeResult(
        parameters=counted.parameters,
        state_bytes=counted.total,
        state_bytes_by_kind=counted.by_kind(),
        step_transient_bytes=transients,
        resident_before_step_bytes=before,
        peak_resettable=resettable,
    )
    Path(result_path).write_text(json.dumps(asdict(result)), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))

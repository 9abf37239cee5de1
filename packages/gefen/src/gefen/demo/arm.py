"""One arm of the demo (one optimizer), run in a fresh process so its peak memory is its own.

``python -m gefen.demo.arm SPEC.json RESULT.json`` trains as the spec says, shows a progress
bar on stderr and writes the result as JSON. :func:`run_arm` is the parent's side.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..bench.fresh_process import run_fresh

__all__ = ["ArmResult", "ArmSpec", "run_arm"]


@dataclass(frozen=True, slots=True)
class ArmSpec:
    """What one arm trains: a preset model on tinylang with one optimizer."""

    optimizer: str
    lr: float
    steps: int
    model_size: str
    tokenization: str
    batch_size: int
    seed: int
    eval_every: int
    weight_decay: float = 0.01
    threads: int = 0


@dataclass(frozen=True, slots=True)
class ArmResult:
    """The arm's measurements (losses in nats per token, memory in bytes)."""

    optimizer: str
    lr: float
    parameters: int
    train_curve: list[list[float]]
    eval_curve: list[list[float]]
    valid_loss: float
    test_loss: float
    tokens_per_s: float
    optimizer_step_s: float
    state_bytes: int
    state_bytes_by_kind: dict[str, int]
    peak_rss_bytes: int
    start_rss_bytes: int
    wall_s: float
    diverged: bool


def _main(spec_path: str, result_path: str) -> int:
    import time

    import torch

    from ..bench.rss import ResidentMemory
    from .data import load_tinylang
    from .model import preset
    from .train import TrainConfig, train

    spec = ArmSpec(**json.loads(Path(spec_path).read_text(encoding="utf-8")))
    if spec.threads:
        torch.set_num_threads(spec.threads)
    data = load_tinylang("word" if spec.tokenization == "word" else "char")
    start_rss = ResidentMemory.current() or 0
    ResidentMemory.reset_peak()
    started = time.perf_counter()
    result = train(
        preset(spec.model_size),
        data,
        TrainConfig(
            optimizer=spec.optimizer,
            lr=spec.lr,
            steps=spec.steps,
            batch_size=spec.batch_size,
            seed=spec.seed,
            weight_decay=spec.weight_decay,
            eval_every=spec.eval_every,
        ),
        progress=True,
        description=f"{spec.optimizer:<11}",
    )
    arm = ArmResult(
        optimizer=spec.optimizer,
        lr=spec.lr,
        parameters=result.parameters,
        train_curve=[[s, v] for s, v in result.train_curve],
        eval_curve=[[s, v] for s, v in result.eval_curve],
        valid_loss=result.final_loss["valid"],
        test_loss=result.final_loss["test"],
        tokens_per_s=result.tokens_per_s,
        optimizer_step_s=result.optimizer_step_s,
        state_bytes=result.state_bytes,
        state_bytes_by_kind=dict(result.state_bytes_by_kind),
        peak_rss_bytes=ResidentMemory.peak(),
        start_rss_bytes=start_rss,
        wall_s=time.perf_counter() - started,
        diverged=result.diverged,
    )
    Path(result_path).write_text(json.dumps(asdict(arm)), encoding="utf-8")
    return 0


def run_arm(spec: ArmSpec) -> ArmResult:
    """Run ``spec`` in a fresh interpreter (progress on this process's stderr) and return its result."""
    raw = run_fresh("gefen.demo.arm", asdict(spec), label=f"demo arm {spec.optimizer!r}")
    return ArmResult(**raw)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))

"""One training run of a :class:`~gefen.demo.model.TinyDecoder` with a named optimizer.

The recipe is the same for every optimizer (that is the point of a comparison): a seeded
model initialisation and batch order shared by every optimizer at a given seed, linear
warm-up then cosine decay to 10 % of the peak learning rate, gradient clipping at norm 1,
decoupled weight decay, and evaluation on fixed windows of the ``valid`` and ``test`` splits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from gefen_contracts.torch_support import count_state_bytes
from tqdm import tqdm  # type: ignore[import-untyped]

from ..bench.optimizers import build_optimizer
from .data import SPLITS, TokenSplits, eval_windows, sample_batch
from .model import DecoderConfig, TinyDecoder

__all__ = ["TrainConfig", "TrainResult", "evaluate", "train"]


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Everything that defines one run besides the model shape and the data."""

    optimizer: str
    lr: float
    steps: int
    batch_size: int = 16
    seed: int = 0
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05
    min_lr_fraction: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 0
    eval_windows: int = 64
    #: Where the model, the batches and the optimizer state live (``"cpu"`` or ``"cuda"``).
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"TrainConfig.device must be 'cpu' or 'cuda', got {self.device!r}")
        if not (isinstance(self.lr, float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"TrainConfig.lr must be a positive finite float, got {self.lr!r}")
        for name in ("steps", "batch_size", "eval_windows"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        if type(self.eval_every) is not int or self.eval_every < 0:
            raise ValueError(f"TrainConfig.eval_every must be a non-negative int, got {self.eval_every!r}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"TrainConfig.warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak learning rate for update ``step`` (0-based)."""
        warmup = max(1, round(self.warmup_fraction * self.steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.min_lr_fraction + (1.0 - self.min_lr_fraction) * cosine


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What one run measured. Curves are ``(step, loss)`` pairs; losses in nats per token."""

    optimizer: str
    lr: float
    seed: int
    parameters: int
    train_curve: tuple[tuple[int, float], ...]
    eval_curve: tuple[tuple[int, float], ...]
    final_loss: Mapping[str, float]
    tokens_per_s: float
    optimizer_step_s: float
    state_bytes: int
    state_bytes_by_kind: Mapping[str, int] = field(default_factory=dict)
    diverged: bool = False

    @property
    def state_bytes_per_param(self) -> float:
        return self.state_bytes / self.parameters


@torch.no_grad()
def evaluate(model: TinyDecoder, tokens: torch.Tensor, windows: int, batch_size: int = 32) -> float:
    """Mean next-token loss over ``windows`` fixed windows of ``tokens`` (model left in train mode)."""
    inputs, targets = eval_windows(tokens, windows, model.config.context)
    model.eval()
    total = 0.0
    device = next(model.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    for start in range(0, windows, batch_size):
        x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
        total += float(model.loss(x, y)) * x.shape[0]
    model.train()
    return total / windows


def train(
    model_config: DecoderConfig,
    data: TokenSplits,
    config: TrainConfig,
    *,
    progress: bool = False,
    description: str | None = None,
    final_splits: tuple[str, ...] = SPLITS[1:],
) -> TrainResult:
    """Train from scratch and evaluate. A run whose loss becomes non-finite stops early and is
    marked ``diverged`` (its final losses are ``inf``), so a learning-rate sweep can go on."""
    shape = model_config.with_vocab(data.tokenizer.vocab_size)
    torch.manual_seed(config.seed)
    # Initialised on the CPU (the same weights whatever the device), then moved.
    model = TinyDecoder(shape).to(config.device)
    named = list(model.named_parameters())
    optimizer = build_optimizer(config.optimizer, named, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor)
    batches = torch.Generator().manual_seed(10_000 + config.seed)
    tokens_per_step = config.batch_size * shape.context

    train_curve: list[tuple[int, float]] = []
    eval_curve: list[tuple[int, float]] = []
    step_time = 0.0
    compute_time = 0.0
    # Throughput leaves out the first steps, where lazy state creation and compilation happen.
    warmup_steps = min(5, config.steps // 5)
    diverged = False
    bar = tqdm(
        total=config.steps,
        desc=description or config.optimizer,
        disable=not progress,
        unit="step",
        dynamic_ncols=True,
        leave=True,
    )
    on_gpu = config.device == "cuda"

    def sync() -> None:
        # On a GPU the clock needs the queued work finished, or it times the launches only.
        if on_gpu:
            torch.cuda.synchronize()

    try:
        for step in range(config.steps):
            started = time.perf_counter()
            x, y = sample_batch(data.train, config.batch_size, shape.context, batches)
            x, y = x.to(config.device), y.to(config.device)
            loss = model.loss(x, y)
            torch.autograd.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            sync()
            step_started = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            sync()
            finished = time.perf_counter()
            if step >= warmup_steps:
                step_time += finished - step_started
                compute_time += finished - started
            value = float(loss.detach())
            train_curve.append((step + 1, value))
            if not math.isfinite(value):
                diverged = True
                break
            if config.eval_every and ((step + 1) % config.eval_every == 0 or step + 1 == config.steps):
                eval_curve.append((step + 1, evaluate(model, data.valid, config.eval_windows)))
                bar.set_postfix(loss=f"{value:.3f}", valid=f"{eval_curve[-1][1]:.3f}")
            elif (step + 1) % 10 == 0:
                bar.set_postfix(loss=f"{value:.3f}")
            bar.update(1)
    finally:
        bar.close()

    names = {id(p): name for name, p in named}
    counted = count_state_bytes(optimizer, parameter_names=names)
    if diverged:
        final = {split: math.inf for split in final_splits}
    else:
        final = {split: evaluate(model, data.split(split), config.eval_windows) for split in final_splits}
    timed_steps = max(0, len(train_curve) - warmup_steps)
    return TrainResult(
        optimizer=config.optimizer,
        lr=config.lr,
        seed=config.seed,
        parameters=sum(p.numel() for _, p in named),
        train_curve=tuple(train_curve),
        eval_curve=tuple(eval_curve),
        final_loss=final,
        tokens_per_s=timed_steps * tokens_per_step / compute_time if compute_time > 0 else 0.0,
        optimizer_step_s=step_time / timed_steps if timed_steps else 0.0,
        state_bytes=counted.total,
        state_bytes_by_kind=counted.by_kind(),
        diverged=diverged,
    )

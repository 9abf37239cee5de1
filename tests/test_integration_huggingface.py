"""Hugging Face ``Trainer`` with a tiny config-built Llama (no download) on CPU.

* ``Gefen`` through ``optimizer_cls_and_kwargs`` (Trainer builds it from its own decay /
  no-decay parameter groups);
* ``GefenMuonHybrid`` built from the model and passed through ``optimizers=(optimizer, None)``
  (Trainer adds its linear schedule over the hybrid's live ``param_groups``), with each backup.

Resume: the Trainer saves ``optimizer.state_dict()`` with ``torch.save`` and loads it back with
``torch.load(..., weights_only=True)`` into a fresh optimizer, together with the model weights,
the scheduler, the RNG states and the data position. A run interrupted at a checkpoint and
resumed ends bit-identical (weights and optimizer state) to the uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen import Gefen, GefenMuonHybrid

transformers = pytest.importorskip("transformers")  # in the workspace's dev group: present in CI

pytestmark = pytest.mark.slow

_VOCAB = 48
_STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _tiny_llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sixteen fixed sequences with a learnable pattern (token i+1 follows token i)."""

    def __init__(self) -> None:
        starts = torch.randint(0, _VOCAB, (16, 1), generator=torch.Generator().manual_seed(3))
        self.rows = (starts + torch.arange(12)) % _VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def _arguments(output_dir: Path, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": _STEPS,
        "per_device_train_batch_size": 4,
        "learning_rate": 3e-3,
        "weight_decay": 0.01,
        "warmup_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "data_seed": 0,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    options.update(overrides)
    return transformers.TrainingArguments(**options)


#: How each case hands its optimizer to the Trainer: (model, arguments) -> Trainer keywords.
TrainerOptimizer = Callable[[Any, Any], dict[str, Any]]


def _gefen_through_cls_and_kwargs(model: Any, arguments: Any) -> dict[str, Any]:
    return {"optimizer_cls_and_kwargs": (Gefen, {"lr": arguments.learning_rate})}


def _hybrid_through_optimizers(backup: str) -> TrainerOptimizer:
    def build(model: Any, arguments: Any) -> dict[str, Any]:
        optimizer = GefenMuonHybrid(
            model,
            lr=arguments.learning_rate,
            weight_decay=arguments.weight_decay,
            no_decay_substrings=("norm", "bias"),
            backup_optimizer=backup,
        )
        return {"optimizers": (optimizer, None)}

    return build


CASES: dict[str, TrainerOptimizer] = {
    "gefen via optimizer_cls_and_kwargs": _gefen_through_cls_and_kwargs,
    "hybrid (gefen backup) via optimizers=": _hybrid_through_optimizers("gefen"),
    "hybrid (adamw backup) via optimizers=": _hybrid_through_optimizers("adamw"),
}


def _trainer(output_dir: Path, case: str) -> Any:
    model = _tiny_llama()
    arguments = _arguments(output_dir)
    return transformers.Trainer(model=model, args=arguments, train_dataset=_Tokens(), **CASES[case](model, arguments))


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_trains_and_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(case: str, tmp_path: Path) -> None:
    full = _trainer(tmp_path / "full", case)
    full.train()
    optimizer = full.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps ours
    if case.startswith("hybrid"):
        assert isinstance(optimizer, GefenMuonHybrid)
        assert optimizer.muon is not None and optimizer.backup is not None
        # The tied embedding / LM head is one tensor, in the backup.
        embedding = full.model.model.embed_tokens.weight
        assert full.model.lm_head.weight is embedding
        assert any(p is embedding for group in optimizer.backup.param_groups for p in group["params"])
        # Trainer's linear schedule drove both halves to zero at the last step.
        assert [group["lr"] for group in optimizer.param_groups] == [0.0] * len(optimizer.param_groups)
    else:
        assert isinstance(optimizer, Gefen)
    losses = [entry["loss"] for entry in full.state.log_history if "loss" in entry]
    assert len(losses) == _STEPS and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0], f"{case} did not learn: {losses}"
    assert (tmp_path / "full" / "checkpoint-2" / "optimizer.pt").is_file()

    resumed = _trainer(tmp_path / "resumed", case)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == _STEPS
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), f"{case}: {name} differs after resuming"
    assert _same(optimizer.state_dict(), resumed.optimizer.optimizer.state_dict())

"""One rank of ``gefen bench dcp``: ``python -m gefen.bench.dcp_worker SPEC.json RANK RESULT.json``.

It builds the benchmark's decoder under FSDP2 ``fully_shard`` on a 1-D CPU mesh, takes two
optimizer steps on random tokens, then measures a synchronous ``dcp.save`` of the optimizer
(and the model with ``with_model``), a ``dcp.async_save`` (until the write completed, on a
separate gloo group) and a ``dcp.load`` into a freshly built model and optimizer. The arm
``torch-dcp-adamw`` is ``torch.optim.AdamW`` through ``get_state_dict`` / ``set_state_dict``
and DCP's stock planner and writer; every other arm saves its optimizer through
:class:`gefen_dcp.GefenDCPState` with the Gefen planners and writer.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["TORCH_ARM"]

TORCH_ARM = "torch-dcp-adamw"


def _train(model: Any, optimizer: Any, spec: Mapping[str, Any], steps: int) -> None:
    import torch

    vocab = model.config.vocab_size
    length = min(int(spec["sequence_length"]), model.config.context)
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (int(spec["batch_size"]), length + 1), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        model.loss(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _states(spec: Mapping[str, Any], model: Any, optimizer: Any) -> dict[str, Any]:
    if spec["arm"] == TORCH_ARM:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optimizer_state} if spec["with_model"] else {"optim": optimizer_state}
    from gefen_dcp import GefenDCPState

    state: dict[str, Any] = {"optim": GefenDCPState(optimizer, chunk_bytes=spec["chunk_bytes"])}
    if spec["with_model"]:
        state["model"] = model.state_dict()
    return state


def _save(spec: Mapping[str, Any], model: Any, optimizer: Any, path: Path, *, group: Any = None) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    state = _states(spec, model, optimizer)
    write: Callable[..., Any] = async_save if group is not None else save
    options: dict[str, Any] = {"process_group": group} if group is not None else {}
    if spec["arm"] == TORCH_ARM:
        return write(state, storage_writer=FileSystemWriter(path), **options)
    from gefen_dcp import GefenFileSystemWriter, GefenSavePlanner

    return write(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner(), **options)


def _load(spec: Mapping[str, Any], model: Any, optimizer: Any, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    state = _states(spec, model, optimizer)
    if spec["arm"] == TORCH_ARM:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state.get("model", {}), optim_state_dict=state["optim"])
        return
    from gefen_dcp import GefenLoadPlanner

    load(state, checkpoint_id=path, planner=GefenLoadPlanner())


def _async_saver(spec: Mapping[str, Any], model: Any, optimizer: Any, path: Path) -> Callable[[], None]:
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")  # async writes must not share a group with training collectives

    def run() -> None:
        future = _save(spec, model, optimizer, path, group=group)
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()

    return run


def _build(spec: Mapping[str, Any], mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    from ..demo.model import TinyDecoder
    from .checkpoint_arms import build_arm
    from .model_sizes import bench_decoder

    torch.manual_seed(0)
    model = TinyDecoder(bench_decoder(spec["model"]))
    fully_shard(model, mesh=mesh)
    if spec["arm"] == TORCH_ARM:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, build_arm(spec["arm"], list(model.named_parameters()))


def _local_numel(model: Any) -> int:
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += int(local.numel())
    return total


def _run(spec: Mapping[str, Any], rank: int) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .peak_memory import measure_operation
    from .rank_processes import join_group
    from .rss import ResidentMemory

    warnings.filterwarnings("ignore")
    join_group(spec, rank)
    try:
        mesh = init_device_mesh("cpu", (int(spec["world_size"]),))
        model, optimizer = _build(spec, mesh)
        _train(model, optimizer, spec, steps=2)
        path = Path(spec["root"]) / f"{spec['arm'].replace(':', '_')}-{spec['world_size']}"
        result: dict[str, Any] = {"local_parameters": _local_numel(model), "resident_bytes": ResidentMemory.current()}
        save = functools.partial(_save, spec, model, optimizer, path)
        result["save"] = measure_operation(save, barrier=dist.barrier).to_json()
        saver = _async_saver(spec, model, optimizer, Path(str(path) + "-async"))
        result["async_save"] = measure_operation(saver, barrier=dist.barrier).to_json()
        del optimizer, model, save
        gc.collect()
        fresh_model, fresh_optimizer = _build(spec, mesh)
        load = functools.partial(_load, spec, fresh_model, fresh_optimizer, path)
        result["load"] = measure_operation(load, barrier=dist.barrier).to_json()
        return result
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from .rank_processes import read_rank_arguments, write_rank_result

    spec, rank, result_path = read_rank_arguments(argv)
    write_rank_result(result_path, _run(spec, rank))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

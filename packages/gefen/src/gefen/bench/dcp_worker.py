"""One rank of ``gefen bench dcp``: ``python -m gefen.bench.dcp_worker SPEC.json RANK RESULT.json``.

It builds the benchmark's decoder under FSDP2 ``fully_shard`` on a 1-D CPU mesh, takes two
optimizer steps on random tokens, imports the checkpoint modules the arm's training script
would import at its top (``torch.distributed.checkpoint``, and ``gefen_dcp`` for the Gefen
arms; their resident cost is reported on its own as ``checkpoint_import_bytes``), then measures a synchronous ``dcp.save`` of the optimizer
(and the model with ``with_model``), a ``dcp.async_save`` (until the write completed, on a
separate gloo group) and a ``dcp.load`` into a freshly built model and optimizer, and the
bytes the synchronous checkpoint holds on disk. The arm ``torch-dcp-adamw`` is
``torch.optim.AdamW`` through ``get_state_dict`` / ``set_state_dict`` (flattened with the spec's
``flatten``) and DCP's stock planner and writer; an arm ``recipe:<arm>`` takes that same recipe with ``<arm>``'s optimizer; every
other arm saves its optimizer through :class:`gefen_dcp.GefenDCPState` with the Gefen
planners and writer.
"""

from __future__ import annotations

import functools
import gc
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["RECIPE_PREFIX", "TORCH_ARM", "through_torch_recipe"]

TORCH_ARM = "torch-dcp-adamw"
RECIPE_PREFIX = "recipe:"


def through_torch_recipe(arm: str) -> bool:
    """Whether ``arm`` saves through torch's ``get_state_dict`` / ``set_state_dict`` + stock DCP."""
    return arm == TORCH_ARM or arm.startswith(RECIPE_PREFIX)


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


def _recipe_options(spec: Mapping[str, Any]) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=bool(spec["flatten"]))


def _states(spec: Mapping[str, Any], model: Any, optimizer: Any) -> dict[str, Any]:
    if through_torch_recipe(spec["arm"]):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer, options=_recipe_options(spec))
        return {"model": model_state, "optim": optimizer_state} if spec["with_model"] else {"optim": optimizer_state}
    from gefen_dcp import GefenDCPState

    state: dict[str, Any] = {"optim": GefenDCPState(optimizer)}
    if spec["with_model"]:
        state["model"] = model.state_dict()
    return state


def _save(spec: Mapping[str, Any], model: Any, optimizer: Any, path: Path, *, group: Any = None) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    state = _states(spec, model, optimizer)
    write: Callable[..., Any] = async_save if group is not None else save
    options: dict[str, Any] = {"process_group": group} if group is not None else {}
    if through_torch_recipe(spec["arm"]):
        return write(state, storage_writer=FileSystemWriter(path), **options)
    from gefen_dcp import GefenFileSystemWriter, GefenSavePlanner

    return write(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner(), **options)


def _load(spec: Mapping[str, Any], model: Any, optimizer: Any, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load

    state = _states(spec, model, optimizer)
    if through_torch_recipe(spec["arm"]):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        load(state, checkpoint_id=path)
        model_state = state.get("model", {})
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=state["optim"],
            options=_recipe_options(spec),
        )
        return
    from gefen_dcp import GefenFileSystemReader, GefenLoadPlanner

    load(state, storage_reader=GefenFileSystemReader(path), planner=GefenLoadPlanner())


def _async_saver(spec: Mapping[str, Any], model: Any, optimizer: Any, path: Path) -> Callable[[], None]:
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")  # async writes must not share a group with training collectives

    def run() -> None:
        future = _save(spec, model, optimizer, path, group=group)
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()

    return run


def _import_checkpoint_modules(spec: Mapping[str, Any]) -> int:
    """Import what a training script that checkpoints this arm imports at its top; return
    the resident growth (bytes) the imports caused.

    Module code is resident for the rest of the process, whether it is imported at startup
    or, lazily, by the first save; measured inside the save it would be charged to the save's
    transient memory once per process. It is reported on its own instead.
    """
    import importlib

    from .rss import ResidentMemory

    gc.collect()
    before = ResidentMemory.current() or 0
    modules = ["torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict"]
    if not through_torch_recipe(spec["arm"]):
        modules.append("gefen_dcp")
    for module in modules:
        importlib.import_module(module)
    gc.collect()
    return (ResidentMemory.current() or 0) - before


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
    return model, build_arm(spec["arm"].removeprefix(RECIPE_PREFIX), list(model.named_parameters()))


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
        imports = _import_checkpoint_modules(spec)
        result: dict[str, Any] = {
            "local_parameters": _local_numel(model),
            "resident_bytes": ResidentMemory.current(),
            "checkpoint_import_bytes": imports,
        }
        # the process's first save carries one-time costs (lazy imports, caches) that a training
        # loop pays once; the measured "save" is the next one, as every later checkpoint is
        first = functools.partial(_save, spec, model, optimizer, Path(str(path) + "-first"))
        result["first_save"] = measure_operation(first, barrier=dist.barrier).to_json()
        save = functools.partial(_save, spec, model, optimizer, path)
        result["save"] = measure_operation(save, barrier=dist.barrier).to_json()
        result["disk_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
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

"""One rank of ``gefen bench portable``: ``python -m gefen.bench.portable_worker SPEC.json RANK RESULT.json``.

Every rank builds the same seeded decoder (:func:`gefen.bench.model_sizes.bench_decoder`)
and takes one optimizer step on a small random batch, then measures four operations, each
with :func:`gefen.bench.peak_memory.measure_operation` between barriers:

* ``memory_export`` / ``memory_import``: the state in memory; ``storage_export`` /
  ``storage_import``: the same through a DCP checkpoint on local disk. Imports go into a
  fresh optimizer on the same model and layout, built before the measured region (so an
  import's peak is the state it allocates plus its transients, not the rebound parameter
  slices a fresh bound optimizer needs); the worker checks that the import filled every
  parameter's state.
* The baseline ``torch-adamw`` shards the model with FSDP2 ``fully_shard`` (dim-0 DTensor
  shards) and uses torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (plus
  ``dcp.save`` / ``dcp.load`` with DCP's stock writer for storage).
* Any other arm keeps the convention: on one rank it optimizes the whole parameters
  (unbound); on ``W > 1`` ranks it is finalized by ``post_sharding`` onto this rank's
  contiguous slice of each flattened parameter (gefen-contracts' ``flattened_plan``, a
  ``FLATTENED_ELEMENT_SHARD`` layout over the ``W`` ranks), with a codebook scope over the
  ``W`` ranks when its contract claims ``collective_scope`` (Gefen learns one codebook for
  the layout). It exports and imports with :func:`gefen_portable.export_portable_state` /
  :func:`gefen_portable.import_portable_state` (this rank's fragments plus the agreed
  catalog, never the whole document) and saves and loads with
  :func:`gefen_dcp.save_portable_dcp` / :func:`gefen_dcp.load_portable_dcp`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["OPERATIONS", "TORCH_ARM"]

TORCH_ARM = "torch-adamw"
OPERATIONS = ("memory_export", "memory_import", "storage_export", "storage_import")


def _batch(model: Any, spec: Mapping[str, Any]) -> tuple[Any, Any]:
    import torch

    length = min(int(spec["sequence_length"]), model.config.context)
    ids = torch.randint(
        0, model.config.vocab_size, (int(spec["batch_size"]), length + 1), generator=torch.Generator().manual_seed(0)
    )
    return ids[:, :-1], ids[:, 1:]


def _model(spec: Mapping[str, Any]) -> Any:
    import torch

    from ..demo.model import TinyDecoder
    from .model_sizes import bench_decoder

    torch.manual_seed(0)
    return TinyDecoder(bench_decoder(spec["model"]))


#: ``(operation name, build the fresh target or None, the operation)``: the build is not measured.
Operation = tuple[str, Callable[[], None] | None, Callable[[], None]]


def _measure(operations: list[Operation], barrier: Callable[[], object] | None, held: dict[str, Any]) -> dict[str, Any]:
    """Each operation's cost; the fresh optimizer an import fills is built outside the measured region
    and dropped afterwards, and the in-memory export is dropped once the in-memory import has read it."""
    from .peak_memory import measure_operation

    result: dict[str, Any] = {}
    for name, build, operation in operations:
        if build is not None:
            build()
        result[name] = measure_operation(operation, barrier=barrier).to_json()
        held.pop("fresh", None)
        if name == "memory_import":
            held.pop("state", None)
    return result


def _tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a state tree (a DTensor counts its local shard)."""
    import torch

    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return int(local.numel() * local.element_size())
    if isinstance(tree, Mapping):
        return sum(_tensor_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(value) for value in tree)
    return 0


def _sizes(held: dict[str, Any], path: Path) -> dict[str, int]:
    """The in-memory export's tensor bytes on this rank and the storage folder's bytes on disk."""
    disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"export_bytes": int(held.get("export_bytes", 0)), "disk_bytes": disk}


def _check_imported(fresh: Any, source: Any, arm: str) -> None:
    """An import that left the fresh optimizer without the source's per-parameter state is a bug, not a figure."""
    if len(fresh.state) != len(source.state):
        raise RuntimeError(
            f"{arm}: the import filled {len(fresh.state)} parameter states, the source holds {len(source.state)}"
        )


def _torch_arm(spec: Mapping[str, Any], rank: int, barrier: Callable[[], object] | None) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(spec)
    fully_shard(model, mesh=init_device_mesh("cpu", (int(spec["world_size"]),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.loss(*_batch(model, spec)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    local = sum(int(p.to_local().numel()) for p in model.parameters())
    path = Path(spec["root"]) / f"torch-{spec['world_size']}"
    held: dict[str, Any] = {}

    def fresh() -> None:
        held["fresh"] = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def memory_export() -> None:
        held["state"] = get_optimizer_state_dict(model, optimizer)
        held["export_bytes"] = _tensor_bytes(held["state"])

    def memory_import() -> None:
        set_optimizer_state_dict(model, held["fresh"], optim_state_dict=held["state"])
        _check_imported(held["fresh"], optimizer, TORCH_ARM)

    def storage_export() -> None:
        dcp_save({"optim": get_optimizer_state_dict(model, optimizer)}, storage_writer=FileSystemWriter(str(path)))

    def storage_import() -> None:
        state = {"optim": get_optimizer_state_dict(model, held["fresh"])}
        dcp_load(state, checkpoint_id=str(path))
        set_optimizer_state_dict(model, held["fresh"], optim_state_dict=state["optim"])
        _check_imported(held["fresh"], optimizer, TORCH_ARM)

    operations: list[Operation] = [
        ("memory_export", None, memory_export),
        ("memory_import", fresh, memory_import),
        ("storage_export", None, storage_export),
        ("storage_import", fresh, storage_import),
    ]
    measured = _measure(operations, barrier, held)
    return {"local_parameters": local, "layout": "fsdp2", **measured, **_sizes(held, path)}


def _convention_arm(spec: Mapping[str, Any], rank: int, barrier: Callable[[], object] | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from gefen_contracts import FEATURE_COLLECTIVE_SCOPE
    from gefen_contracts.identity import ProcessGroupIdentity
    from gefen_contracts.limits import PortableStateLimits
    from gefen_contracts.testing import flattened_plan, scatter_flat_grads
    from gefen_contracts.torch_support import CheckpointProcessGroupBinding, CodebookProcessGroupBinding
    from gefen_dcp import GefenFileSystemReader, GefenFileSystemWriter, load_portable_dcp, save_portable_dcp
    from gefen_portable import export_portable_state, import_portable_state

    from .checkpoint_arms import build_arm

    world = int(spec["world_size"])
    arm = str(spec["arm"])
    group = ProcessGroupIdentity("bench.world", tuple(f"rank:{r}" for r in range(world)))
    model = _model(spec)
    named = list(model.named_parameters())
    model.loss(*_batch(model, spec)).backward()
    scoped: list[bool] = []

    def build() -> tuple[Any, dict[str, Any]]:
        """The arm over the whole parameters (one rank) or bound to this rank's flattened slices."""
        optimizer = build_arm(arm, named)
        if world == 1:
            return optimizer, dict(named)
        grads = {name: p.grad for name, p in named}
        for _, parameter in named:
            parameter.grad = None  # post_sharding refuses tensors that carry gradients
        plan = flattened_plan(named, rank, group=group)
        scope = None
        if optimizer.optimizer_contract().capabilities.supports(FEATURE_COLLECTIVE_SCOPE):  # type: ignore[attr-defined]
            # Shared learned state (Gefen's codebook) is learned over every member of the layout.
            scope = CodebookProcessGroupBinding(group, f"rank:{rank}", dist.group.WORLD, torch.device("cpu"))
        optimizer.post_sharding(list(plan.rebindings), manifest=plan.manifest, scope=scope)  # type: ignore[attr-defined]
        scoped[:] = [scope is not None]
        for name, parameter in named:
            parameter.grad = grads[name]
        scatter_flat_grads(model, plan, plan.targets)
        return optimizer, plan.targets

    optimizer, tensors = build()
    optimizer.step()
    local = sum(int(t.numel()) for t in tensors.values())
    binding = CheckpointProcessGroupBinding(
        group if world > 1 else ProcessGroupIdentity("bench.world", ("rank:0",)),
        f"rank:{rank}",
        dist.group.WORLD if world > 1 else None,
        torch.device("cpu"),
    )
    limits = PortableStateLimits()
    path = Path(spec["root"]) / f"{arm.replace(':', '_')}-{world}"
    held: dict[str, Any] = {}

    def fresh() -> None:
        held["fresh"], _ = build()

    def memory_export() -> None:
        held["state"] = export_portable_state(
            optimizer, checkpoint_process_group=binding, transaction_id="bench-export", limits=limits
        )
        held["export_bytes"] = held["state"].local_bytes

    def memory_import() -> None:
        import_portable_state(
            held["fresh"], held["state"], checkpoint_process_group=binding, transaction_id="bench-import", limits=limits
        )
        _check_imported(held["fresh"], optimizer, arm)

    def storage_export() -> None:
        save_portable_dcp(
            optimizer,
            checkpoint_process_group=binding,
            storage_writer=GefenFileSystemWriter(str(path)),
            transaction_id="bench-save",
            limits=limits,
        )

    def storage_import() -> None:
        load_portable_dcp(
            held["fresh"],
            checkpoint_process_group=binding,
            storage_reader=GefenFileSystemReader(str(path)),
            transaction_id="bench-load",
            limits=limits,
        )
        _check_imported(held["fresh"], optimizer, arm)

    operations: list[Operation] = [
        ("memory_export", None, memory_export),
        ("memory_import", fresh, memory_import),
        ("storage_export", None, storage_export),
        ("storage_import", fresh, storage_import),
    ]
    layout = "whole" if world == 1 else ("flattened+codebook-scope" if scoped and scoped[0] else "flattened")
    measured = _measure(operations, barrier, held)
    return {"local_parameters": local, "layout": layout, **measured, **_sizes(held, path)}


def _run(spec: Mapping[str, Any], rank: int) -> dict[str, Any]:
    import warnings

    import torch.distributed as dist

    from .rank_processes import join_group

    warnings.filterwarnings("ignore")
    join_group(spec, rank)
    try:
        barrier = dist.barrier if int(spec["world_size"]) > 1 else None
        arm = _torch_arm if spec["arm"] == TORCH_ARM else _convention_arm
        return arm(spec, rank, barrier)
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from .rank_processes import read_rank_arguments, write_rank_result

    spec, rank, result_path = read_rank_arguments(argv)
    write_rank_result(result_path, _run(spec, rank))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

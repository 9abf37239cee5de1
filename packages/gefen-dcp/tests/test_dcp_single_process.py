"""GefenDCPState through real DCP in one process (no process group): round trips of the
compact state, refusals of corrupted or mismatched checkpoints with the optimizer unchanged, the writer's
crash safety and async snapshots."""

from __future__ import annotations

import copy
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_fsdp_ranks import FaultingSavePlanner, batch, build, save, train
from gefen_contracts import NotSupportedError, StateValidationError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.testing.checks.checkpoint import assert_trees_equal
from gefen_dcp import (
    CheckpointIntegrityError,
    CheckpointLayoutError,
    EnvelopeFormatError,
    GefenDCPState,
    GefenFileSystemReader,
    GefenFileSystemWriter,
    GefenLoadPlanner,
    GefenSavePlanner,
    PlannerRequiredError,
    StateTensorError,
)
from gefen_dcp.testing import Int8MomentumSGD
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save(model: torch.nn.Module, optimizer: Any, path: Path, **options: Any) -> None:
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(path, **options), planner=GefenSavePlanner())


def _load(model: torch.nn.Module, optimizer: Any, path: Path) -> None:
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.load(state, storage_reader=GefenFileSystemReader(path), planner=GefenLoadPlanner())


def _momenta(optimizer: Any) -> dict[str, torch.Tensor]:
    """Every state tensor by ``<parameter number>.<name>`` (cloned)."""
    return {
        f"{number}.{name}": value.clone()
        for number, entry in optimizer.state_dict()["state"].items()
        for name, value in entry.items()
        if isinstance(value, torch.Tensor)
    }


def _failures(exc: CheckpointException) -> list[BaseException]:
    return [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]


@pytest.fixture
def trained() -> tuple[torch.nn.Module, Int8MomentumSGD]:
    model, optimizer = build(1)
    train(model, optimizer, 0, 3)
    return model, optimizer


def test_round_trip_continues_bit_exactly(trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path) -> None:
    model, optimizer = trained
    _save(model, optimizer, tmp_path)
    twin_model, twin = build(1)
    _load(twin_model, twin, tmp_path)
    assert_trees_equal(twin.state_dict(), optimizer.state_dict())
    assert train(model, optimizer, 3, 3) == train(twin_model, twin, 3, 3)
    for (name, a), (_, b) in zip(model.named_parameters(), twin_model.named_parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_holds_the_compact_tensors_and_no_pickles(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    _save(model, optimizer, tmp_path)
    metadata = FileSystemReader(tmp_path).read_metadata()
    optim_keys = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("optim.")}
    assert not any(isinstance(v, BytesStorageMetadata) for v in optim_keys.values())
    codes = optim_keys["optim.tensors.like_parameter.state/0/momentum_int8"]
    assert isinstance(codes, TensorStorageMetadata) and codes.properties.dtype is torch.int8
    assert tuple(codes.size) == (64, 32) and len(codes.chunks) == 1
    assert set(optim_keys) >= {"optim.envelope", "optim.digests.writer_00000"}
    state_bytes = sum(
        int(torch.Size(v.size).numel()) * v.properties.dtype.itemsize
        for k, v in optim_keys.items()
        if k.startswith("optim.tensors.")
    )
    compact = sum(t.numel() * t.element_size() for t in _momenta(optimizer).values())
    assert state_bytes == compact  # the compact state itself, nothing expanded
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.distcp"))
    framing = (on_disk - model_bytes - compact) / len(metadata.storage_data)
    assert framing < 600, f"{framing:.0f} bytes of framing per item"  # torch.save's zip format: about 1.6 KB


def test_a_fresh_optimizer_loads_without_an_initialising_step(tmp_path: Path) -> None:
    model, optimizer = build(1)
    train(model, optimizer, 0, 2)
    _save(model, optimizer, tmp_path)
    fresh_model, fresh = build(1)
    assert not fresh.state
    _load(fresh_model, fresh, tmp_path)
    assert_trees_equal(fresh.state_dict(), optimizer.state_dict())


# -- refusals ------------------------------------------------------------------------------


def _storage(path: Path, key: str) -> list[Any]:
    metadata = FileSystemReader(path).read_metadata()
    return [info for index, info in metadata.storage_data.items() if index.fqn == key]


def _flip_payload(path: Path, key: str, expected: torch.Tensor) -> None:
    """Flip one byte inside the stored elements of the first chunk of ``key``."""
    info = _storage(path, key)[0]
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    region = bytes(data[info.offset : info.offset + info.length])
    needle = expected.contiguous().reshape(-1)[:16].numpy().tobytes()
    position = region.find(needle)
    assert position >= 0, "could not locate the chunk's elements in its file"
    data[info.offset + position + 1] ^= 0x10
    target.write_bytes(bytes(data))


_CODES = "optim.tensors.like_parameter.state/0/momentum_int8"


def _corrupt_tensor(path: Path, optimizer: Int8MomentumSGD) -> None:
    _flip_payload(path, _CODES, optimizer.state_dict()["state"][0]["momentum_int8"][4:])


def _corrupt_envelope(path: Path, optimizer: Int8MomentumSGD) -> None:
    info = _storage(path, "optim.envelope")[0]
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    region = bytes(data[info.offset : info.offset + info.length])
    position = region.find(b'["step",3]')
    assert position >= 0
    data[info.offset + position + 8] = ord("4")
    target.write_bytes(bytes(data))


def _corrupt_table(path: Path, optimizer: Int8MomentumSGD) -> None:
    info = _storage(path, "optim.digests.writer_00000")[0]
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    region = bytes(data[info.offset : info.offset + info.length])
    position = region.find(b'"w","')
    assert position >= 0
    data[info.offset + position + 5] = ord("0") if data[info.offset + position + 5] != ord("0") else ord("1")
    target.write_bytes(bytes(data))


def _truncate_data_file(path: Path, optimizer: Int8MomentumSGD) -> None:
    info = _storage(path, _CODES)[0]
    target = path / info.relative_path
    size = target.stat().st_size
    with open(target, "r+b") as handle:
        handle.truncate(size // 2)


CORRUPTIONS: dict[str, tuple[Callable[[Path, Int8MomentumSGD], None], type[BaseException]]] = {
    "flipped_state_byte": (_corrupt_tensor, CheckpointIntegrityError),
    "edited_envelope": (_corrupt_envelope, EnvelopeFormatError),
    "edited_digest": (_corrupt_table, CheckpointIntegrityError),
    "truncated_file": (_truncate_data_file, CheckpointException),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_checkpoint_is_refused_and_nothing_changes(
    name: str, trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    _save(model, optimizer, tmp_path)
    corrupt, error = CORRUPTIONS[name]
    corrupt(tmp_path, optimizer)
    target_model, target = build(1)
    train(target_model, target, 0, 1)
    before = deep_snapshot(target)
    with pytest.raises(error):  # the optimizer alone: DCP loads a model in place before the optimizer is verified
        dcp.load({"optim": GefenDCPState(target)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    assert not snapshot_diff(before, target)


def test_layout_mismatches_are_refused_before_reading(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    _save(model, optimizer, tmp_path)
    other = torch.nn.Sequential(torch.nn.Embedding(65, 32))
    other_optimizer = Int8MomentumSGD([("embed.weight", other[0].weight)])
    before = deep_snapshot(other_optimizer)
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"optim": GefenDCPState(other_optimizer)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    assert any(isinstance(f, CheckpointLayoutError) for f in _failures(caught.value))
    assert not snapshot_diff(before, other_optimizer)


def test_a_checkpoint_missing_live_parameters_is_refused(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, _ = trained
    partial = Int8MomentumSGD([("embed.weight", model.embed.weight)])
    train(model, partial, 0, 1)
    dcp.save(
        {"optim": GefenDCPState(partial)}, storage_writer=GefenFileSystemWriter(tmp_path), planner=GefenSavePlanner()
    )
    _, target = build(1)
    before = deep_snapshot(target)
    with pytest.raises(StateValidationError, match="parameter numbering"):
        dcp.load({"optim": GefenDCPState(target)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    assert not snapshot_diff(before, target)


def test_default_planners_are_refused_with_a_clear_error(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"optim": GefenDCPState(optimizer)}, storage_writer=GefenFileSystemWriter(tmp_path))
    assert any(isinstance(f, PlannerRequiredError) for f in _failures(caught.value))
    assert not (tmp_path / ".metadata").exists()
    _save(model, optimizer, tmp_path)
    state = GefenDCPState(optimizer)
    with pytest.raises(PlannerRequiredError):
        state.load_state_dict(state.state_dict())
    with pytest.raises(CheckpointException) as caught:  # DCP's default load planner
        dcp.load({"optim": GefenDCPState(build(1)[1])}, checkpoint_id=tmp_path)
    failures = _failures(caught.value)
    assert any(isinstance(f, PlannerRequiredError) and "GefenLoadPlanner" in str(f) for f in failures), failures
    with pytest.raises(ValueError, match="flatten_state_dict"):
        GefenSavePlanner(flatten_state_dict=False)
    with pytest.raises(ValueError, match="enable_plan_caching"):
        GefenSavePlanner(enable_plan_caching=True)


def test_the_coordinator_does_not_keep_the_global_plan_while_writing(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    planner = GefenSavePlanner()
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(tmp_path), planner=planner)
    assert planner.global_plan == []  # every rank's write items, freed once DCP scattered them
    assert planner.metadata.state_dict_metadata  # the metadata DCP commits is kept
    fresh_model, fresh = build(1)
    _load(fresh_model, fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(_momenta(fresh).values(), _momenta(optimizer).values(), strict=True))


def test_stand_ins_refuse_pickling_and_copies_freeze(trained: tuple[torch.nn.Module, Int8MomentumSGD]) -> None:
    model, optimizer = trained
    state = GefenDCPState(optimizer).state_dict()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(state["envelope"])
    frozen = copy.deepcopy(state)
    expected = _momenta(optimizer)
    train(model, optimizer, 3, 1)
    assert not torch.equal(_momenta(optimizer)["0.momentum_int8"], expected["0.momentum_int8"])
    assert frozen["envelope"].session is frozen["digests"]["writer_00000"].session  # one snapshot for all entries
    assert torch.equal(frozen["tensors"]["like_parameter"]["state/0/momentum_int8"], expected["0.momentum_int8"])


def test_a_state_changed_during_a_save_is_refused(trained: tuple[torch.nn.Module, Int8MomentumSGD]) -> None:
    _, optimizer = trained
    session = GefenDCPState(optimizer).state_dict().session
    codes = session.tensors["state/0/momentum_int8"]
    session.record("state/0/momentum_int8", (0, 0), codes)
    with pytest.raises(StateTensorError, match="changed while it was being saved"):
        session.record("state/0/momentum_int8", (0, 0), codes + 1)
    with pytest.raises(CheckpointLayoutError, match="no local chunk"):
        session.record("state/0/momentum_int8", (1, 0), codes)


def test_unsupported_optimizers_are_refused(trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path) -> None:
    model, _ = trained

    class Unsupported(Int8MomentumSGD):
        def optimizer_contract(self) -> Any:
            import dataclasses

            from gefen_contracts import FEATURE_PARAMETER_SHAPED_STATE, FeatureStatus

            contract = super().optimizer_contract()
            capabilities = contract.capabilities
            features = dict(capabilities.features)
            features[FEATURE_PARAMETER_SHAPED_STATE] = FeatureStatus.no("switched off for the test")
            checkpoints = tuple(c for c in capabilities.checkpoints if c.transport.value != "parameter_shaped")
            capabilities = dataclasses.replace(capabilities, features=features, checkpoints=checkpoints)
            return dataclasses.replace(contract, capabilities=capabilities)

    with pytest.raises(NotSupportedError, match="switched off"):
        GefenDCPState(Unsupported(list(model.named_parameters()))).state_dict()
    with pytest.raises(TypeError, match="StagedNativeLoad"):
        GefenDCPState(torch.optim.SGD(model.parameters(), lr=0.1))


# -- the writer ----------------------------------------------------------------------------


class _Boom(RuntimeError):
    pass


def _fail_after_first_item(written: int) -> None:
    raise _Boom("injected write failure")


def test_interrupted_overwrite_keeps_the_previous_checkpoint(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    _save(model, optimizer, tmp_path)
    first_files = set(os.listdir(tmp_path))
    expected = {k: v.clone() for k, v in _momenta(optimizer).items()}
    train(model, optimizer, 3, 2)
    with pytest.raises(CheckpointException):
        save(model, optimizer, str(tmp_path), fault=_fail_after_first_item)
    assert first_files <= set(os.listdir(tmp_path))  # the old files were never touched
    restored_model, restored = build(1)
    _load(restored_model, restored, tmp_path)
    assert all(torch.equal(v, expected[k]) for k, v in _momenta(restored).items())
    _save(model, optimizer, tmp_path)  # a later successful save removes everything it does not reference
    referenced = {info.relative_path for info in FileSystemReader(tmp_path).read_metadata().storage_data.values()}
    assert set(os.listdir(tmp_path)) == referenced | {".metadata"}


def test_async_save_holds_the_state_at_the_call(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    for writer_type in (GefenFileSystemWriter, FileSystemWriter):
        path = tmp_path / writer_type.__name__
        expected = {k: v.clone() for k, v in _momenta(optimizer).items()}
        expected_params = {k: v.detach().clone() for k, v in model.named_parameters()}
        state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
        future = dcp.async_save(state, storage_writer=writer_type(path), planner=GefenSavePlanner())
        inputs, _ = batch(99)
        train(model, optimizer, 10, 2)  # mutate the live state before the write is awaited
        future.result()
        restored_model, restored = build(1)
        _load(restored_model, restored, path)
        assert all(torch.equal(v, expected[k]) for k, v in _momenta(restored).items()), writer_type.__name__
        assert all(torch.equal(p, expected_params[n]) for n, p in restored_model.named_parameters())
        del inputs


def test_the_allocation_limit_is_checked_before_anything_is_allocated(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    """Metadata naming a 2**50-byte state tensor is refused by ``max_fragment_tensor_bytes``
    (a ``CheckpointLayoutError``), not attempted (the allocator's ``RuntimeError``, or the
    process killed for memory)."""
    from gefen_contracts.limits import PortableStateLimits
    from gefen_dcp.load_session import LoadSession
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    model, optimizer = trained
    _save(model, optimizer, tmp_path)
    metadata = GefenFileSystemReader(tmp_path).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if k.startswith("optim.tensors.") and "momentum" in k)
    stored = metadata.state_dict_metadata[key]
    assert isinstance(stored, TensorStorageMetadata)
    size = torch.Size((2**50 // stored.properties.dtype.itemsize // stored.size[1], stored.size[1]))
    metadata.state_dict_metadata[key] = TensorStorageMetadata(
        stored.properties, size, [ChunkStorageMetadata(torch.Size((0, 0)), size)]
    )
    live = GefenDCPState(optimizer)._session(0, "0" * 32)
    with pytest.raises(CheckpointLayoutError, match="max_fragment_tensor_bytes"):
        LoadSession(path=("optim",), live=live, metadata=metadata, limits=PortableStateLimits())


def test_a_reused_writer_names_each_save_afresh(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    """DCP refreshes a writer's ``save_id`` only with a ``checkpoint_id``: a writer saving again
    must still pick new file names, or a failed second save truncates the committed files."""
    model, optimizer = trained
    writer = GefenFileSystemWriter(tmp_path)
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.save(state, storage_writer=writer, planner=GefenSavePlanner())
    expected = _momenta(optimizer)
    expected_params = {k: v.detach().clone() for k, v in model.named_parameters()}
    train(model, optimizer, 3, 2)
    with pytest.raises(CheckpointException):
        dcp.save(
            {"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
            storage_writer=writer,
            planner=FaultingSavePlanner(_fail_after_first_item),
        )
    restored_model, restored = build(1)
    _load(restored_model, restored, tmp_path)
    assert all(torch.equal(v, expected[k]) for k, v in _momenta(restored).items())
    assert all(torch.equal(p, expected_params[n]) for n, p in restored_model.named_parameters())


def test_two_saves_in_flight_into_one_directory_leave_the_last_commit_whole(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    """An async save still writing while a synchronous one commits into the same directory: each
    commit removes only the files of finished saves, so the last commit loads, whole."""
    model, optimizer = trained
    (tmp_path / "__notes.distcp").write_bytes(b"not a checkpoint file")  # not the writer's name pattern
    reached, gate = threading.Event(), threading.Event()

    def hold(written: int) -> None:
        if written == 1:
            reached.set()
            assert gate.wait(60)

    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    future = dcp.async_save(state, storage_writer=GefenFileSystemWriter(tmp_path), planner=FaultingSavePlanner(hold))
    try:
        assert reached.wait(60)
        expected = _momenta(optimizer)  # the async save holds the state at its call
        expected_params = {k: v.detach().clone() for k, v in model.named_parameters()}
        train(model, optimizer, 2, 2)
        _save(model, optimizer, tmp_path)  # commits while the first save is still writing
    finally:
        gate.set()
    future.result()  # the async save commits last
    restored_model, restored = build(1)
    _load(restored_model, restored, tmp_path)
    assert all(torch.equal(v, expected[k]) for k, v in _momenta(restored).items())
    assert all(torch.equal(p, expected_params[n]) for n, p in restored_model.named_parameters())
    referenced = {info.relative_path for info in FileSystemReader(tmp_path).read_metadata().storage_data.values()}
    assert set(os.listdir(tmp_path)) == referenced | {".metadata", "__notes.distcp"}


def test_a_nested_gefen_dcp_state_is_refused_with_a_clear_error(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    """DCP calls ``state_dict()`` only on top-level values: a nested ``GefenDCPState`` would be
    pickled whole (optimizer and parameters) into a checkpoint no load accepts."""
    model, optimizer = trained
    nested = {"train": {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}}
    with pytest.raises((CheckpointException, PlannerRequiredError)) as caught:
        dcp.save(nested, storage_writer=GefenFileSystemWriter(tmp_path / "sync"), planner=GefenSavePlanner())
    assert "top level" in str(caught.value)
    with pytest.raises(TypeError, match="top level"):
        dcp.async_save(
            nested, storage_writer=GefenFileSystemWriter(tmp_path / "async"), planner=GefenSavePlanner()
        ).result()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(GefenDCPState(optimizer))


def test_a_writer_pickles_while_it_holds_its_save_lock(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    """A process-based async save pickles its writer; mid-save the writer holds its lock file
    open, which a copy must not carry (nor could copy: an open file does not pickle)."""
    model, optimizer = trained
    copies: list[GefenFileSystemWriter] = []
    writer = GefenFileSystemWriter(tmp_path)
    dcp.save(
        {"model": model.state_dict(), "optim": GefenDCPState(optimizer)},
        storage_writer=writer,
        planner=FaultingSavePlanner(lambda written: copies.append(copy.deepcopy(writer))),
    )
    assert copies and all(copy_._lock is None and copy_.path == writer.path for copy_ in copies)

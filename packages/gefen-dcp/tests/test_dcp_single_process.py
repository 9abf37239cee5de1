"""GefenDCPState through real DCP in one process (no process group): round trips, chunking,
refusals of corrupted or mismatched checkpoints with the optimizer unchanged, the writer's
crash safety and async snapshots."""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_fsdp_ranks import TinyDecoder, batch, build, train
from gefen_contracts import NotSupportedError
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_dcp import (
    CheckpointIntegrityError,
    CheckpointLayoutError,
    DenseFieldError,
    EnvelopeFormatError,
    GefenDCPState,
    GefenFileSystemWriter,
    GefenLoadPlanner,
    GefenSavePlanner,
    PlannerRequiredError,
)
from gefen_dcp.testing import Int8MomentumSGD
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save(model: torch.nn.Module, optimizer: Any, path: Path, **options: Any) -> None:
    chunk_bytes = options.pop("chunk_bytes", None)
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer, chunk_bytes=chunk_bytes)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(path, **options), planner=GefenSavePlanner())


def _load(model: torch.nn.Module, optimizer: Any, path: Path) -> None:
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.load(state, checkpoint_id=path, planner=GefenLoadPlanner())


def _momenta(optimizer: Any) -> dict[str, torch.Tensor]:
    return {
        s.fqn: optimizer.materialize_dense_field(s.fqn, "momentum") for s in optimizer.dense_shard_slots() if s.fields
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
    _save(model, optimizer, tmp_path, chunk_bytes=256)
    twin_model, twin = build(1)
    _load(twin_model, twin, tmp_path)
    assert {k: v.tolist() for k, v in _momenta(twin).items()} == {k: v.tolist() for k, v in _momenta(optimizer).items()}
    assert train(model, optimizer, 3, 3) == train(twin_model, twin, 3, 3)
    for (name, a), (_, b) in zip(model.named_parameters(), twin_model.named_parameters()):
        assert torch.equal(a, b), name


def test_checkpoint_is_tensor_only_and_chunked(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, optimizer = trained
    _save(model, optimizer, tmp_path, chunk_bytes=256)
    metadata = FileSystemReader(tmp_path).read_metadata()
    optim_keys = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("optim.")}
    assert not any(isinstance(v, BytesStorageMetadata) for v in optim_keys.values())
    embed = optim_keys["optim.dense.embed.weight.momentum"]
    assert isinstance(embed, TensorStorageMetadata) and embed.properties.dtype is torch.float32
    assert len(embed.chunks) == 64 // 2  # 256-byte chunks of a (64, 32) fp32 field: 2 rows each
    assert set(optim_keys) >= {"optim.envelope", "optim.digests.writer_00000"}


class _RowSpy(Int8MomentumSGD):
    """Records every materialisation request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, int]] = []

    def materialize_dense_field(self, fqn: str, field: str) -> torch.Tensor:
        value = super().materialize_dense_field(fqn, field)
        self.calls.append(("whole", value.numel()))
        return value

    def materialize_dense_field_rows(self, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
        value = super().materialize_dense_field_rows(fqn, field, start, stop)
        self.calls.append(("rows", value.numel()))
        return value


class _WholeFieldCodec:
    """Only the DenseShardCodec Protocol (no row chunks, no snapshot), over an Int8MomentumSGD."""

    def __init__(self, inner: Int8MomentumSGD) -> None:
        self.inner = inner
        self.largest = 0

    def optimizer_contract(self) -> Any:
        return self.inner.optimizer_contract()

    def dense_shard_common(self) -> Any:
        return self.inner.dense_shard_common()

    def dense_shard_slots(self) -> Any:
        return self.inner.dense_shard_slots()

    def materialize_dense_field(self, fqn: str, field: str) -> torch.Tensor:
        value = self.inner.materialize_dense_field(fqn, field)
        self.largest = max(self.largest, value.numel())
        return value

    def prepare_dense_shard_load(self, common: Any, slots: Any) -> Any:
        return self.inner.prepare_dense_shard_load(common, slots)

    def commit_dense_shard_load(self, staged: Any) -> None:
        self.inner.commit_dense_shard_load(staged)


def test_save_materialises_one_chunk_at_a_time_and_each_chunk_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyDecoder()
    optimizer = _RowSpy(list(model.named_parameters()), lr=0.1)
    train(model, optimizer, 0, 2)  # type: ignore[arg-type]
    optimizer.calls.clear()
    _save(model, optimizer, tmp_path, chunk_bytes=512)
    assert optimizer.calls and all(kind == "rows" for kind, _ in optimizer.calls)
    assert max(n for _, n in optimizer.calls) * 4 <= 512
    metadata = FileSystemReader(tmp_path).read_metadata()
    stored = sum(len(v.chunks) for k, v in metadata.state_dict_metadata.items() if k.startswith("optim.dense."))
    assert len(optimizer.calls) == stored  # digests come from the written tensors: no second pass


def test_codec_without_optional_methods_round_trips(tmp_path: Path) -> None:
    model, optimizer = build(1)
    train(model, optimizer, 0, 2)
    codec = _WholeFieldCodec(optimizer)
    state = {"model": model.state_dict(), "optim": GefenDCPState(codec, chunk_bytes=256)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(tmp_path), planner=GefenSavePlanner())
    assert codec.largest == 64 * 32  # the whole embedding field, once per field (cached across its chunks)
    twin_model, twin = build(1)
    _load(twin_model, twin, tmp_path)
    assert all(torch.equal(a, _momenta(optimizer)[k]) for k, a in _momenta(twin).items())


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
    needle = expected.contiguous().reshape(-1)[:4].numpy().tobytes()
    position = region.find(needle)
    assert position >= 0, "could not locate the chunk's elements in its file"
    data[info.offset + position + 1] ^= 0x10
    target.write_bytes(bytes(data))


def _corrupt_dense(path: Path, optimizer: Int8MomentumSGD) -> None:
    _flip_payload(
        path, "optim.dense.embed.weight.momentum", optimizer.materialize_dense_field("embed.weight", "momentum")
    )


def _corrupt_envelope(path: Path, optimizer: Int8MomentumSGD) -> None:
    info = _storage(path, "optim.envelope")[0]
    target = path / info.relative_path
    data = bytearray(target.read_bytes())
    region = bytes(data[info.offset : info.offset + info.length])
    position = region.find(b'"step":3')
    assert position >= 0
    data[info.offset + position + 7] = ord("4")
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
    info = _storage(path, "optim.dense.embed.weight.momentum")[0]
    target = path / info.relative_path
    size = target.stat().st_size
    with open(target, "r+b") as handle:
        handle.truncate(size // 2)


CORRUPTIONS: dict[str, tuple[Callable[[Path, Int8MomentumSGD], None], type[BaseException]]] = {
    "flipped_dense_byte": (_corrupt_dense, CheckpointIntegrityError),
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
    with pytest.raises(CheckpointLayoutError, match="missing"):
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


def test_non_finite_values_anywhere_in_a_large_field_are_refused() -> None:
    from gefen_dcp.field_source import DenseSnapshotSource, FieldReader

    values = torch.ones(3, 50_000)
    reader = FieldReader(DenseSnapshotSource({("w", "m"): values}), {"w": (3, 50_000)})
    assert torch.equal(reader.whole("w", "m"), values)
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = values.clone()
        broken[2, 49_999] = bad  # past the first slices the check walks
        reader = FieldReader(DenseSnapshotSource({("w", "m"): broken}), {"w": (3, 50_000)})
        with pytest.raises(DenseFieldError, match="non-finite"):
            reader.whole("w", "m")


def test_stand_ins_refuse_pickling_and_copies_freeze(trained: tuple[torch.nn.Module, Int8MomentumSGD]) -> None:
    model, optimizer = trained
    state = GefenDCPState(optimizer).state_dict()
    standin = state["dense"]["embed.weight"]["momentum"]
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(standin)
    frozen = copy.deepcopy(state)
    expected = optimizer.materialize_dense_field("embed.weight", "momentum")
    train(model, optimizer, 3, 1)
    assert not torch.equal(optimizer.materialize_dense_field("embed.weight", "momentum"), expected)
    session = frozen["dense"]["embed.weight"]["momentum"].session
    assert session is frozen["envelope"].session  # one snapshot for the whole state dict
    assert torch.equal(session.reader.whole("embed.weight", "momentum"), expected)


def test_unsupported_and_broken_codecs_are_refused(
    trained: tuple[torch.nn.Module, Int8MomentumSGD], tmp_path: Path
) -> None:
    model, _ = trained

    class Unsupported(Int8MomentumSGD):
        def optimizer_contract(self) -> Any:
            import dataclasses

            from gefen_contracts import FEATURE_PARAMETER_SHAPED_STATE, FeatureStatus

            contract = super().optimizer_contract()
            capabilities = contract.capabilities
            features = dict(capabilities.features)
            features[FEATURE_PARAMETER_SHAPED_STATE] = FeatureStatus.no("switched off for the test")
            checkpoints = tuple(c for c in capabilities.checkpoints if c.transport.value != "dense_shard")
            capabilities = dataclasses.replace(capabilities, features=features, checkpoints=checkpoints)
            return dataclasses.replace(contract, capabilities=capabilities)

    with pytest.raises(NotSupportedError, match="switched off"):
        GefenDCPState(Unsupported(list(model.named_parameters()))).state_dict()
    with pytest.raises(TypeError, match="DenseShardCodec"):
        GefenDCPState(torch.optim.SGD(model.parameters(), lr=0.1))

    class WrongShape(Int8MomentumSGD):
        def materialize_dense_field_rows(self, fqn: str, field: str, start: int, stop: int) -> torch.Tensor:
            rows = super().materialize_dense_field_rows(fqn, field, start, stop)
            return torch.cat([rows, rows])

    broken = WrongShape(list(model.named_parameters()))
    train(model, broken, 0, 1)  # type: ignore[arg-type]
    with pytest.raises(CheckpointException) as caught:
        _save(model, broken, tmp_path)
    assert any(isinstance(f, DenseFieldError) for f in _failures(caught.value)), _failures(caught.value)
    assert not (tmp_path / ".metadata").exists()


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
        _save(model, optimizer, tmp_path, fault_hook=_fail_after_first_item)
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

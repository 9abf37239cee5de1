"""Nothing a DCP checkpoint holds runs, and malformed metadata is refused in bounded memory
(issue 19): ``GefenFileSystemReader`` / ``read_dcp_metadata`` and ``GefenLoadPlanner``'s
``weights_only`` loads of non-tensor entries."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_fsdp_ranks import build, train
from gefen_contracts.testing import hostile_object
from gefen_dcp import (
    GefenDCPState,
    GefenFileSystemReader,
    GefenFileSystemWriter,
    GefenLoadPlanner,
    GefenSavePlanner,
    MetadataFormatError,
    read_dcp_metadata,
)
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _saved(path: Path) -> tuple[torch.nn.Module, Any]:
    model, optimizer = build(1)
    train(model, optimizer, 0, 2)
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer), "extra": {"step": 2, "lr": 0.5}}
    dcp.save(state, storage_writer=GefenFileSystemWriter(path), planner=GefenSavePlanner())
    return model, optimizer


def test_the_reader_reads_what_torch_reads(tmp_path: Path) -> None:
    _saved(tmp_path)
    ours = read_dcp_metadata(tmp_path / ".metadata")
    theirs = FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    folder = read_dcp_metadata(tmp_path)  # the checkpoint folder, as the file-system reader takes it
    assert folder.state_dict_metadata == theirs.state_dict_metadata


def test_small_items_are_read_whole_and_large_ones_through_torchs_view(tmp_path: Path) -> None:
    """The reader buffers an item of at most ``BUFFERED_ITEM_BYTES`` (one read instead of a
    Python call per unpickler read) and hands larger ones to torch's view; both load the same
    tensors. The hook it overrides must still be torch's."""
    import io

    from gefen_dcp.metadata_reader import BUFFERED_ITEM_BYTES

    assert "_slice_file" in vars(FileSystemReader)  # renamed in torch: the override would be dead
    small, large = torch.arange(10.0), torch.arange(float(BUFFERED_ITEM_BYTES // 4 + 1))
    dcp.save({"small": small, "large": large}, checkpoint_id=tmp_path)
    reader = GefenFileSystemReader(tmp_path)
    metadata = reader.read_metadata()
    kinds = {}
    for index, info in metadata.storage_data.items():
        with open(tmp_path / info.relative_path, "rb") as stream:
            view = reader._slice_file(stream, info)
            kinds[index.fqn] = type(view) is io.BytesIO
            assert torch.equal(torch.load(view, weights_only=True), {"small": small, "large": large}[index.fqn])
    assert kinds == {"small": True, "large": False}
    loaded = {"small": torch.zeros(10), "large": torch.zeros_like(large)}
    dcp.load(loaded, storage_reader=GefenFileSystemReader(tmp_path))
    assert torch.equal(loaded["small"], small) and torch.equal(loaded["large"], large)


def test_a_hostile_metadata_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    model, optimizer = _saved(tmp_path)
    marker = tmp_path.parent / f"{tmp_path.name}-marker"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(hostile_object(marker)))
    with pytest.raises(MetadataFormatError, match=r"io\.open.*not one of DCP's metadata classes"):
        read_dcp_metadata(tmp_path / ".metadata")
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(state, storage_reader=GefenFileSystemReader(tmp_path), planner=GefenLoadPlanner())
    assert "not one of DCP's metadata classes; refused unread" in str(caught.value)
    assert not marker.exists()
    # the control: torch's own reader runs it
    FileSystemReader(tmp_path).read_metadata()
    assert marker.exists()


def test_a_byte_io_entry_loads_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    dcp.save({"extra": {"planted": hostile_object(marker), "step": 7}}, checkpoint_id=tmp_path / "ckpt")
    reader = GefenFileSystemReader(tmp_path / "ckpt")
    with pytest.raises(CheckpointException) as caught:
        dcp.load({"extra": {"planted": None, "step": 0}}, storage_reader=reader, planner=GefenLoadPlanner())
    assert "extra.planted" in repr(caught.value) and "weights_only" in repr(caught.value)
    assert not marker.exists()
    # plain values still load, and DCP's default planner would have run the planted call
    state: dict[str, Any] = {"extra": {"step": 0}}
    dcp.load(state, storage_reader=GefenFileSystemReader(tmp_path / "ckpt"), planner=GefenLoadPlanner())
    assert state["extra"]["step"] == 7
    dcp.load({"extra": {"planted": None}}, checkpoint_id=tmp_path / "ckpt", planner=DefaultLoadPlanner())
    assert marker.exists()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x80\x04Nr\xff\xff\xff\x7f.", "memo write 2147483647"),  # LONG_BINPUT far past the memo
        (b"\x80\x04Nj\x05\x00\x00\x00.", "memo read 5"),  # LONG_BINGET of nothing
        (b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\x00\x00", "well-formed"),  # BINBYTES8 longer than the file
        (b"\x80\x04\x95", "well-formed"),  # truncated FRAME
        (b"\x80\x04K\x01.", "holds a int, not DCP Metadata"),
    ],
)
def test_malformed_metadata_is_refused_before_anything_is_built(data: bytes, match: str) -> None:
    with pytest.raises(MetadataFormatError, match=match):
        read_dcp_metadata(data)


def test_the_size_limit(tmp_path: Path) -> None:
    _saved(tmp_path)
    size = (tmp_path / ".metadata").stat().st_size
    read_dcp_metadata(tmp_path / ".metadata", max_bytes=size)
    with pytest.raises(MetadataFormatError, match=f"holds {size} bytes, over the {size - 1}-byte limit"):
        read_dcp_metadata(tmp_path / ".metadata", max_bytes=size - 1)
    with pytest.raises(ValueError, match="max_bytes"):
        read_dcp_metadata(tmp_path / ".metadata", max_bytes=0)


_CAMPAIGN = textwrap.dedent(
    """
    import json, random, resource, sys
    from gefen_dcp import MetadataFormatError, read_dcp_metadata
    from torch.distributed.checkpoint.metadata import Metadata

    data = open(sys.argv[1], "rb").read()
    trials = int(sys.argv[2])
    # cap the address space at what the process maps now plus 1 GiB
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))
    counts = {"trials": 0, "refused": 0, "loaded": 0}
    rng = random.Random(0)
    hostile = [b"\\x80\\x04Nr\\xff\\xff\\xff\\x7f.", b"\\x80\\x04Nr\\x00\\x00\\x00\\x40."]
    for trial in range(trials):
        if trial < len(hostile):
            mutated = hostile[trial]
        else:
            mutated = bytearray(data)
            position = rng.randrange(len(mutated))
            mutated[position] ^= 1 << rng.randrange(8)
            mutated = bytes(mutated)
        counts["trials"] += 1
        try:
            result = read_dcp_metadata(mutated)
        except MetadataFormatError:
            counts["refused"] += 1
        else:
            assert type(result) is Metadata
            counts["loaded"] += 1
    print(json.dumps(counts))
    """
)


def test_bit_flip_campaign_stays_within_a_capped_address_space(tmp_path: Path) -> None:
    """Every flipped bit of a real ``.metadata`` (and the memo bombs) is refused with
    ``MetadataFormatError`` or read as Metadata, under an address-space cap of 1 GiB over
    the process's mapping: a memo bomb read by plain pickle would need 16 GiB."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the address-space cap reads /proc/self/statm")
    _saved(tmp_path / "ckpt")
    trials = int(os.environ.get("GEFEN_CAMPAIGN_TRIALS", "300"))
    done = subprocess.run(
        [sys.executable, "-c", _CAMPAIGN, str(tmp_path / "ckpt" / ".metadata"), str(trials)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"metadata corruption campaign: {counts}")
    assert counts["trials"] == trials and counts["refused"] + counts["loaded"] == trials
    assert counts["refused"] >= 2


def test_plain_pickle_would_blow_the_same_cap() -> None:
    """The control for the campaign's cap: the memo bomb under the same cap fails plain pickle."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the address-space cap reads /proc/self/statm")
    script = textwrap.dedent(
        """
        import pickle, resource
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), mapped + (1 << 30)))
        try:
            pickle.loads(b"\\x80\\x04Nr\\x00\\x00\\x00\\x40.")
        except MemoryError:
            print("MemoryError")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert "MemoryError" in done.stdout, (done.stdout, done.stderr[-500:])

"""Ragged last blocks: a tensor (or flattened shard) whose size has no divisor in
``[MIN_ROW_PERIOD, RAGGED_PERIOD]`` takes blocks of 2048 with a shorter last one, instead of one
block per element (9 bytes a parameter). What a ragged block means (the reference), how a
checkpoint gives its period back, and that the state stays about one byte a parameter and
round-trips bit for bit through the native state dict and the portable document."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, block_count
from gefen_core import Gefen
from gefen_core.periods import MIN_ROW_PERIOD, RAGGED_PERIOD, memory_safe_fallback, period_from_blocks
from gefen_core.reference_ops import block_step_tensor
from gefen_core.step_scalars import host_scalars
from gefen_dcp import GefenFileSystemWriter, load_portable_dcp, save_portable_dcp
from kernels_parity_helpers import shared_codebook
from torch.distributed.checkpoint import FileSystemReader

INDICES, MAGNITUDE, VMEAN = "m_codes", "m_magnitude", "vmean"
#: 2 x 43691 (a prime): no divisor between 2 and 43691, as a near-even third of a flattened matrix often is.
AWKWARD = 87382


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_a_ragged_last_block_is_a_block_of_its_own_length() -> None:
    """The reference's definition: stepping ``2 * 2048 + 37`` elements in blocks of 2048 equals
    stepping the first 4096 in blocks of 2048 and the last 37 as one block of 37, bit for bit
    (nearest rounding; the padding of the last row of codes is never touched)."""
    torch.manual_seed(3)
    numel, period = 2 * 2048 + 37, 2048
    param, grad = torch.randn(numel), torch.randn(numel)
    codes = torch.randint(0, 256, (3, period), dtype=torch.uint8)
    codes[2, 37:] = 0
    scales, vmean = torch.rand(3, 1) * 0.1, torch.rand(3, 1) * 1e-2
    codebook = shared_codebook()
    scalars = host_scalars(
        torch.device("cpu"), lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=2, age=2, factored=False
    )
    flags = {"apply_decay": True, "maximize": False, "deterministic": False}
    whole = (param.clone(), codes.clone(), scales.clone(), vmean.clone())
    block_step_tensor(whole[0], grad, whole[1], whole[2], whole[3], codebook, scalars, None, **flags)
    head = (param[:4096].clone(), codes[:2].clone(), scales[:2].clone(), vmean[:2].clone())
    block_step_tensor(head[0], grad[:4096], head[1], head[2], head[3], codebook, scalars, None, **flags)
    tail = (param[4096:].clone(), codes[2:, :37].clone(), scales[2:].clone(), vmean[2:].clone())
    block_step_tensor(tail[0], grad[4096:].clone(), tail[1], tail[2], tail[3], codebook, scalars, None, **flags)
    assert torch.equal(whole[0], torch.cat([head[0], tail[0]]))
    assert torch.equal(whole[1][:2], head[1]) and torch.equal(whole[1][2, :37], tail[1][0])
    assert not whole[1][2, 37:].any(), "the padding codes were written"
    assert torch.equal(whole[2], torch.cat([head[2], tail[2]])) and torch.equal(whole[3], torch.cat([head[3], tail[3]]))


def test_ragged_blocks_replace_per_element_state_and_their_count_gives_the_period_back() -> None:
    assert memory_safe_fallback(AWKWARD, None) == RAGGED_PERIOD
    assert memory_safe_fallback(16 * 5471, None) == RAGGED_PERIOD  # 5471 is prime: blocks of 16 would cost 1.5 B
    assert memory_safe_fallback(7, None) == 1
    assert memory_safe_fallback(1500, None) == 1500
    for numel in list(range(8, 5000)) + list(range(AWKWARD - 300, AWKWARD + 300)) + [2**22 + 1, 3 * 1_747_626]:
        period = memory_safe_fallback(numel, None)
        assert period == 1 or period >= MIN_ROW_PERIOD or period == numel, numel
        assert period_from_blocks(numel, block_count(numel, period)) == period, numel


def _gefen(param: torch.nn.Parameter, **options: object) -> Gefen:
    return Gefen([("weight", param)], lr=1e-2, **options)  # type: ignore[arg-type]


def _steps(optimizers: list[tuple[torch.nn.Parameter, Gefen]], seed: int, count: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        grad = torch.randn(AWKWARD, generator=generator)
        for param, optimizer in optimizers:
            param.grad = grad.clone()
            optimizer.step()


@pytest.mark.parametrize("fused", [None, False], ids=["kernel", "reference"])
def test_an_awkward_size_keeps_about_one_byte_a_parameter_and_round_trips_bit_exactly(fused: bool | None) -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(AWKWARD))
    optimizer = _gefen(param, fused=fused, codebook_refresh_every=2)  # a codebook refresh requantises the codes
    _steps([(param, optimizer)], 1, 3)
    state = optimizer.state[param]
    assert tuple(state[INDICES].shape) == (43, RAGGED_PERIOD)
    state_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert state_bytes <= 1.02 * AWKWARD  # was 9 bytes a parameter (period 1)
    assert not state[INDICES].view(-1)[AWKWARD:].any(), "the padding must stay 0"
    saved = optimizer.state_dict()
    assert tuple(saved["state"][0][INDICES].shape) == (AWKWARD,)  # shaped like the parameter, no padding
    assert tuple(saved["state"][0][MAGNITUDE].shape) == (43,)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    twin_param = torch.nn.Parameter(param.detach().clone())
    twin = _gefen(twin_param, fused=fused, codebook_refresh_every=2)
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    for key in (INDICES, MAGNITUDE, VMEAN):
        assert torch.equal(twin.state[twin_param][key], state[key]), key
    _steps([(param, optimizer), (twin_param, twin)], 2, 3)
    assert torch.equal(param, twin_param)
    assert torch.equal(twin.state[twin_param][INDICES], state[INDICES])


def test_an_awkward_size_round_trips_through_the_portable_document(tmp_path: Path) -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(AWKWARD))
    optimizer = _gefen(param)
    _steps([(param, optimizer)], 1, 3)
    binding = CheckpointProcessGroupBinding(ProcessGroupIdentity("tests.single", ("rank:0",)), "rank:0", None, "cpu")
    save_portable_dcp(
        optimizer,
        checkpoint_process_group=binding,
        storage_writer=GefenFileSystemWriter(str(tmp_path)),
        transaction_id="save",
        limits=PortableStateLimits(),
    )
    on_disk = sum(path.stat().st_size for path in tmp_path.rglob("*") if path.is_file())
    assert on_disk <= 1.01 * AWKWARD + 16384, on_disk / AWKWARD  # codes, 2 x 43 block values, fixed framing
    twin_param = torch.nn.Parameter(param.detach().clone())
    twin = _gefen(twin_param)
    load_portable_dcp(
        twin,
        checkpoint_process_group=binding,
        storage_reader=FileSystemReader(str(tmp_path)),
        transaction_id="load",
        limits=PortableStateLimits(),
    )
    for key in (INDICES, MAGNITUDE, VMEAN):
        assert torch.equal(twin.state[twin_param][key], optimizer.state[param][key]), key
    _steps([(param, optimizer), (twin_param, twin)], 2, 2)
    assert torch.equal(param, twin_param)


@pytest.mark.parametrize("numel", [AWKWARD + 3000, AWKWARD - 3000])
def test_a_ragged_state_refuses_a_resized_parameter(numel: int) -> None:
    """A size that needs more or fewer blocks is a resize (refused before any change)."""
    param = torch.nn.Parameter(torch.randn(AWKWARD))
    optimizer = _gefen(param)
    _steps([(param, optimizer)], 1, 1)
    param.data = torch.randn(numel)
    param.grad = torch.randn(numel)
    with pytest.raises(ValueError, match="resized"):
        optimizer.preflight_step()


def test_gefen_inspect_reads_a_ragged_checkpoint_and_catches_a_wrong_block_count(tmp_path: Path) -> None:
    from gefen.inspect import inspect_checkpoint

    param = torch.nn.Parameter(torch.randn(AWKWARD))
    optimizer = _gefen(param)
    _steps([(param, optimizer)], 1, 1)
    path = tmp_path / "ragged.pt"
    torch.save(optimizer.state_dict(), path)
    description = inspect_checkpoint(path)
    assert description.ok, description.format_text()
    assert "period 2048" in description.format_text()
    saved = optimizer.state_dict()
    saved["state"][0][MAGNITUDE] = saved["state"][0][MAGNITUDE][:-1].clone()  # 42 blocks: no period gives them
    torch.save(saved, path)
    assert not inspect_checkpoint(path).ok

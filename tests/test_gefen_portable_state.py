"""Gefen's and GefenMuon's portable state through gefen-portable's driver and gefen-dcp's
``save_portable_dcp`` / ``load_portable_dcp`` in one process (the implicit replicated layout,
a one-member checkpoint binding): the loaded optimizer continues bit-exactly, and a document of
the other implementation is refused with the optimizer unchanged."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts import StateValidationError
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_core import Gefen, GefenMuon
from gefen_dcp import GefenFileSystemWriter, load_portable_dcp, save_portable_dcp
from gefen_portable import export_portable_state, import_portable_state, reseal_document
from torch.distributed.checkpoint import FileSystemReader

LIMITS = PortableStateLimits(chunk_bytes=4096)  # several chunks per field even for small tensors


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
    torch.set_num_threads(previous)


class Matrices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(32, 16) * 0.5)
        self.hidden = torch.nn.Linear(16, 48, bias=False)
        self.head = torch.nn.Linear(48, 8, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed[tokens])))  # type: ignore[no-any-return]


def _build(kind: str) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = Matrices()
    if kind == "muon":
        return model, GefenMuon(model.named_parameters(), lr=2e-2, fused=False)
    return model, Gefen(model.named_parameters(), lr=1e-2, fused=False)


def _train(model: torch.nn.Module, optimizer: Any, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(300 + step)
        tokens = torch.randint(0, 32, (6, 5), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(tokens), torch.randn(6, 5, 8, generator=generator))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _binding() -> CheckpointProcessGroupBinding:
    return CheckpointProcessGroupBinding(ProcessGroupIdentity("tests.single", ("rank:0",)), "rank:0", None, "cpu")


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_portable_dcp_round_trip_continues_bit_exactly(kind: str, tmp_path: Path) -> None:
    model, optimizer = _build(kind)
    _train(model, optimizer, 0, 4)
    save_portable_dcp(
        optimizer,
        checkpoint_process_group=_binding(),
        storage_writer=GefenFileSystemWriter(str(tmp_path)),
        transaction_id="save",
        limits=LIMITS,
    )
    twin_model, twin = _build(kind)
    twin_model.load_state_dict(model.state_dict())
    load_portable_dcp(
        twin,
        checkpoint_process_group=_binding(),
        storage_reader=FileSystemReader(str(tmp_path)),
        transaction_id="load",
        limits=LIMITS,
    )
    assert twin.global_step == optimizer.global_step == 4
    assert _train(model, optimizer, 4, 5) == _train(twin_model, twin, 4, 5)
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_document_of_the_other_implementation_is_refused_unchanged() -> None:
    model, muon = _build("muon")
    _train(model, muon, 0, 2)
    state = export_portable_state(muon, checkpoint_process_group=_binding(), transaction_id="export", limits=LIMITS)
    other_model, gefen = _build("gefen")
    _train(other_model, gefen, 0, 1)
    before = deep_snapshot(gefen)
    with pytest.raises(StateValidationError, match=r"'gefen\.GefenMuon'"):
        import_portable_state(gefen, state, checkpoint_process_group=_binding(), transaction_id="import", limits=LIMITS)
    assert not snapshot_diff(before, gefen)


@pytest.mark.parametrize("flag", ["amsgrad", "differentiable"])
def test_an_import_whose_options_ask_for_what_gefen_refuses_is_refused_unchanged(flag: str) -> None:
    """A document recording ``amsgrad=True`` (or ``differentiable=True``) for a parameter is
    refused as the constructor refuses it; it used to land in the live group and be ignored."""
    model, source = _build("gefen")
    _train(model, source, 0, 2)
    document = export_portable_state(
        source, checkpoint_process_group=_binding(), transaction_id="export", limits=LIMITS
    ).materialize()
    for entry in document["parameters"].values():
        entry["options"][flag] = True
    reseal_document(document)
    _, target = _build("gefen")
    before = deep_snapshot(target)
    with pytest.raises(StateValidationError, match=rf"'embed': invalid recorded option: {flag}=True"):
        import_portable_state(
            target, document, checkpoint_process_group=_binding(), transaction_id="import", limits=LIMITS
        )
    assert not snapshot_diff(before, target)


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_portable_export_holds_the_compact_state_about_one_byte_per_parameter(kind: str) -> None:
    """Codes (uint8, one per element) and fp32 block scales: the fragments hold 1 + 4/P (+ 4/P
    for a block second moment) bytes per element, not dense fp32 fields."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(512, 256, bias=False))
    optimizer: Any = (GefenMuon if kind == "muon" else Gefen)(model.named_parameters(), lr=1e-2, fused=False)
    model(torch.randn(4, 256)).square().mean().backward()
    optimizer.step()
    state = export_portable_state(optimizer, checkpoint_process_group=_binding(), transaction_id="size", limits=LIMITS)
    numel = sum(p.numel() for p in model.parameters())
    record = state.catalog.parameters["0.weight"]
    assert record.fields["momentum_codes"].dtype is torch.uint8 and record.fields["momentum_scale"].blocked
    assert numel <= state.local_bytes <= 1.05 * numel, state.local_bytes / numel


def test_an_import_onto_the_exporting_layout_keeps_each_fragments_own_blocks(tmp_path: Path) -> None:
    """The projection hands a piece that is exactly one fragment its block fields as exported,
    and Gefen keeps the source's blocks, codes and scales as they are (no expansion, no
    re-encoding): the same state, bit for bit, as importing the expanded record and re-blocking."""
    import gefen_core.gefen_exchange as adapter
    from gefen_contracts.torch_support import as_imported

    model, optimizer = _build("gefen")
    _train(model, optimizer, 0, 3)
    kept: list[bool] = []
    original = adapter.own_blocks_entry

    def spy(*args: Any, **kwargs: Any) -> Any:
        entry = original(*args, **kwargs)
        kept.append(entry is not None)
        return entry

    twin_model, twin = _build("gefen")
    twin_model.load_state_dict(model.state_dict())
    state = export_portable_state(optimizer, checkpoint_process_group=_binding(), transaction_id="e", limits=LIMITS)
    try:
        adapter.own_blocks_entry = spy  # type: ignore[assignment]
        import_portable_state(twin, state, checkpoint_process_group=_binding(), transaction_id="i", limits=LIMITS)
    finally:
        adapter.own_blocks_entry = original  # type: ignore[assignment]
    assert kept and all(kept), kept
    exported = optimizer.portable_export()
    expanded = [
        as_imported(slot, tuple(param.shape)) if slot.block_fields else slot
        for slot, param in zip(exported.slots, model.parameters(), strict=True)
    ]
    _, other = _build("gefen")
    staged = other.portable_prepare_import(
        implementation=exported.implementation, policy=exported.policy, common=exported.common, slots=expanded
    )
    other.portable_commit_import(staged)
    for param, twin_param, other_param in zip(optimizer.state, twin.state, other.state, strict=True):
        for key, value in optimizer.state[param].items():
            for loaded in (twin.state[twin_param][key], other.state[other_param][key]):
                assert torch.equal(loaded, value) if isinstance(value, torch.Tensor) else loaded == value, key


@pytest.mark.parametrize("shape", [(2, 3), (1, 7), (16, 32)], ids=["six", "seven", "zero-momentum"])
def test_muon_state_of_small_and_still_matrices_round_trips_bit_for_bit(shape: tuple[int, int]) -> None:
    """GefenMuon's import took Gefen's period search: period 1 for a matrix under 8 elements and
    a whole-matrix block for all-zero momentum, neither of which GefenMuon's state holds, so the
    import of its own export was refused. It takes the shape rule a step takes."""
    generator = torch.Generator().manual_seed(0)
    still = shape == (16, 32)  # its gradients are all zero: momentum exists and is zero
    named = [("w", torch.nn.Parameter(torch.randn(shape, generator=generator)))]
    named.append(("v", torch.nn.Parameter(torch.randn(8, 8, generator=generator))))
    source = GefenMuon(named, lr=1e-2, fused=False)
    for _ in range(2):
        named[0][1].grad = torch.zeros(shape) if still else torch.randn(shape, generator=generator)
        named[1][1].grad = torch.randn(8, 8, generator=generator)
        source.step()
    limits = PortableStateLimits()
    document = export_portable_state(
        source, checkpoint_process_group=_binding(), transaction_id="out", limits=limits
    ).materialize()
    twin = GefenMuon([(n, torch.nn.Parameter(p.detach().clone())) for n, p in named], lr=1e-2, fused=False)
    import_portable_state(twin, document, checkpoint_process_group=_binding(), transaction_id="in", limits=limits)
    for mine, theirs in zip(source.state.values(), twin.state.values()):
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            assert torch.equal(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key], key

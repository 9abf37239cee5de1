"""ContractedAdamW and the composite through gefen-portable and gefen-dcp in one process: portable
documents (the composite's through gefen-portable's composite wrapper) survive a weights-only
file and continue bit-exactly,
corrupted documents are refused with the optimizer deep-snapshot unchanged, and the composite
(ContractedAdamW + a test-local child) round-trips through save_portable_dcp / load_portable_dcp
and GefenDCPState."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gefen_contracts import ContractError, ContractTypeError
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import deep_snapshot, snapshot_diff
from gefen_contracts.torch_support import CheckpointProcessGroupBinding, tensor_digest
from gefen_dcp import (
    GefenDCPState,
    GefenFileSystemWriter,
    GefenLoadPlanner,
    GefenSavePlanner,
    load_portable_dcp,
    save_portable_dcp,
)
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from gefen_portable import (
    PortableStateError,
    export_portable_composite_state,
    export_portable_state,
    import_portable_composite_state,
    import_portable_state,
    reseal_document,
)
from sign_momentum_child import sign_child_factory
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

BINDING = CheckpointProcessGroupBinding(ProcessGroupIdentity("solo", ("rank:0",)), "rank:0", None, "cpu")
LIMITS = PortableStateLimits()


@pytest.fixture(autouse=True)
def _quiet_single_process_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.hidden = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.hidden(self.embed(tokens).mean(dim=1)))))  # type: ignore[no-any-return]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 12, (4, 3), generator=generator)
    return nn.functional.mse_loss(model(tokens), torch.randn(4, 3, generator=generator))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        optimizer.step()


def _adamw(model: nn.Module, **options: Any) -> ContractedAdamW:
    return ContractedAdamW(model.named_parameters(), lr=options.pop("lr", 1e-2), **options)


def _composite(model: nn.Module) -> CompositeOptimizer:
    backup = lambda named: ContractedAdamW(named, lr=1e-2)  # noqa: E731
    return CompositeOptimizer.from_factories(model, {"muon": sign_child_factory, "backup": backup})


Build = Callable[[nn.Module], torch.optim.Optimizer]


def _trained(build: Build, steps: int = 3, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    optimizer = build(model)
    _train(model, optimizer, steps)
    return model, optimizer


def _twin_of(model: nn.Module, build: Build) -> tuple[nn.Module, torch.optim.Optimizer]:
    twin = copy.deepcopy(model)
    return twin, build(twin)


def _continues_identically(a: tuple[nn.Module, Any], b: tuple[nn.Module, Any], start: int = 3) -> bool:
    _train(*a, 3, start=start)
    _train(*b, 3, start=start)
    return all(torch.equal(x, y) for x, y in zip(a[0].parameters(), b[0].parameters()))


def _weights_only(document: Any, path: Path) -> Any:
    torch.save(document, path)
    return torch.load(path, weights_only=True)


def test_a_contracted_adamw_document_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    model, optimizer = _trained(lambda m: _adamw(m, amsgrad=True))
    before = deep_snapshot(optimizer, model)
    document = export_portable_state(
        optimizer, checkpoint_process_group=BINDING, transaction_id="save", limits=LIMITS
    ).materialize()
    assert not snapshot_diff(before, optimizer, model)
    assert document["implementation"] == "gefen.ContractedAdamW"
    record = document["parameters"]["hidden.weight"]
    assert (record["variant"], record["counters"], sorted(record["fields"])) == (
        "adamw_amsgrad",
        {"step": 3},
        ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
    )
    loaded = _weights_only(document, tmp_path / "adamw.pt")
    twin = _twin_of(model, lambda m: _adamw(m, lr=0.5, amsgrad=True))
    import_portable_state(twin[1], loaded, checkpoint_process_group=BINDING, transaction_id="load", limits=LIMITS)
    assert twin[1].param_groups[0]["lr"] == 1e-2  # hyperparameters come from the document
    again = export_portable_state(twin[1], checkpoint_process_group=BINDING, transaction_id="again", limits=LIMITS)
    assert again.materialize()["completion"]["digest"] == document["completion"]["digest"]
    assert _continues_identically((model, optimizer), twin)


def test_a_composite_document_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    model, optimizer = _trained(_composite)
    with pytest.raises(ContractTypeError, match="export_portable_composite_state"):
        export_portable_state(optimizer, checkpoint_process_group=BINDING, transaction_id="s", limits=LIMITS)
    exported = export_portable_composite_state(
        optimizer, checkpoint_process_group=BINDING, transaction_id="s", limits=LIMITS
    )
    assert exported.roles == ("muon", "backup")
    document = _weights_only(exported.materialize(), tmp_path / "composite.pt")
    assert document["children"]["backup"]["implementation"] == "gefen.ContractedAdamW"
    twin = _twin_of(model, _composite)
    import_portable_composite_state(twin[1], document, checkpoint_process_group=BINDING, transaction_id="l",
                                    limits=LIMITS)  # fmt: skip
    assert _continues_identically((model, optimizer), twin)


# -- corrupted documents ----------------------------------------------------------------------------


def _reseal(document: dict[str, Any]) -> None:
    reseal_document(document)


def _reseal_wrapper(wrapper: dict[str, Any]) -> None:
    """The documented wrapper digest: everything but ``completion``, each child by its own digest."""
    payload = {key: value for key, value in wrapper.items() if key != "completion"}
    payload["children"] = {role: child["completion"]["digest"] for role, child in wrapper["children"].items()}
    wrapper["completion"]["digest"] = tensor_digest(payload)


def _edit_record(fqn: str, edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def apply(document: dict[str, Any]) -> None:
        edit(document["parameters"][fqn])
        _reseal(document)

    return apply


def _flip_byte(document: dict[str, Any]) -> None:
    document["parameters"]["hidden.weight"]["fragments"][0]["fields"]["exp_avg"].view(-1)[0] += 1.0


def _negate(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda record: record["fragments"][0]["fields"][name].neg_().sub_(1.0)


def _amsgrad_everywhere(document: dict[str, Any]) -> None:
    for record in document["parameters"].values():
        record["options"]["amsgrad"] = True
    _reseal(document)


ADAMW_CORRUPTIONS: list[tuple[str, Callable[[dict[str, Any]], None], type[Exception], str]] = [
    ("flipped tensor byte", _flip_byte, PortableStateError, "digest"),
    ("zero step", _edit_record("hidden.bias", lambda r: r["counters"].update(step=0)), ContractError, "counters"),
    ("amsgrad flipped in every record", _amsgrad_everywhere, ContractError, "amsgrad"),
    (
        "another variant",
        _edit_record("norm.weight", lambda r: r.update(variant="adamw_amsgrad")),
        ContractError,
        "fields",
    ),
    ("negative second moment", _edit_record("head.bias", _negate("exp_avg_sq")), ContractError, "negative"),
    (
        "one parameter's lr differs",
        _edit_record("embed.weight", lambda r: r["options"].update(lr=0.5)),
        ContractError,
        "group options",
    ),
]


@pytest.mark.parametrize(
    ("name", "corrupt", "error", "fragment"), ADAMW_CORRUPTIONS, ids=[c[0] for c in ADAMW_CORRUPTIONS]
)
def test_corrupted_adamw_documents_are_refused_and_change_nothing(
    name: str, corrupt: Callable[[dict[str, Any]], None], error: type[Exception], fragment: str
) -> None:
    _, source = _trained(_adamw)
    document = export_portable_state(source, checkpoint_process_group=BINDING, transaction_id="s", limits=LIMITS)
    corrupted = document.materialize()
    corrupt(corrupted)
    model, target = _trained(_adamw, steps=4, seed=1)
    before = deep_snapshot(target, model)
    with pytest.raises(error, match=fragment):
        import_portable_state(target, corrupted, checkpoint_process_group=BINDING, transaction_id="l", limits=LIMITS)
    assert not snapshot_diff(before, target, model)


def test_fp32_state_is_refused_by_a_bfloat16_target_instead_of_rounded() -> None:
    _, source = _trained(_adamw)
    document = export_portable_state(source, checkpoint_process_group=BINDING, transaction_id="s", limits=LIMITS)
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    target = _adamw(model)
    before = deep_snapshot(target, model)
    with pytest.raises(ContractError, match="cannot represent exactly"):
        import_portable_state(target, document, checkpoint_process_group=BINDING, transaction_id="l", limits=LIMITS)
    assert not snapshot_diff(before, target, model)


def _reroute_wrapper(wrapper: dict[str, Any]) -> None:
    wrapper["routing"]["hidden.weight"] = "backup"
    _reseal_wrapper(wrapper)


def _child_counter(wrapper: dict[str, Any]) -> None:
    backup = wrapper["children"]["backup"]
    backup["parameters"]["norm.bias"]["counters"]["step"] = 0
    _reseal(backup)
    _reseal_wrapper(wrapper)


COMPOSITE_CORRUPTIONS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("routing changed", _reroute_wrapper, "routing"),
    ("a child's counter", _child_counter, "counters"),
]


@pytest.mark.parametrize(
    ("name", "corrupt", "fragment"), COMPOSITE_CORRUPTIONS, ids=[c[0] for c in COMPOSITE_CORRUPTIONS]
)
def test_corrupted_composite_documents_leave_both_children_unchanged(
    name: str, corrupt: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    _, source = _trained(_composite)
    exported = export_portable_composite_state(source, checkpoint_process_group=BINDING, transaction_id="s",
                                               limits=LIMITS)  # fmt: skip
    document = exported.materialize()
    corrupt(document)
    model, target = _trained(_composite, steps=4, seed=1)
    before = deep_snapshot(target, model)
    with pytest.raises((ContractError, PortableStateError), match=fragment):
        import_portable_composite_state(target, document, checkpoint_process_group=BINDING, transaction_id="l",
                                        limits=LIMITS)  # fmt: skip
    assert not snapshot_diff(before, target, model)


def test_a_document_routed_otherwise_than_the_target_names_the_parameter() -> None:
    """A consistent document of a composite that routes one matrix to the other child: the
    refusal names it (it said only that roles or routing differ)."""
    _, source = _trained(_composite)
    document = export_portable_composite_state(source, checkpoint_process_group=BINDING, transaction_id="s",
                                               limits=LIMITS).materialize()  # fmt: skip
    torch.manual_seed(1)
    model = Net()
    routed = dict(source.parameter_routing())  # type: ignore[attr-defined]
    routed["head.weight"] = "muon"
    split = {role: [(n, p) for n, p in model.named_parameters() if routed[n] == role] for role in ("muon", "backup")}
    backup = lambda named: ContractedAdamW(named, lr=1e-2)  # noqa: E731
    target = CompositeOptimizer.from_factories(split, {"muon": sign_child_factory, "backup": backup})
    before = deep_snapshot(target, model)
    with pytest.raises(
        PortableStateError,
        match=r"routing differs from the target composite's: parameter 'head\.weight' is routed to 'backup' in the "
        r"checkpoint but to 'muon' here",
    ):
        import_portable_composite_state(target, document, checkpoint_process_group=BINDING, transaction_id="l",
                                        limits=LIMITS)  # fmt: skip
    assert not snapshot_diff(before, target, model)


# -- DCP -------------------------------------------------------------------------------------------


def test_the_composite_round_trips_through_save_and_load_portable_dcp(tmp_path: Path) -> None:
    model, optimizer = _trained(_composite)
    save_portable_dcp(
        optimizer,
        checkpoint_process_group=BINDING,
        storage_writer=GefenFileSystemWriter(tmp_path / "portable"),
        transaction_id="save",
        limits=LIMITS,
    )
    twin = _twin_of(model, _composite)
    load_portable_dcp(
        twin[1],
        checkpoint_process_group=BINDING,
        storage_reader=FileSystemReader(tmp_path / "portable"),
        transaction_id="load",
        limits=LIMITS,
    )
    assert _continues_identically((model, optimizer), twin)


def test_the_composite_round_trips_beside_its_model_through_gefen_dcp_state(tmp_path: Path) -> None:
    model, optimizer = _trained(_composite)
    state = {"model": model.state_dict(), "optim": GefenDCPState(optimizer)}
    dcp.save(state, storage_writer=GefenFileSystemWriter(tmp_path / "dense"), planner=GefenSavePlanner())
    torch.manual_seed(7)
    fresh = Net()
    twin = (fresh, _composite(fresh))
    target = {"model": fresh.state_dict(), "optim": GefenDCPState(twin[1])}
    dcp.load(target, checkpoint_id=tmp_path / "dense", planner=GefenLoadPlanner())
    fresh.load_state_dict(target["model"])
    assert _continues_identically((model, optimizer), twin)

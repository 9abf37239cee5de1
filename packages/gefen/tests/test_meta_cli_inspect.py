"""``gefen inspect``: every checkpoint kind is described, and every corruption is named (exit 1)."""

from __future__ import annotations

import argparse
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen.cli.main import main
from gefen.inspect import inspect_checkpoint
from gefen_contracts.identity import ProcessGroupIdentity
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.testing import hostile_object
from gefen_contracts.torch_support import CheckpointProcessGroupBinding
from gefen_core import Gefen, GefenMuon
from gefen_core.native_format import VERSION as NATIVE_VERSION
from gefen_dcp import GefenFileSystemWriter, save_portable_dcp
from gefen_portable import export_portable_state
from meta_portable_sgd import IMPLEMENTATION, factory


def _stepped(optimizer: torch.optim.Optimizer, steps: int = 2) -> torch.optim.Optimizer:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return optimizer


def _parameters() -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 16), (4, 16), (16,)]  # factored, per-element (narrower than 8) and block v
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


@pytest.fixture(scope="module")
def portable_optimizer() -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = factory(list(model.named_parameters()))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return optimizer


def _binding() -> CheckpointProcessGroupBinding:
    return CheckpointProcessGroupBinding(
        ProcessGroupIdentity("inspect.test", ("rank:0",)), "rank:0", None, torch.device("cpu")
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, portable_optimizer: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {name: root / f"{name}.pt" for name in ("gefen", "muon", "adamw", "portable")}
    gefen = Gefen(_parameters(), lr=1e-2, fused=False, min_dim_size_to_factor=8)
    torch.save(_stepped(gefen).state_dict(), paths["gefen"])
    muon_parameter = torch.nn.Parameter(torch.randn(16, 32, generator=torch.Generator().manual_seed(2)))
    torch.save(_stepped(GefenMuon([muon_parameter], lr=1e-2, fused=False)).state_dict(), paths["muon"])
    torch.save(_stepped(torch.optim.AdamW(_parameters()), 1).state_dict(), paths["adamw"])
    limits = PortableStateLimits()
    state = export_portable_state(
        portable_optimizer, checkpoint_process_group=_binding(), transaction_id="inspect-export", limits=limits
    )
    torch.save(state.materialize(), paths["portable"])
    paths["dcp"] = root / "dcp"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_portable_dcp(
            portable_optimizer,
            checkpoint_process_group=_binding(),
            storage_writer=GefenFileSystemWriter(str(paths["dcp"])),
            transaction_id="inspect-save",
            limits=limits,
        )
    return paths


def test_native_gefen_state_dict_is_described(checkpoints: dict[str, Path]) -> None:
    description = inspect_checkpoint(checkpoints["gefen"])
    assert description.ok, description.format_text()
    assert (description.format, description.format_version, description.implementation) == (
        "gefen.native_state",
        NATIVE_VERSION,
        "gefen.Gefen",
    )
    facts = dict(description.facts)
    assert facts["global step"] == "2" and facts["codebook"] == "256 entries"
    assert [p.variant for p in description.parameters] == ["factored", "element", "block"]
    assert [p.shape for p in description.parameters] == [
        (8, 16),
        (4, 16),
        (16,),
    ]  # the codes are shaped like the parameter
    stored = torch.load(checkpoints["gefen"], weights_only=True)
    expected = sum(
        value.numel() * value.element_size()
        for entry in stored["state"].values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )
    assert sum(p.state_bytes for p in description.parameters) == expected


def test_a_scale_not_shaped_by_the_parameter_is_a_problem(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    stored = torch.load(checkpoints["gefen"], weights_only=True)
    entry = stored["state"][2]  # the 16-element bias: one block of 16
    entry["m_magnitude"] = entry["m_magnitude"].reshape(-1, 1)  # version 2's [blocks, 1]
    path = tmp_path / "reshaped.pt"
    torch.save(stored, path)
    description = inspect_checkpoint(path)
    assert not description.ok
    assert any(p.where.endswith(".m_magnitude") for p in description.problems), [
        (p.where, p.message) for p in description.problems
    ]


@pytest.mark.parametrize("kind", ["gefen", "muon"])
@pytest.mark.parametrize("keep", ["mirrors", "top level"])
def test_a_record_kept_one_way_only_is_ok_as_the_load_finds_it(
    checkpoints: dict[str, Path], tmp_path: Path, kind: str, keep: str
) -> None:
    """torch's DCP helpers keep only the group mirrors; a load reads the record from either
    (or both, agreeing), and so does inspect (it called a mirror-only state dict CORRUPT)."""
    stored = torch.load(checkpoints[kind], weights_only=True)
    if keep == "mirrors":
        stored = {key: value for key, value in stored.items() if not key.startswith("gefen_")}
    else:
        for group in stored["param_groups"]:
            del group["_gefen_checkpoint_metadata"]
    path = tmp_path / "one_way.pt"
    torch.save(stored, path)
    description = inspect_checkpoint(path)
    assert description.ok, description.format_text()
    assert dict(description.facts)["global step"] == "2"
    if kind == "muon":
        return
    optimizer = Gefen(_parameters())
    optimizer.load_state_dict(torch.load(path, weights_only=True))  # what the load accepts
    del stored["param_groups"][0]["_gefen_checkpoint_metadata" if keep == "mirrors" else "lr"]
    torch.save(stored, path)
    assert not inspect_checkpoint(path).ok


@pytest.mark.parametrize("kind", ["gefen", "muon"])
def test_a_group_without_a_required_option_is_corrupt(checkpoints: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """The saved groups are checked by the load's own rule (they were never checked: a state
    dict the optimizer refuses, lacking ``lr``, was OK)."""
    stored = torch.load(checkpoints[kind], weights_only=True)
    del stored["param_groups"][0]["lr"]
    path = tmp_path / "no_lr.pt"
    torch.save(stored, path)
    description = inspect_checkpoint(path)
    assert not description.ok
    assert [(p.where, p.message) for p in description.problems] == [("param_groups[0]", "lacks options ['lr']")]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["a", "b"], "holds 2 names for 3 parameters"),
        (["a", "b", "a"], "repeats the name(s) ['a']"),
        (7, "must be a list of str, got int"),
    ],
    ids=["short", "repeated", "not_a_list"],
)
def test_param_names_that_contradict_the_groups_are_corrupt(
    checkpoints: dict[str, Path], tmp_path: Path, names: object, message: str
) -> None:
    """The load refuses them; inspect said OK (it labelled the parameters by position instead)."""
    stored = torch.load(checkpoints["gefen"], weights_only=True)
    stored["param_groups"][0]["param_names"] = names
    torch.save(stored, tmp_path / "names.pt")
    description = inspect_checkpoint(tmp_path / "names.pt")
    assert ("param_groups[0].param_names", message) in [(p.where, p.message) for p in description.problems]
    assert not description.ok


def test_an_unreadable_record_is_one_problem(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Not two: an unreadable record used to read as "codebook not learned" beside its own problem."""
    stored = torch.load(checkpoints["gefen"], weights_only=True)
    stored["gefen_format_version"] = 9
    torch.save(stored, tmp_path / "v9.pt")
    problems = inspect_checkpoint(tmp_path / "v9.pt").problems
    assert [p.where for p in problems] == ["gefen record"] and "version 9" in problems[0].message


def test_native_muon_and_torch_state_dicts_are_described(checkpoints: dict[str, Path]) -> None:
    muon = inspect_checkpoint(checkpoints["muon"])
    assert muon.ok and muon.format == "gefen.muon_native_state" and muon.implementation == "gefen.GefenMuon"
    assert [p.variant for p in muon.parameters] == ["muon"]
    adamw = inspect_checkpoint(checkpoints["adamw"])
    assert adamw.ok and adamw.implementation is None
    assert [p.shape for p in adamw.parameters] == [(8, 16), (4, 16), (16,)]
    assert adamw.parameters[0].variant == "exp_avg+exp_avg_sq+step"


def _with_owner_manifest(state_dict: dict[str, Any], manifest: str) -> dict[str, Any]:
    """A GefenMuon state dict carrying ``manifest`` where a multi-rank save writes it (the top
    level and every group's mirror), its state digest recomputed over it."""
    from gefen_core.muon_native_state import FORMAT
    from gefen_core.native_records import GROUP_MIRROR, with_state_digest

    state_dict = with_state_digest(FORMAT, {**state_dict, "gefen_muon_owners": manifest})
    for group in state_dict["param_groups"]:
        mirror = {
            **json.loads(group[GROUP_MIRROR]),
            "owners": manifest,
            "state_digest": state_dict["gefen_state_digest"],
        }
        group[GROUP_MIRROR] = json.dumps(mirror, sort_keys=True, separators=(",", ":"))
    return state_dict


def test_a_muon_owner_manifest_is_described_and_a_malformed_one_named(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    saved = torch.load(checkpoints["muon"], weights_only=True)
    manifest = {"ownership": "stable_index_mod_world", "consolidated": True, "world_size": 2, "entries": []}
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save(_with_owner_manifest(saved, json.dumps(manifest)), good)
    torch.save(_with_owner_manifest(saved, "{not json"), bad)
    described = inspect_checkpoint(good)
    assert described.ok and ("owners", "stable_index_mod_world, saved on 2 rank(s)") in described.facts
    broken = inspect_checkpoint(bad)
    assert not broken.ok and [p.where for p in broken.problems] == ["gefen_muon_owners"], broken.problems


def test_portable_document_and_dcp_folder_are_verified(checkpoints: dict[str, Path]) -> None:
    document = inspect_checkpoint(checkpoints["portable"])
    assert document.ok and document.format == "gefen.portable_state" and document.implementation == IMPLEMENTATION
    assert {p.name for p in document.parameters} == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert document.tensor_bytes == (8 * 4 + 8 + 2 * 8 + 2) * 4  # one fp32 momentum buffer per element
    assert any("completion digest" in item for item in document.verified)
    folder = inspect_checkpoint(checkpoints["dcp"])
    assert folder.ok, folder.format_text()
    (child,) = folder.children
    assert child.implementation == IMPLEMENTATION and len(child.parameters) == 4
    assert any("SHA-256" in item for item in child.verified)
    assert dict(child.facts)["root digest"] == dict(document.facts)["root digest"]  # the same state, two formats


def test_cli_prints_a_report_and_json(checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(checkpoints["gefen"])]) == 0
    text = capsys.readouterr().out
    assert f"gefen.native_state v{NATIVE_VERSION}" in text and "OK: no problem found" in text and "factored" in text
    assert main(["inspect", str(checkpoints["dcp"]), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True and document["children"][0]["format"] == "gefen.portable_dcp"
    assert main(["inspect", str(checkpoints["dcp"]), "--no-verify"]) == 0
    text = capsys.readouterr().out
    assert "verified: envelope" not in text and "--no-verify: DCP data was not read" in text


def _corrupt_native(path: Path, target: Path) -> None:
    stored = torch.load(path, weights_only=True)
    stored["state"][2]["vmean"] = torch.full_like(stored["state"][2]["vmean"], float("nan"))
    stored["state"][0]["v_col"] = stored["state"][0]["v_col"][:-1].clone()
    torch.save(stored, target)


def test_corrupted_native_state_names_parameter_and_key(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "broken.pt"
    _corrupt_native(checkpoints["gefen"], target)
    description = inspect_checkpoint(target)
    assert not description.ok
    wheres = " | ".join(str(problem) for problem in description.all_problems())
    assert "vmean" in wheres and "v_col" in wheres, wheres
    assert main(["inspect", str(target)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "PROBLEM" in out and "vmean" in out


def test_corrupted_portable_document_fails_its_digest(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    document = torch.load(checkpoints["portable"], weights_only=True)
    tensors = [value for value in _walk(document["parameters"]) if isinstance(value, torch.Tensor)]
    assert tensors, "the document must hold the momentum buffers as tensors"
    tensors[0].view(-1)[0] += 1.0
    target = tmp_path / "tampered.pt"
    torch.save(document, target)
    description = inspect_checkpoint(target)
    assert not description.ok
    assert "digest" in " ".join(p.message for p in description.all_problems()).lower()


def _walk(value: object) -> list[object]:
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _walk(item)]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _walk(item)]
    return [value]


def test_corrupted_dcp_chunk_is_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "dcp"
    shutil.copytree(checkpoints["dcp"], copy)
    needle = _momentum_bytes(torch.load(checkpoints["portable"], weights_only=True))
    (data,) = [path for path in copy.glob("*.distcp") if needle in path.read_bytes()]  # stored verbatim, once
    raw = bytearray(data.read_bytes())
    raw[raw.find(needle)] ^= 0xFF
    data.write_bytes(bytes(raw))
    description = inspect_checkpoint(copy)
    assert not description.ok
    problems = description.all_problems()
    assert problems and all(p.where.startswith("optimizer") for p in problems), problems
    assert "SHA-256" in problems[0].message and "'0.weight'" in problems[0].message, problems  # the largest buffer
    assert main(["inspect", str(copy)]) == 1


@pytest.mark.parametrize("verify", [True, False])
def test_a_dcp_folder_without_its_data_files_is_corrupt_not_a_traceback(
    checkpoints: dict[str, Path], tmp_path: Path, verify: bool
) -> None:
    """torch raises a ``CheckpointException`` (a ``BaseException``) for a missing data file; the
    catalog's reader let it escape as a traceback, even with ``--no-verify``."""
    import shutil

    copy = tmp_path / "dcp"
    shutil.copytree(checkpoints["dcp"], copy)
    for data in copy.glob("*.distcp"):
        data.unlink()
    description = inspect_checkpoint(copy, verify=verify)
    assert not description.ok and description.all_problems()
    assert main(["inspect", str(copy), *([] if verify else ["--no-verify"])]) == 1


def _momentum_bytes(document: dict[str, Any]) -> bytes:
    tensors = [value for value in _walk(document["parameters"]) if isinstance(value, torch.Tensor)]
    largest = max(tensors, key=lambda t: t.numel())
    return largest.contiguous().numpy().tobytes()


def test_unknown_formats_are_never_ok_and_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """They were CORRUPT (exit 1), or OK ("verified: nothing") for a DCP folder of torch's recipe."""
    (tmp_path / "garbage.pt").write_bytes(b"not a pickle at all")
    torch.save({"model": {"weights": torch.ones(2)}, "step": 3}, tmp_path / "model.pt")
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("no checkpoint here")
    model = torch.nn.Linear(4, 4)
    recipe = tmp_path / "recipe"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict()}, checkpoint_id=str(recipe))
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    (unreadable / ".metadata").write_bytes(b"written by some other torch")
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    marker = tmp_path / "marker"
    # a pickle that would create `marker` if unpickled: gefen inspect must not run it
    (hostile / ".metadata").write_bytes(pickle.dumps(hostile_object(marker)))
    expected = {
        "garbage.pt": "cannot read it",
        "model.pt": "none an optimizer state gefen knows",
        "model.safetensors": "safetensors",
        "folder": "without DCP's .metadata",
        "recipe": "without a gefen-dcp namespace",
        "unreadable": "cannot read",
        "hostile": "io.open, which is not one of DCP's metadata classes",
    }
    for name, recognised in expected.items():
        description = inspect_checkpoint(tmp_path / name)
        assert description.status == "UNKNOWN FORMAT" and not description.ok and not description.all_problems(), name
        assert recognised in dict(description.facts)["recognised"], (name, description.facts)
        assert main(["inspect", str(tmp_path / name)]) == 3, name
        assert "UNKNOWN FORMAT" in capsys.readouterr().out
    assert not marker.exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(tmp_path / "absent")])
    assert exit_info.value.code == 2 and "no checkpoint at" in capsys.readouterr().err


def test_a_training_dict_and_a_checkpoint_folder_are_read(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    native = torch.load(checkpoints["gefen"], weights_only=True)
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": native, "step": 7}, tmp_path / "train.pt")
    described = inspect_checkpoint(tmp_path / "train.pt")
    assert described.status == "OK", described.format_text()
    assert [child.format for child in described.children] == ["gefen.native_state"]
    folder = tmp_path / "checkpoint-100"  # a Hugging Face Trainer checkpoint folder
    folder.mkdir()
    torch.save(native, folder / "optimizer.pt")
    (folder / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (folder / "trainer_state.json").write_text("{}")
    described = inspect_checkpoint(folder)
    assert described.status == "OK" and [child.path for child in described.children] == [str(folder / "optimizer.pt")]
    broken = dict(native)
    broken["gefen_format_version"] = 2
    torch.save({"optimizer": broken}, tmp_path / "old.pt")
    assert inspect_checkpoint(tmp_path / "old.pt").status == "CORRUPT"  # a version Gefen cannot load is never OK


def test_gefen_dcp_state_checkpoint_is_verified_and_a_flipped_chunk_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from gefen_dcp import GefenDCPState, GefenSavePlanner
    from gefen_dcp.testing import conformance_factory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = conformance_factory(list(model.named_parameters()))  # gefen-dcp's Int8MomentumSGD adopter
    model(torch.randn(5, 16)).sum().backward()
    optimizer.step()
    root = tmp_path / "compact"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"optim": GefenDCPState(optimizer), "model": model.state_dict()},
            storage_writer=GefenFileSystemWriter(root),
            planner=GefenSavePlanner(),
        )
    folder = inspect_checkpoint(root)
    assert folder.ok, folder.format_text()
    # the model's weights carry no digest: OK says nothing about them, and the facts say so
    assert dict(folder.facts)["other keys"].endswith("; not verified"), folder.facts
    (child,) = folder.children
    from gefen_dcp import DCP_STATE_FORMAT_VERSION

    assert child.format == "gefen.dcp_state" and child.format_version == DCP_STATE_FORMAT_VERSION
    assert len(child.parameters) == 4
    first = {p.name: p for p in child.parameters}["state/0"]
    assert first.shape == (32, 16) and first.state_bytes == 32 * 16 + 32 * 4  # int8 codes + fp32 row scales
    codes = optimizer.state_dict()["state"][0]["momentum_int8"]
    needle = codes.contiguous().numpy().tobytes()
    (data,) = [path for path in root.glob("*.distcp") if needle in path.read_bytes()]  # stored verbatim, once
    raw = bytearray(data.read_bytes())
    raw[raw.find(needle) + 5] ^= 0x01
    data.write_bytes(bytes(raw))
    broken = inspect_checkpoint(root)
    assert not broken.ok
    assert any("state/0/momentum_int8" in str(problem) for problem in broken.all_problems()), broken.format_text()


def test_canonical_local_state_document_is_validated(tmp_path: Path) -> None:
    from gefen_contracts.testing import flattened_plan
    from gefen_hybrid import ContractedAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    optimizer = ContractedAdamW(named, lr=1e-3)
    plan = flattened_plan(named, 0)  # member 0 of a two-member flattened layout
    optimizer.post_sharding(list(plan.rebindings), manifest=plan.manifest)
    for target in plan.targets.values():
        target.grad = torch.randn_like(target)
    optimizer.step()
    document = optimizer.export_local_state()
    torch.save(document, tmp_path / "bound.pt")
    description = inspect_checkpoint(tmp_path / "bound.pt")
    assert description.ok, description.format_text()
    assert (description.format, description.implementation) == ("gefen.bound_state", "gefen.ContractedAdamW")
    assert {p.name: p.shape for p in description.parameters}["0.weight"] == (8, 4)  # the global shape
    document["parameters"]["0.weight"]["state"]["exp_avg"].view(-1)[0] = float("nan")
    torch.save(document, tmp_path / "tampered.pt")
    problems = inspect_checkpoint(tmp_path / "tampered.pt").all_problems()
    assert problems and "parameters['0.weight'].state.exp_avg" in problems[0].message, problems


def _adamw_state(**entry: Any) -> dict[str, Any]:
    state = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5), **entry}
    return {"state": {0: state}, "param_groups": [{"params": [0], "lr": 1e-3}]}


def _recursive() -> dict[str, Any]:
    loop: list[object] = []
    loop.append(loop)
    return {"format": "gefen.portable_state", "x": loop}


HOSTILE: dict[str, tuple[object, str]] = {
    "a composite document with nothing in it": (
        {"format": "gefen.composite_bound_state", "children": {}, "routing": []},
        "CORRUPT",
    ),
    "a composite routing of mixed types": (
        {"format": "gefen.composite_bound_state", "children": {}, "routing": [1, "a"]},
        "CORRUPT",
    ),
    "an unhashable format": ({"format": [1]}, "UNKNOWN FORMAT"),
    "params that are an int": ({"state": {}, "param_groups": [{"params": 5}]}, "CORRUPT"),
    "no param groups (it read OK)": ({"state": {}, "param_groups": []}, "CORRUPT"),
    "moments of two shapes": (_adamw_state(exp_avg_sq=torch.zeros(2, 3)), "CORRUPT"),
    "a negative step": (_adamw_state(step=torch.tensor(-7.5)), "CORRUPT"),
    "a list that holds itself": (_recursive(), "CORRUPT"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_malformed_records_are_reported_never_a_traceback(name: str, tmp_path: Path) -> None:
    """Whatever ``torch.load(weights_only=True)`` rebuilds, the inspector reports on it; it
    neither raises nor says OK for a record it did not check."""
    value, status = HOSTILE[name]
    path = tmp_path / "state.pt"
    torch.save(value, path)
    assert inspect_checkpoint(path).status == status


def test_a_folder_with_a_truncated_file_beside_a_good_one_is_corrupt(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copy(checkpoints["gefen"], folder / "optim_rank0.pt")
    (folder / "optim_rank1.pt").write_bytes(checkpoints["gefen"].read_bytes()[:100])
    torch.save({"args": argparse.Namespace(x=1)}, folder / "training_args.bin")  # pickles weights_only refuses: fine
    description = inspect_checkpoint(folder)
    assert description.status == "CORRUPT"
    assert [p.where for p in description.problems] == ["optim_rank1.pt"]


def test_a_truncated_torch_save_file_is_corrupt_not_unknown(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint that no longer reads (a copy cut short) was UNKNOWN FORMAT (exit 3), as for a
    file that never was a checkpoint; it starts like a torch.save file, so it is CORRUPT (exit 1)."""
    cut = tmp_path / "cut.pt"
    cut.write_bytes(checkpoints["gefen"].read_bytes()[:-100])
    description = inspect_checkpoint(cut)
    assert description.status == "CORRUPT", description.format_text()
    assert "starts like a torch.save file: truncated or damaged" in description.problems[0].message
    assert main(["inspect", str(cut)]) == 1
    assert "CORRUPT" in capsys.readouterr().out


def test_a_container_names_what_it_did_not_verify(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A training script's ``{"model", "optimizer", "step"}`` said OK with only the optimizer
    checked: the model's weights carry no digest, and now the description says they were not
    verified."""
    container = tmp_path / "train.pt"
    optimizer = torch.load(checkpoints["gefen"], weights_only=True)
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": optimizer, "step": 3}, container)
    description = inspect_checkpoint(container)
    assert description.ok, description.format_text()
    assert dict(description.facts)["not verified"] == "model, step (no optimizer state; not checked)"
    assert "not verified" in description.format_text()

"""Canonical local state (``gefen.bound_state``) of Gefen and GefenMuon: routing by exact FQN
across regrouped and reordered targets, prepare without mutation, stale and reused
preparations refused without mutation, corrupted documents refused, and a golden vector
that pins the document format."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts import StaleTransactionError, StateValidationError
from gefen_contracts.testing import deep_snapshot, install_parameters, replicated_copy_plan, snapshot_diff
from gefen_contracts.torch_support import tensor_digest
from gefen_core import Gefen, GefenMuon
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)
from test_core_identity import _equal, _loss, _net, _refused, _train
from torch import nn

GOLDEN = Path(__file__).parent / "golden" / "gefen_bound_state_v1.json"
REGEN = os.environ.get("GEFEN_REGEN_GOLDEN") == "1"
KINDS = {"gefen": Gefen, "muon": GefenMuon}


def _build(kind: str, model: nn.Module, grouping: str = "source") -> Any:
    """``kind`` over ``model`` grouped like the source (embed | proj, head with lr 3e-3) or
    regrouped and reordered (head | proj | embed, each group its own options)."""
    named = dict(model.named_parameters())
    if grouping == "source":
        groups = [
            {"params": [("embed", named["embed"])]},
            {"params": [("proj.weight", named["proj.weight"]), ("head.weight", named["head.weight"])], "lr": 3e-3},
        ]
    else:
        groups = [
            {"params": [("head.weight", named["head.weight"])], "lr": 0.5},
            {"params": [("proj.weight", named["proj.weight"])]},
            {"params": [("embed", named["embed"])], "lr": 0.25},
        ]
    return KINDS[kind](groups, lr=1e-2, fused=False)


def _bound(kind: str, grouping: str = "source", seed: int = 0) -> tuple[nn.Module, Any]:
    model = _net(seed)
    optimizer = _build(kind, model, grouping)
    plan = replicated_copy_plan(list(model.named_parameters()))
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in model.named_parameters()})
    return model, optimizer


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_regrouped_reordered_target_continues_bit_exactly(kind: str) -> None:
    model, optimizer = _bound(kind)
    _train(model, optimizer, 3)
    document = optimizer.export_local_state()
    target_model, target = _bound(kind, "regrouped", seed=1)
    target_model.load_state_dict(model.state_dict())
    target.commit_local_import(target.prepare_local_import(document))
    assert [g["lr"] for g in target.param_groups] == [3e-3, 3e-3, 1e-2]  # options travel with each FQN
    assert target.global_step == optimizer.global_step and torch.equal(target.codebook, optimizer.codebook)
    _train(model, optimizer, 3, start=3)
    _train(target_model, target, 3, start=3)
    assert _equal(model, target_model)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prepare_changes_neither_the_target_nor_the_document(kind: str) -> None:
    model, optimizer = _bound(kind)
    _train(model, optimizer, 2)
    document = optimizer.export_local_state()
    target_model, target = _bound(kind, "regrouped")
    before = deep_snapshot(target, target_model, document)
    staged = target.prepare_local_import(document)
    assert snapshot_diff(before, target, target_model, document) == []
    pristine_document = deep_snapshot(document)
    target.commit_local_import(staged)
    _train(target_model, target, 1, start=2)
    assert snapshot_diff(pristine_document, document) == []  # the committed state owns no part of the document


def test_a_parameter_that_never_stepped_travels_as_uninitialized() -> None:
    model, optimizer = _bound("gefen")
    optimizer.zero_grad(set_to_none=True)
    _loss(model, 0).backward()
    model.embed.grad = None
    optimizer.step()
    document = optimizer.export_local_state()
    assert document["parameters"]["embed"]["variant"] == "uninitialized"
    target_model, target = _bound("gefen", "regrouped")
    target_model.load_state_dict(model.state_dict())
    target.commit_local_import(target.prepare_local_import(document))
    assert not target.state.get(target_model.embed)
    _train(model, optimizer, 2, start=1)
    _train(target_model, target, 2, start=1)
    assert _equal(model, target_model)


CHANGES = {
    "stepped": lambda m, o: _train(m, o, 1, start=5),
    "option": lambda m, o: o.param_groups[0].__setitem__("lr", 0.5),
    "state_in_place": lambda m, o: (
        next(v for s in o.state.values() for v in s.values() if torch.is_tensor(v)).view(torch.uint8).add_(1)
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_preparation_outdated_by_a_change_is_refused_without_mutation(change: str) -> None:
    model, optimizer = _bound("gefen")
    _train(model, optimizer, 2)
    document = optimizer.export_local_state()
    staged = optimizer.prepare_local_import(document)
    CHANGES[change](model, optimizer)
    _refused(optimizer, (model,), lambda: optimizer.commit_local_import(staged), StaleTransactionError, ".")


def test_a_preparation_is_single_use_and_bound_to_its_optimizer() -> None:
    model, optimizer = _bound("gefen")
    _train(model, optimizer, 2)
    document = optimizer.export_local_state()
    other_model, other = _bound("gefen")
    staged = optimizer.prepare_local_import(document)
    _refused(other, (other_model,), lambda: other.commit_local_import(staged), StaleTransactionError, "another")
    optimizer.commit_local_import(staged)
    _refused(optimizer, (model,), lambda: optimizer.commit_local_import(staged), StaleTransactionError, "consumed")


def _corrupt(document: dict[str, Any], how: str) -> dict[str, Any]:
    import copy

    bad = copy.deepcopy(document)
    entry = bad["parameters"]["proj.weight"]
    if how == "missing_parameter":
        del bad["parameters"]["proj.weight"]
    elif how == "wrong_variant":
        entry["variant"] = "uninitialized"
    elif how == "codebook_shape":
        bad["common"]["codebook"] = torch.zeros(255)
    elif how == "global_step":
        bad["common"]["global_step"] = -1
    elif how == "scope":
        bad["common"]["codebook_scope"] = {"semantic_name": "dp", "ordered_members": ["rank:0", "rank:1"]}
    elif how == "policy":
        bad["policy"] = {**bad["policy"], "deterministic": not bad["policy"]["deterministic"]}
    elif how == "non_finite":
        key = next(k for k, v in entry["state"].items() if torch.is_tensor(v) and v.is_floating_point())
        entry["state"][key] = torch.full_like(entry["state"][key], float("nan"))
    return bad


@pytest.mark.parametrize(
    "how", ["missing_parameter", "wrong_variant", "codebook_shape", "global_step", "scope", "policy", "non_finite"]
)
def test_a_corrupted_document_is_refused_without_mutation(how: str) -> None:
    model, optimizer = _bound("gefen")
    _train(model, optimizer, 2)
    bad = _corrupt(optimizer.export_local_state(), how)
    target_model, target = _bound("gefen", "regrouped")
    _train(target_model, target, 1)
    _refused(target, (target_model, bad), lambda: target.prepare_local_import(bad), StateValidationError, ".")


# -- the golden vector ------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "uint8": torch.uint8, "int64": torch.int64, "float16": torch.float16}


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return {"tensor": dtype, "shape": list(value.shape), "values": value.reshape(-1).tolist()}
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_json(item) for item in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "shape", "values"}:
        return torch.tensor(value["values"], dtype=_DTYPES[value["tensor"]]).reshape(value["shape"])
    if isinstance(value, dict):
        return {key: _from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[0.5, -0.25, 1.0, 0.0], [0.125, -1.0, 0.75, 0.25]]))
        self.b = nn.Parameter(torch.zeros(4))


def _golden_pair() -> tuple[_Tiny, Gefen]:
    model = _Tiny()
    optimizer = Gefen(list(model.named_parameters()), lr=0.125, weight_decay=0.0, fused=False, deterministic=True)
    plan = replicated_copy_plan(list(model.named_parameters()))
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in model.named_parameters()})
    return model, optimizer


def test_the_document_format_is_pinned_by_a_golden_vector() -> None:
    """A one-step document of a tiny Gefen (power-of-two values, deterministic) is pinned as JSON
    plus its canonical digest; the pinned document imports. Regenerate deliberately with
    ``GEFEN_REGEN_GOLDEN=1`` after a format change (and bump the format version)."""
    model, optimizer = _golden_pair()
    model.w.grad = torch.tensor([[0.5, -0.5, 0.25, -0.25], [1.0, -1.0, 0.125, 0.0]])
    model.b.grad = None
    optimizer.step()
    document = optimizer.export_local_state()
    actual = {"digest": tensor_digest(document), "document": _to_json(document)}
    if REGEN:
        GOLDEN.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert actual["document"] == expected["document"], "the gefen.bound_state document drifted from its golden vector"
    assert actual["digest"] == expected["digest"]
    twin_model, twin = _golden_pair()
    twin.commit_local_import(twin.prepare_local_import(_from_json(expected["document"])))
    assert twin.global_step == 1 and torch.equal(twin.codebook, optimizer.codebook)
    assert not twin.state.get(twin_model.b)

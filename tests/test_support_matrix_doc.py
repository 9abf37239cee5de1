"""docs/support-matrix.md says exactly what the shipped optimizers' contracts claim, and names real tests."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gefen_contracts import OptimizerCapabilities
from gefen_contracts.enums import CheckpointTransport, ParameterLayout
from gefen_contracts.testing import flattened_plan
from gefen_core import Gefen, GefenMuon
from gefen_example_sgd import ContractedSGD
from gefen_hybrid import CompositeOptimizer, ContractedAdamW

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "docs" / "support-matrix.md"
COLUMNS = {
    "replicated": ParameterLayout.REPLICATED,
    "flattened": ParameterLayout.FLATTENED_ELEMENT_SHARD,
    "owner": ParameterLayout.WHOLE_PARAMETER_OWNER,
    "dtensor": ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
}


def _named() -> list[tuple[str, torch.nn.Parameter]]:
    return [("w", torch.nn.Parameter(torch.ones(4, 4))), ("b", torch.nn.Parameter(torch.ones(4)))]


def _composite(named: list[tuple[str, torch.nn.Parameter]]) -> CompositeOptimizer:
    factories = {"muon": lambda n: ContractedAdamW(n, lr=1e-3), "backup": lambda n: ContractedAdamW(n, lr=1e-3)}
    return CompositeOptimizer.from_factories(named, factories)


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "Gefen": lambda: Gefen(_named()),
    "GefenMuon": lambda: GefenMuon([("w", torch.nn.Parameter(torch.ones(4, 4)))]),
    "ContractedAdamW": lambda: ContractedAdamW(_named()),
    "CompositeOptimizer": lambda: _composite(_named()),
    "ContractedSGD": lambda: ContractedSGD(_named(), lr=0.1),
}


def _table(marker: str) -> list[dict[str, str]]:
    text = MATRIX.read_text(encoding="utf-8")
    match = re.search(rf"<!-- matrix:{marker} -->\n(.*?)<!-- /matrix -->", text, re.S)
    assert match, f"docs/support-matrix.md has no <!-- matrix:{marker} --> table"
    lines = [line for line in match.group(1).strip().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = []
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), line
        rows.append(dict(zip(header, cells)))
    return rows


YES, NO = "\u2713", "\u2013"  # the page's check mark and en dash


def _mark(cell: str) -> bool:
    assert cell in (YES, NO), f"a matrix cell must be {YES} or {NO}, got {cell!r}"
    return cell == YES


def _layout_claims(capabilities: OptimizerCapabilities) -> dict[str, set[ParameterLayout]]:
    claims: dict[str, set[ParameterLayout]] = {"training": {t.layout for t in capabilities.training}}
    for transport in CheckpointTransport:
        claims[transport.value] = set()
    for support in capabilities.checkpoints:
        claims[support.transport.value] |= set(support.same_topology)
    return claims


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_layout_and_transport_cells_match_the_contract(name: str) -> None:
    claims = _layout_claims(OPTIMIZERS[name]().optimizer_contract().capabilities)
    rows = {row["claim"]: row for row in _table("layouts") if row["optimizer"] == name}
    assert set(rows) == set(claims), f"{name}: the matrix must list training and every transport"
    for claim, row in rows.items():
        documented = {layout for column, layout in COLUMNS.items() if _mark(row[column])}
        assert documented == claims[claim], f"{name} {claim}: matrix {documented} vs contract {claims[claim]}"
        assert bool(documented) == bool(row["proven by"]), f"{name} {claim}: a claimed row names its tests"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_feature_cells_match_the_contract(name: str) -> None:
    features = OPTIMIZERS[name]().optimizer_contract().capabilities.features
    (row,) = [row for row in _table("features") if row["optimizer"] == name]
    documented = {key for key in row if key not in ("optimizer", "proven by") and _mark(row[key])}
    columns = set(row) - {"optimizer", "proven by"}
    assert columns <= set(features), f"unknown feature columns {columns - set(features)}"
    assert documented == {key for key in columns if features[key].supported}
    assert {key for key, status in features.items() if status.supported} <= columns, "a claimed feature is missing"


def test_every_named_test_file_exists() -> None:
    named = set(re.findall(r"`((?:packages/[\w.-]+/)?tests/[\w/]+\.py)`", MATRIX.read_text(encoding="utf-8")))
    assert len(named) >= 15
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"docs/support-matrix.md names test files that do not exist: {missing}"


def test_binding_adds_the_canonical_claims_the_page_mentions() -> None:
    named = _named()
    optimizer = ContractedAdamW(named, lr=1e-3)
    plan = flattened_plan(named, 0)
    optimizer.post_sharding(list(plan.rebindings), manifest=plan.manifest)
    features = optimizer.optimizer_contract().capabilities.features
    assert features["canonical_identity"].supported and features["canonical_local_state"].supported


def test_binding_gefen_widens_canonical_global_as_the_page_says() -> None:
    named = _named()
    optimizer = Gefen(named)
    plan = flattened_plan(named, 0)
    optimizer.post_sharding(list(plan.rebindings), manifest=plan.manifest)
    capabilities = optimizer.optimizer_contract().capabilities
    (entry,) = [c for c in capabilities.checkpoints if c.transport is CheckpointTransport.CANONICAL_GLOBAL]
    assert entry.same_topology == {ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD}
    assert entry.allows_transition(ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD)
    assert not capabilities.features["parameter_shaped_state"].supported

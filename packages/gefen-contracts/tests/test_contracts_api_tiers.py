"""The API in tiers: the top level holds the day-one names only, and every topic submodule the
README names resolves and holds what its row lists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import gefen_contracts

README = Path(__file__).parents[1] / "README.md"

#: The day-one tier (README "API in tiers"): the contract, capabilities, state schema, errors.
DAY_ONE = {
    "__version__",
    "OptimizerContract",
    "OptimizerCapabilities",
    "TrainingSupport",
    "CheckpointSupport",
    "FeatureStatus",
    "STANDARD_FEATURES",
    "FEATURE_CANONICAL_IDENTITY",
    "FEATURE_CANONICAL_LOCAL_STATE",
    "FEATURE_COLLECTIVE_SCOPE",
    "FEATURE_COMPOSITE",
    "FEATURE_PARAMETER_SHAPED_STATE",
    "FEATURE_PORTABLE_STATE",
    "FEATURE_POST_SHARDING",
    "FEATURE_STAGED_NATIVE_LOAD",
    "OptimizerStateLayout",
    "StateField",
    "StateVariant",
    "StateGeometry",
    "StateRole",
    "StateScope",
    "ContractError",
    "ContractTypeError",
    "CodecError",
    "StateValidationError",
    "NotSupportedError",
    "StaleTransactionError",
    "LayoutTamperedError",
    "CollectiveFailureError",
    "KernelUnavailableError",
}


def test_the_top_level_is_the_day_one_tier() -> None:
    assert set(gefen_contracts.__all__) == DAY_ONE
    assert len(gefen_contracts.__all__) <= 30
    for name in gefen_contracts.__all__:
        assert getattr(gefen_contracts, name) is not None, name


def _submodule_rows() -> dict[tuple[str, ...], list[str]]:
    """``{(modules of a row): [class names it lists]}`` from the README's submodule table
    (the torch-bound rows excluded)."""
    rows: dict[tuple[str, ...], list[str]] = {}
    for line in README.read_text().splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `gefen_contracts.") or len(cells) < 2:
            continue
        modules = tuple(re.findall(r"`(gefen_contracts(?:\.[a-z_]+)+)`", cells[0]))
        if not modules or any(
            m.startswith(("gefen_contracts.torch_support", "gefen_contracts.testing")) for m in modules
        ):
            continue
        names = re.findall(r"`([A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*)`", " | ".join(cells[1:]))
        rows[modules] = [name for name in names if name not in ("None", "True", "False")]
    return rows


def test_every_documented_submodule_holds_its_listed_names() -> None:
    rows = _submodule_rows()
    documented = {module for modules in rows for module in modules}
    assert {"gefen_contracts.identity", "gefen_contracts.exchange", "gefen_contracts.protocols"} <= documented
    for modules, names in rows.items():
        loaded = [importlib.import_module(module) for module in modules]
        for name in names:
            assert any(hasattr(module, name) for module in loaded), f"{modules} has no {name} (README)"

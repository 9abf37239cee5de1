"""The meta-package's re-exports: every public name resolves to its defining package's object,
and ``import gefen`` stays light (torch is imported on first use of an optimizer name)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import gefen
import gefen_contracts
import pytest

#: The names issue #10 asks ``from gefen import ...`` to give, with the package that defines them.
REQUIRED = {
    "Gefen": "gefen_core",
    "GefenMuon": "gefen_core",
    "GefenMuonHybrid": "gefen.hybrid",
    "ContractedAdamW": "gefen_hybrid",
    "CompositeOptimizer": "gefen_hybrid",
    "export_portable_state": "gefen_portable",
    "import_portable_state": "gefen_portable",
    "save_portable_dcp": "gefen_dcp",
    "load_portable_dcp": "gefen_dcp",
    "GefenDCPState": "gefen_dcp",
}


@pytest.mark.parametrize("name", sorted(set(gefen.__all__) - {"__version__", "contracts"}))
def test_every_exported_name_is_its_defining_packages_object(name: str) -> None:
    value = getattr(gefen, name)
    module = gefen._EXPORTS[name]
    assert value is getattr(importlib.import_module(module), name)
    assert name in dir(gefen)


def test_the_issue_names_and_the_contracts_vocabulary_are_exported() -> None:
    for name, module in REQUIRED.items():
        assert name in gefen.__all__ and gefen._EXPORTS[name] == module
    assert gefen.contracts is gefen_contracts
    assert gefen.contracts.OptimizerContract is gefen_contracts.OptimizerContract
    assert set(gefen._EXPORTS) | {"__version__", "contracts"} == set(gefen.__all__)
    assert isinstance(gefen.__version__, str) and gefen.__version__


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Adam'"):
        gefen.Adam  # noqa: B018


def test_import_gefen_does_not_import_torch_until_an_optimizer_is_used() -> None:
    probe = (
        "import sys, gefen; light = 'torch' not in sys.modules; "
        "gefen.GefenMuonHybrid; print(light, 'torch' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    # nor TorchDynamo until one is built: `gefen --help` and `gefen inspect` build none
    assert result.stdout.split() == ["True", "True", "False"]

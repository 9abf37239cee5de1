"""The layering rule (``tools/layering.py``: a package imports a sibling only through its public API and
only along the allowed edges), enforced from every import in the workspace."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import layering


def test_the_workspace_keeps_the_layering_rule() -> None:
    violations = layering.check_workspace()
    assert not violations, "\n".join(map(str, violations))


def test_every_workspace_package_is_covered() -> None:
    root = layering.ROOT
    found = {str(p.parent.relative_to(root)) for p in root.glob("packages/*/pyproject.toml")}
    found |= {str(p.parent.relative_to(root)) for p in root.glob("docs/examples/*/pyproject.toml")}
    assert found == set(layering.PACKAGES)


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    source = (
        "import gefen_core\n"
        "def f():\n"
        "    from gefen_hybrid import X\n"
        "    import importlib\n"
        "    importlib.import_module('gefen_portable')\n"
        "    __import__('gefen_dcp')\n"
    )
    found = {module for _, module in layering.imported_modules(source)}
    assert {"gefen_core", "gefen_hybrid", "gefen_portable", "gefen_dcp"} <= found
    probe = layering.ROOT / "packages/gefen-hybrid/src/gefen_hybrid/_layering_probe.py"
    probe.write_text(source)
    try:
        messages = [v.message for v in layering.check_file(probe, "gefen_hybrid")]
    finally:
        probe.unlink()
    assert any("must not import gefen_core" in m for m in messages)
    assert any("must not import gefen_portable" in m for m in messages)
    assert any("must not import gefen_dcp" in m for m in messages)


def test_private_submodules_of_a_sibling_are_refused() -> None:
    probe = layering.ROOT / "packages/gefen-core/src/gefen_core/_layering_probe.py"
    probe.write_text(
        "from gefen_contracts._version import __version__\nfrom gefen_contracts.testing import GlooWorld\n"
    )
    try:
        messages = [v.message for v in layering.check_file(probe, "gefen_core")]
    finally:
        probe.unlink()
    assert messages == ["gefen_contracts._version is not public API of gefen_contracts"]

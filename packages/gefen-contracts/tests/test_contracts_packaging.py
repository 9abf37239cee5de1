"""Import hygiene and install-alone: gefen-contracts is stdlib-only at import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
WORKSPACE = PACKAGE_ROOT.parents[1]

HYGIENE = """
import sys
import gefen_contracts
import gefen_contracts.testing
import gefen_contracts.testing.plugin
from gefen_contracts import OptimizerContract
from gefen_contracts.digest import canonical_digest
from gefen_contracts.manifest import ShardingManifest
heavy = sorted(m for m in ("torch", "numpy", "torch.distributed", "deepspeed", "megatron") if m in sys.modules)
print(",".join(heavy) or "clean")
"""


def test_import_loads_no_torch_or_numpy() -> None:
    result = subprocess.run([sys.executable, "-c", HYGIENE], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "clean", result.stdout


def test_version_agrees_with_pyproject() -> None:
    import tomllib

    import gefen_contracts

    project = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == gefen_contracts.__version__
    assert project["dependencies"] == []
    assert (PACKAGE_ROOT / "src" / "gefen_contracts" / "py.typed").exists()


@pytest.mark.slow
def test_wheel_installs_alone_in_a_clean_environment_without_torch(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is required to build the wheel (the README's commands use it)")
    dist = tmp_path / "dist"
    subprocess.run(
        [uv, "build", "--package", "gefen-contracts", "--wheel", "--out-dir", str(dist), "--offline", "--quiet"],
        cwd=WORKSPACE, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    wheels = list(dist.glob("gefen_contracts-*.whl"))
    assert len(wheels) == 1
    venv = tmp_path / "venv"
    subprocess.run(
        [uv, "venv", str(venv), "--python", sys.executable, "--quiet"], check=True, capture_output=True, timeout=120
    )
    python = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "--python", str(python), "--offline", "--quiet", str(wheels[0])],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    probe = (
        "import importlib.util, gefen_contracts as g\n"
        "assert importlib.util.find_spec('torch') is None, 'torch leaked into the clean environment'\n"
        "p = g.identity.ParameterIdentity('a.b', (2, 3))\n"
        "s = g.identity.ShardIdentity(p, g.enums.ParameterLayout.REPLICATED, g.identity.LogicalSlice.full(p))\n"
        "m = g.manifest.ShardingManifest((s,))\n"
        "assert g.codec.from_primitive(g.codec.to_primitive(m)) == m\n"
        "print(g.__version__, g.digest.descriptor_digest(m))\n"
    )
    result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    import gefen_contracts

    assert result.stdout.startswith(gefen_contracts.__version__ + " ")

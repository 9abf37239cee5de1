from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bump_version

ROOT = Path(__file__).resolve().parents[1]


def copy_package(tmp_path: Path, name: str) -> Path:
    target = tmp_path / "packages" / name
    shutil.copytree(ROOT / "packages" / name, target, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    return tmp_path


def test_bump_updates_pyproject_version_file_and_changelog(tmp_path: Path) -> None:
    root = copy_package(tmp_path, "gefen-contracts")
    import gefen_contracts

    current = gefen_contracts.__version__
    major, minor, _ = bump_version.parse(current)
    new = bump_version.bump(root, "gefen-contracts", "minor", today="2026-11-30")
    assert new == f"{major}.{minor + 1}.0"
    package = root / "packages" / "gefen-contracts"
    assert f'version = "{new}"' in (package / "pyproject.toml").read_text()
    assert (package / "src" / "gefen_contracts" / "_version.py").read_text() == f'__version__ = "{new}"\n'
    log = (package / "CHANGELOG.md").read_text()
    assert log.index("## [Unreleased]") < log.index(f"## [{new}] - 2026-11-30")


def test_bump_refuses_bad_input(tmp_path: Path) -> None:
    root = copy_package(tmp_path, "gefen-contracts")
    with pytest.raises(ValueError, match="greater"):
        bump_version.bump(root, "gefen-contracts", "0.0.1")
    with pytest.raises(ValueError, match="no workspace package"):
        bump_version.bump(root, "nope", "minor")
    with pytest.raises(ValueError, match=r"MAJOR\.MINOR\.PATCH"):
        bump_version.next_version("1.0", "minor")
    assert bump_version.main(["nope", "minor", "--root", str(root)]) == 2

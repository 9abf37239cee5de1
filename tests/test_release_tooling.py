"""Release tooling: pins, wheels for every published package, clean-environment installs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import release

ROOT = Path(__file__).resolve().parents[1]


def test_version_ranges() -> None:
    assert release.satisfies("0.1.0", ">=0.1.0,<0.2")
    assert not release.satisfies("0.2.0", ">=0.1.0,<0.2")
    assert release.satisfies("1.2.3", "==1.2.3")
    with pytest.raises(ValueError):
        release.satisfies("1.0.0", "~=1.0")


def test_workspace_pins_are_consistent() -> None:
    assert release.check_pins() == []
    published = set(release.published_packages())
    assert "gefen-example-sgd" not in published
    assert {
        "gefen",
        "gefen-contracts",
        "gefen-core",
        "gefen-kernels",
        "gefen-portable",
        "gefen-dcp",
        "gefen-hybrid",
    } <= published


def test_a_pin_that_excludes_a_sibling_is_reported(tmp_path: Path) -> None:
    for directory in (ROOT / "packages").iterdir():
        if (directory / "pyproject.toml").exists():
            (tmp_path / "packages" / directory.name).mkdir(parents=True)
            shutil.copy(directory / "pyproject.toml", tmp_path / "packages" / directory.name / "pyproject.toml")
    core = tmp_path / "packages" / "gefen-core" / "pyproject.toml"
    core.write_text(core.read_text().replace('version = "', 'version = "9', 1))
    problems = release.check_pins(tmp_path)
    assert any("gefen pins gefen-core" in p for p in problems), problems


@pytest.mark.slow
def test_every_wheel_builds_and_installs_in_a_clean_environment(tmp_path: Path) -> None:
    if shutil.which("uv") is None:
        pytest.fail("uv is required")
    wheels = release.build(tmp_path / "dist")
    assert len(wheels) == len(release.published_packages()) + len(release.CROSS_TARGETS)
    names = {wheel.name for wheel in wheels}
    assert "gefen_kernels-0.1.0-py3-none-manylinux_2_17_aarch64.whl" in names, names
    assert "gefen_kernels-0.1.0-py3-none-manylinux_2_17_x86_64.whl" in names, names
    assert not any(name.endswith("-linux_x86_64.whl") for name in names), "an unrepaired wheel was left"
    lines = release.verify(tmp_path / "dist")
    assert any(line.startswith("gefen-contracts ") and "(alone)" in line for line in lines), lines
    assert len(lines) == len(wheels)
    kernels = next(line for line in lines if line.startswith("gefen-kernels 0.1.0"))
    assert "manylinux_2_" in kernels and "prebuilt 6 libraries" in kernels, kernels
    assert any("manylinux_2_17_aarch64 ok (2 single-threaded aarch64 libraries)" in line for line in lines), lines
    assert any("manylinux_2_17_x86_64 ok" in line and "fused CPU step" in line for line in lines), lines
    (meta,) = [line for line in lines if line.startswith("gefen ")]
    assert "fused CPU step without a compiler on gefen_cpu-" in meta, meta  # a prebuilt library, loaded


def test_a_cross_wheel_for_another_architecture_is_refused(tmp_path: Path) -> None:
    """``verify_cross`` reads the libraries' ELF machine: an x86_64 library in a wheel tagged for
    aarch64 is refused before ``auditwheel`` runs."""
    import zipfile

    wheel = tmp_path / "gefen_kernels-0.1.0-py3-none-manylinux_2_17_aarch64.whl"
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[18:20] = (62).to_bytes(2, "little")  # EM_X86_64
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("gefen_kernels/prebuilt/gefen_cpu-3-armv8-a.so", bytes(header))
    with pytest.raises(RuntimeError, match="another architecture than aarch64"):
        release.verify_cross(wheel, "aarch64", "manylinux_2_17_aarch64")

"""Building the CPU kernel: cache reuse, a missing or failing compiler, and what registration says."""

from __future__ import annotations

import shutil
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gefen_kernels import (
    CpuKernelCacheWarning,
    CpuKernelUnavailableWarning,
    cpu_kernel_status,
    register,
    registered_devices,
)
from gefen_kernels.cpu_build import load_cpu_library, reset_cpu_library


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    monkeypatch.setenv("GEFEN_KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    reset_cpu_library()
    yield tmp_path
    monkeypatch.undo()
    reset_cpu_library()
    if "cpu" not in registered_devices():
        register()  # a test withdrew the CPU kernels: register the real ones again


def test_a_cached_library_is_reused_without_compiling(fresh_build: Path) -> None:
    first = cpu_kernel_status()
    assert first.available and first.compiled and first.build_seconds > 0
    assert Path(first.path).parent == fresh_build / "cache"
    reset_cpu_library()
    second = cpu_kernel_status()
    assert second.available and not second.compiled and second.path == first.path


def test_a_missing_compiler_warns_once_and_declines_cpu_tensors(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GEFEN_KERNELS_CC", str(fresh_build / "absent-cc"))
    with pytest.warns(CpuKernelUnavailableWarning, match="no C compiler found"):
        assert load_cpu_library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_cpu_library() is None  # no second warning
    assert "absent-cc" in cpu_kernel_status().reason
    unavailable = register()
    assert "CPU kernel is unavailable" in unavailable["cpu"] and "cpu" not in registered_devices()
    assert not _has_cpu_kernel("gefen::factored_stats.v2")


def _has_cpu_kernel(op: str) -> bool:
    """Whether ``op`` has a CPU kernel; ``False`` where the op is not defined in this process
    (gefen-core defines it, and this file runs without it when run alone)."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"))
    except RuntimeError:
        return False


def test_a_compiler_that_fails_is_reported_with_its_error(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fresh_build / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'error: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("GEFEN_KERNELS_CC", str(fake))
    with pytest.warns(CpuKernelUnavailableWarning, match="this compiler is broken"):
        assert load_cpu_library() is None
    assert not list((fresh_build / "cache").glob("*.so"))


def test_a_compiler_command_with_arguments_builds(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    monkeypatch.setenv("GEFEN_KERNELS_CC", f"env {compiler}")  # a wrapper, as CC="ccache gcc" is
    status = cpu_kernel_status()
    assert status.available and status.compiled and status.compiler.endswith(f" {compiler}")


def test_without_a_compiler_the_library_built_here_before_is_loaded(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = cpu_kernel_status()
    assert built.available
    reset_cpu_library()
    monkeypatch.setenv("GEFEN_KERNELS_CC", str(fresh_build / "absent-cc"))  # a slim container, a stale CC
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = cpu_kernel_status()
    assert status.available and not status.compiled and status.path == built.path


def test_an_unusable_cache_directory_warns_and_builds_elsewhere(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = fresh_build / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GEFEN_KERNELS_CACHE_DIR", str(blocker / "cache"))  # it raised NotADirectoryError from step()
    with pytest.warns(CpuKernelCacheWarning, match="a-file/cache is unusable"):
        status = cpu_kernel_status()
    assert status.available and Path(status.path).parent != blocker / "cache"


def test_a_fallback_folder_others_can_write_is_not_loaded_from(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback's name is predictable (``gefen-kernels-<uid>`` in the temporary directory):
    when it is writable by others (someone made it first), the library is built in a fresh
    private folder instead of being loaded from there."""
    import os

    blocker = fresh_build / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GEFEN_KERNELS_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("TMPDIR", str(fresh_build / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    shared = fresh_build / "tmp" / f"gefen-kernels-{os.getuid()}"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.warns(CpuKernelCacheWarning):
        status = cpu_kernel_status()
    used = Path(status.path).parent
    assert status.available and used != shared and used.parent == fresh_build / "tmp"
    assert not used.stat().st_mode & 0o077  # mkdtemp's: this user's only


def test_the_switch_disables_the_cpu_kernel(fresh_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEFEN_KERNELS_CPU", "0")
    with pytest.warns(CpuKernelUnavailableWarning, match="GEFEN_KERNELS_CPU=0"):
        assert not cpu_kernel_status().available


def _prebuilt_dir(monkeypatch: pytest.MonkeyPatch, directory: Path) -> Path:
    from gefen_kernels import prebuilt

    directory.mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(prebuilt, "PREBUILT_DIR", directory)
    return directory


def test_prebuilt_candidates_follow_the_cpu_best_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from gefen_kernels.prebuilt import VARIANTS, prebuilt_candidates, variant_file

    directory = _prebuilt_dir(monkeypatch, tmp_path / "prebuilt")
    for variant in VARIANTS:
        for openmp in (True, False):
            (directory / variant_file(2, variant, openmp)).write_bytes(b"")
    avx2 = frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})
    names = [p.name for p in prebuilt_candidates(2, avx2, "x86_64")]
    assert names == [
        "gefen_cpu-2-x86-64-v3-omp.so",
        "gefen_cpu-2-x86-64-v3.so",
        "gefen_cpu-2-x86-64-omp.so",
        "gefen_cpu-2-x86-64.so",
    ]
    plain_arm = [p.name for p in prebuilt_candidates(2, frozenset(), "aarch64")]
    assert plain_arm == ["gefen_cpu-2-armv8-a-omp.so", "gefen_cpu-2-armv8-a.so"]
    assert prebuilt_candidates(3, avx2, "x86_64") == []  # another ABI ships nothing usable
    assert prebuilt_candidates(2, avx2, "riscv64") == []


def test_a_prebuilt_library_is_loaded_first_and_a_broken_one_is_skipped(
    fresh_build: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library shipped in prebuilt/ wins over compiling; one that does not load (here: not a
    shared object) is skipped; GEFEN_KERNELS_PREBUILT=0 ignores them all."""
    import platform

    from gefen_kernels.cpu_build import ABI_VERSION, _cpu_features
    from gefen_kernels.prebuilt import VARIANTS, variant_file

    built = cpu_kernel_status()  # a just-in-time build stands in for a release build
    assert built.available and not built.prebuilt
    directory = _prebuilt_dir(monkeypatch, fresh_build / "prebuilt")
    flags = frozenset(_cpu_features().split())
    usable = [v for v in VARIANTS if v.machine == platform.machine() and v.cpu_flags <= flags]
    if not usable:
        pytest.skip(f"no prebuilt variant is defined for {platform.machine()}")
    (directory / variant_file(ABI_VERSION, usable[0], True)).write_bytes(b"not a shared object")
    shutil.copy(built.path, directory / variant_file(ABI_VERSION, usable[-1], False))
    monkeypatch.setenv("GEFEN_KERNELS_CC", str(fresh_build / "absent-cc"))  # prove no compiler is needed
    reset_cpu_library()
    status = cpu_kernel_status()
    assert status.available and status.prebuilt and not status.compiled
    assert status.path == str(directory / variant_file(ABI_VERSION, usable[-1], False))
    monkeypatch.setenv("GEFEN_KERNELS_PREBUILT", "0")
    reset_cpu_library()
    assert not cpu_kernel_status().prebuilt


def test_the_avx512_loops_compile_where_they_cannot_run(tmp_path: Path) -> None:
    """The AVX-512 loops run (and are tested) only on a CPU with AVX-512; elsewhere on x86 they
    are compiled with warnings as errors, so a change that breaks them fails on every machine."""
    import platform
    import subprocess

    from gefen_kernels.cpu_build import _cpu_features
    from gefen_kernels.prebuilt import BASE_FLAGS, SOURCE, VARIANTS, find_compiler

    if platform.machine() != "x86_64":
        pytest.skip("the AVX-512 loops are x86-64 code")
    if "avx512f" in _cpu_features().split():
        pytest.skip("this CPU runs the AVX-512 loops in the parity tests")
    compiler = find_compiler()
    assert compiler is not None, "no C compiler: the CPU kernel tests need one"
    level = next(variant for variant in VARIANTS if variant.name == "x86-64-v4")
    flags = [flag for flag in BASE_FLAGS if flag != "-shared"]
    command = [*compiler, *flags, *level.flags, "-fopenmp", "-Wall", "-Werror", "-c", "-o", str(tmp_path / "v4.o")]
    result = subprocess.run([*command, str(SOURCE)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]

"""Each build of the CPU kernel's loops passes the same bit-exact parity tests.

The C source has three sets of loops: AVX-512 intrinsics (``GEFEN_AVX512``), AVX2 with FMA
intrinsics (``GEFEN_AVX2``, on CPUs without AVX-512) and plain loops for the compiler to
vectorise (any other CPU, or ``-DGEFEN_NO_INTRINSICS``). The parity tests in the main run
cover the set this CPU builds by default; here the parity and quotient tests run again in a
child process whose compiler is a wrapper adding flags (with a cache of its own, so the
library under test is the one the flags build): ``-DGEFEN_NO_INTRINSICS`` for the plain
loops, and ``-mno-avx512f`` for the AVX2 loops on a CPU that would otherwise build AVX-512.
A CPU without AVX-512 cannot run the AVX-512 loops; gefen-kernels' build tests compile them
there (``test_kernels_pkg_build.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


_FLAGS = _cpu_flags()


def _compiler() -> str:
    for candidate in (os.environ.get("GEFEN_KERNELS_CC"), os.environ.get("CC"), "cc", "gcc", "clang"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    raise AssertionError("no C compiler: the CPU kernel tests need one")


_AVX2_ELSEWHERE = (
    "this CPU builds the AVX2 loops by default, so the main parity tests run them" if "avx512f" not in _FLAGS else None
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag",
    [
        "-DGEFEN_NO_INTRINSICS",
        pytest.param(
            "-mno-avx512f",
            marks=pytest.mark.skipif(
                not {"avx2", "fma"} <= _FLAGS or _AVX2_ELSEWHERE is not None,
                reason=_AVX2_ELSEWHERE or "this CPU has no AVX2 with FMA to run the AVX2 loops",
            ),
        ),
    ],
    ids=["plain-loops", "avx2-loops"],
)
def test_each_build_of_the_loops_passes_the_cpu_parity_tests(tmp_path: Path, flag: str) -> None:
    wrapper = tmp_path / "cc-variant"
    # the flag goes last, so that it overrides what -march=native turns on
    wrapper.write_text(f'#!/bin/sh\nexec "{_compiler()}" "$@" {flag}\n')
    wrapper.chmod(0o755)
    cache = tmp_path / "cache"
    env = dict(os.environ, GEFEN_KERNELS_CC=str(wrapper), GEFEN_KERNELS_CACHE_DIR=str(cache))
    tests = [str(HERE / "test_kernels_cpu_parity.py"), str(HERE / "test_kernels_cpu_quotient.py")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env,
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    built = list(cache.glob("*.so"))
    assert len(built) == 1, f"expected the {flag} library in the test's cache, found {built}"

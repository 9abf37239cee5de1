"""The CPU kernel's portable loops pass the same bit-exact parity tests as its AVX-512 loops.

On CPUs without AVX-512 the C source compiles its plain loops (the intrinsics are behind
``GEFEN_AVX512``); ``-DGEFEN_NO_INTRINSICS`` forces that build here. The parity and
quotient tests run in a child process whose compiler is a wrapper adding the flag, with a
cache of its own, so the library under test is the portable one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _compiler() -> str:
    for candidate in (os.environ.get("GEFEN_KERNELS_CC"), os.environ.get("CC"), "cc", "gcc", "clang"):
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    raise AssertionError("no C compiler: the CPU kernel tests need one")


@pytest.mark.slow
def test_the_portable_loops_pass_the_cpu_parity_tests(tmp_path: Path) -> None:
    wrapper = tmp_path / "cc-portable"
    wrapper.write_text(f'#!/bin/sh\nexec "{_compiler()}" -DGEFEN_NO_INTRINSICS "$@"\n')
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
    assert len(built) == 1, f"expected the portable library in the test's cache, found {built}"

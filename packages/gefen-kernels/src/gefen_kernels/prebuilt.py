"""The prebuilt CPU kernels a platform wheel ships, and which one this CPU runs.

A platform wheel of gefen-kernels carries the C kernel compiled ahead of time for a few
instruction-set levels (``prebuilt/gefen_cpu-<ABI>-<variant>[-omp].so``), so the fused CPU
step needs no compiler. The release build (``hatch_build.py``, run by ``uv build``) compiles
every variant of :data:`VARIANTS` for the build machine's architecture with the same flags
as the just-in-time build (:data:`BASE_FLAGS`; ``-ffp-contract=off`` keeps every variant
bit-identical to the reference). At run time :func:`prebuilt_candidates` lists the shipped
libraries this CPU can execute, best first (the OpenMP build before the single-threaded one,
which needs no ``libgomp``); the loader takes the first that opens. The compiler lookup
(:func:`find_compiler`) is shared by both builds too. This module imports only the standard
library: the build hook loads it by path.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BASE_FLAGS",
    "GATHER_FLAGS",
    "PREBUILT_DIR",
    "SOURCE",
    "VARIANTS",
    "Variant",
    "find_compiler",
    "prebuilt_candidates",
    "source_abi",
    "variant_file",
]

#: Flags of every build, prebuilt or just in time.
BASE_FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
#: Tried in order after the architecture flags (GCC's generic tuning emulates vector gathers
#: with scalar loads: ``-mgather`` on GCC >= 13, ``-mtune-ctrl=use_gather`` on GCC 12; other
#: compilers reject both and take the empty set).
GATHER_FLAGS = (("-mgather",), ("-mtune-ctrl=use_gather",), ())
#: Where a platform wheel keeps its prebuilt libraries (inside the package).
PREBUILT_DIR = Path(__file__).with_name("prebuilt")
#: The C source every build compiles.
SOURCE = Path(__file__).with_name("csrc") / "gefen_cpu.c"


def source_abi() -> int:
    """``GEFEN_ABI_VERSION`` of :data:`SOURCE` (what the build hook and the release tool name
    their libraries by)."""
    for line in SOURCE.read_text().splitlines():
        if line.startswith("#define GEFEN_ABI_VERSION"):
            return int(line.split()[2])
    raise RuntimeError(f"GEFEN_ABI_VERSION is not defined in {SOURCE}")


@dataclass(frozen=True, slots=True)
class Variant:
    """One instruction-set level: its name, compiler flags and the CPU flags it needs."""

    name: str
    machine: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    #: The same level in zig's (clang's) spelling, for the release tool's cross builds.
    zig_flags: tuple[str, ...]


#: Best first, per architecture (``platform.machine()``).
VARIANTS = (
    Variant(
        "x86-64-v4",
        "x86_64",
        ("-march=x86-64-v4",),
        frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2"}),
        ("-march=x86_64_v4",),
    ),
    Variant(
        "x86-64-v3",
        "x86_64",
        ("-march=x86-64-v3",),
        frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}),
        ("-march=x86_64_v3",),
    ),
    Variant("x86-64", "x86_64", ("-march=x86-64",), frozenset(), ("-march=x86_64",)),
    Variant(
        "armv8.2-a",
        "aarch64",
        ("-march=armv8.2-a",),
        frozenset({"asimd", "fphp", "asimdhp"}),
        ("-mcpu=generic+v8_2a+fullfp16",),
    ),
    Variant("armv8-a", "aarch64", ("-march=armv8-a",), frozenset(), ("-mcpu=generic",)),
)


def variant_file(abi: int, variant: Variant, openmp: bool) -> str:
    return f"gefen_cpu-{abi}-{variant.name}{'-omp' if openmp else ''}.so"


def prebuilt_candidates(abi: int, cpu_flags: frozenset[str], machine: str | None = None) -> list[Path]:
    """The shipped libraries this CPU can run, best first (none when the wheel is pure)."""
    arch = machine or platform.machine()
    found = []
    for variant in VARIANTS:
        if variant.machine != arch or not variant.cpu_flags <= cpu_flags:
            continue
        for openmp in (True, False):
            path = PREBUILT_DIR / variant_file(abi, variant, openmp)
            if path.is_file():
                found.append(path)
    return found


def find_compiler() -> list[str] | None:
    """The C compiler command (``GEFEN_KERNELS_CC``, else ``CC``, else ``cc``/``gcc``/``clang``
    on ``PATH``; a command with arguments such as ``ccache gcc`` works), its program resolved;
    ``None`` when there is none."""
    for candidate in (os.environ.get("GEFEN_KERNELS_CC"), os.environ.get("CC")):
        if candidate and candidate.strip():
            try:
                program, *arguments = shlex.split(candidate)
            except ValueError:
                return None
            resolved = shutil.which(program) or (program if Path(program).is_file() else None)
            return None if resolved is None else [resolved, *arguments]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None

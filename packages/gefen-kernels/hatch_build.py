"""Release build of gefen-kernels: compile the CPU kernel ahead of time into the wheel.

``uv build --package gefen-kernels`` (a standard wheel, not an editable install) compiles
``src/gefen_kernels/csrc/gefen_cpu.c`` for every instruction-set level of
``gefen_kernels.prebuilt.VARIANTS`` on the build machine's architecture, with and without
OpenMP, and ships them under ``gefen_kernels/prebuilt/``; the wheel is then tagged for this
platform. Without a C compiler the wheel stays pure (the kernel is compiled just in time on
first use, as before) unless ``GEFEN_KERNELS_REQUIRE_PREBUILT=1``, which makes it an error.
``GEFEN_KERNELS_CC`` / ``CC`` choose the compiler.

A wheel for another platform ships libraries the release tool compiled for it
(``tools/release.py``: zig cross builds for ``manylinux_2_17_aarch64``):
``GEFEN_KERNELS_PREBUILT_FROM`` names their folder and ``GEFEN_KERNELS_PLATFORM_TAG`` the
wheel's platform tag; nothing is compiled then.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

_ROOT = Path(__file__).parent
_PACKAGE = _ROOT / "src" / "gefen_kernels"


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_gefen_kernels_build_{name}", _PACKAGE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _abi() -> int:
    return int(_module("prebuilt").source_abi())


class CustomBuildHook(BuildHookInterface):
    """Compiles the prebuilt variants into a standard wheel (see the module docstring)."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        shipped = os.environ.get("GEFEN_KERNELS_PREBUILT_FROM")
        if shipped:
            self._ship(Path(shipped), build_data)
            return
        prebuilt = _module("prebuilt")
        compiler = prebuilt.find_compiler()
        required = os.environ.get("GEFEN_KERNELS_REQUIRE_PREBUILT") == "1"
        if compiler is None:
            if required:
                raise RuntimeError("GEFEN_KERNELS_REQUIRE_PREBUILT=1 but no C compiler was found")
            self.app.display_warning("gefen-kernels: no C compiler; building a pure wheel (kernel compiled on use)")
            return
        abi = _abi()
        source = _PACKAGE / "csrc" / "gefen_cpu.c"
        out = Path(tempfile.mkdtemp(prefix="gefen-kernels-prebuilt-"))

        def compile_variant(job: tuple[Any, bool]) -> Path | None:
            variant, openmp = job
            target = out / prebuilt.variant_file(abi, variant, openmp)
            for gather in prebuilt.GATHER_FLAGS:
                flags = [*prebuilt.BASE_FLAGS, *variant.flags, *gather, *(["-fopenmp"] if openmp else [])]
                done = subprocess.run(
                    [*compiler, *flags, "-o", str(target), str(source)], capture_output=True, text=True, check=False
                )
                if done.returncode == 0:
                    return target
            return None

        jobs = [(v, openmp) for v in prebuilt.VARIANTS if v.machine == platform.machine() for openmp in (True, False)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            built = [path for path in pool.map(compile_variant, jobs) if path is not None]
        if not built:
            if required:
                raise RuntimeError(f"GEFEN_KERNELS_REQUIRE_PREBUILT=1 but {compiler[0]} built no variant")
            self.app.display_warning("gefen-kernels: no prebuilt variant compiled; building a pure wheel")
            return
        for path in built:
            build_data["force_include"][str(path)] = f"gefen_kernels/prebuilt/{path.name}"
        build_data["pure_python"] = False
        # A ctypes library, not a CPython extension: any Python 3 on this platform.
        build_data["tag"] = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
        self.app.display_info(f"gefen-kernels: prebuilt {', '.join(p.name for p in built)}")

    def _ship(self, folder: Path, build_data: dict[str, Any]) -> None:
        """Ship the libraries in ``folder`` for the platform ``GEFEN_KERNELS_PLATFORM_TAG`` names."""
        tag = os.environ.get("GEFEN_KERNELS_PLATFORM_TAG", "")
        if not tag:
            raise RuntimeError(
                "GEFEN_KERNELS_PREBUILT_FROM needs GEFEN_KERNELS_PLATFORM_TAG (e.g. manylinux_2_17_aarch64)"
            )
        built = sorted(folder.glob(f"gefen_cpu-{_abi()}-*.so"))
        if not built:
            raise RuntimeError(f"GEFEN_KERNELS_PREBUILT_FROM={folder} holds no gefen_cpu-{_abi()}-*.so library")
        for path in built:
            build_data["force_include"][str(path)] = f"gefen_kernels/prebuilt/{path.name}"
        build_data["pure_python"] = False
        build_data["tag"] = f"py3-none-{tag}"
        self.app.display_info(f"gefen-kernels: shipping {', '.join(p.name for p in built)} for {tag}")

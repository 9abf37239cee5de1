"""Loading the CPU kernel library: prebuilt in a platform wheel, else built with the system C
compiler into a per-user cache; loaded with ctypes.

A platform wheel ships the kernel compiled for a few instruction-set levels
(:mod:`gefen_kernels.prebuilt`); the best one this CPU can run is loaded first, so no
compiler is needed. Otherwise (a pure wheel, another platform, ``GEFEN_KERNELS_PREBUILT=0``)
the kernel is compiled just in time, as follows.

The C source (``csrc/gefen_cpu.c``) includes no torch headers, so compiling it takes about
a second. The shared library is cached under a name derived from a hash of the source,
the compiler's identity, the flags and the CPU's feature flags (``-march=native`` code must
not run on another CPU), and is written to a temporary file and renamed into place, so
concurrent processes (for example spawned ranks) never see a half-written library.

Environment:

* ``GEFEN_KERNELS_CC``: the C compiler command (default: ``$CC``, else ``cc``, ``gcc``,
  ``clang``); a command with arguments such as ``ccache gcc`` works;
* ``GEFEN_KERNELS_CACHE_DIR``: the cache directory (default:
  ``$XDG_CACHE_HOME/gefen-kernels`` or ``~/.cache/gefen-kernels``);
* ``GEFEN_KERNELS_CPU=0``: do not build or use the CPU kernel;
* ``GEFEN_KERNELS_PREBUILT=0``: ignore the prebuilt libraries (compile just in time).

Nothing here can make a step fail. An unusable cache directory (a file, no permission) is
replaced by one under the system's temporary directory, with one
:class:`CpuKernelCacheWarning` naming the cause. Each successful load records its library
under a key of the source, the ABI and the CPU, so a process without a working compiler
(a slim container, a ``CC`` that does not exist) still loads the library a previous process
built here. When neither works, :func:`load_cpu_library` warns once
(:class:`CpuKernelUnavailableWarning`, with the cause) and returns ``None``; the provider
then declines CPU tensors with that cause and the reference path runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .prebuilt import BASE_FLAGS, GATHER_FLAGS, SOURCE, find_compiler, prebuilt_candidates, source_abi

__all__ = [
    "ABI_VERSION",
    "CpuKernelCacheWarning",
    "CpuKernelStatus",
    "CpuKernelUnavailableWarning",
    "cpu_kernel_status",
    "load_cpu_library",
    "reset_cpu_library",
]

#: ``GEFEN_ABI_VERSION`` of the C source (a loaded library must report the same).
ABI_VERSION = source_abi()
_SOURCE = SOURCE
#: Tried in order; the first set that compiles is used: native code with real vector gathers
#: (:data:`gefen_kernels.prebuilt.GATHER_FLAGS`: GCC's generic tuning emulates them with
#: scalar loads, which made the step 6x slower here), then portable code.
_FLAG_SETS = (
    *(("-march=native", *gather, "-fopenmp") for gather in GATHER_FLAGS),
    ("-fopenmp",),
    (),
)
_COMPILE_TIMEOUT_S = 180


class CpuKernelUnavailableWarning(RuntimeWarning):
    """The CPU kernel could not be built or loaded; Gefen runs its reference path on CPU."""


class CpuKernelCacheWarning(RuntimeWarning):
    """The kernel cache directory is unusable; a temporary one is used instead."""


@dataclass(frozen=True, slots=True)
class CpuKernelStatus:
    """What happened when the CPU kernel was first needed in this process.

    ``available``: the library is loaded. ``path``: the shared library. ``compiled``: it was
    built in this process (``False``: found in the cache). ``build_seconds``: compile time
    when built here. ``flags``: the compiler flags used. ``openmp``: multi-threaded build.
    ``reason``: why it is unavailable (empty when available). ``prebuilt``: the library came
    with the wheel (no compiler involved).
    """

    available: bool
    path: str = ""
    compiler: str = ""
    compiled: bool = False
    build_seconds: float = 0.0
    flags: tuple[str, ...] = ()
    openmp: bool = False
    reason: str = ""
    prebuilt: bool = False


_LOCK = threading.Lock()
_LIBRARY: ctypes.CDLL | None = None
_STATUS: CpuKernelStatus | None = None


def _configured_cache_dir() -> Path:
    explicit = os.environ.get("GEFEN_KERNELS_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gefen-kernels"


def _cache_dir() -> Path:
    """The configured cache directory, or a per-user temporary one (after a warning) when it
    cannot be created or written."""
    configured = _configured_cache_dir()
    try:
        configured.mkdir(parents=True, exist_ok=True)
        if not os.access(configured, os.W_OK | os.X_OK):
            raise PermissionError(f"{configured} is not writable")
        return configured
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / f"gefen-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        warnings.warn(
            f"gefen-kernels: the cache directory {configured} is unusable ({type(exc).__name__}: {exc}); "
            f"using {fallback}. Set GEFEN_KERNELS_CACHE_DIR to a writable directory.",
            CpuKernelCacheWarning,
            stacklevel=4,
        )
        fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
        return fallback if _private(fallback) else Path(tempfile.mkdtemp(prefix="gefen-kernels-"))


def _private(folder: Path) -> bool:
    """Whether only this user can write ``folder``: a library is loaded from it, and a shared
    temporary directory lets anyone create a predictable name first (then a fresh private
    folder is used, at the cost of one build per process)."""
    info = folder.stat()
    owner_ok = not hasattr(os, "getuid") or info.st_uid == os.getuid()
    return owner_ok and not info.st_mode & 0o022 and not folder.is_symlink()


def _requested_compiler() -> str:
    return os.environ.get("GEFEN_KERNELS_CC") or os.environ.get("CC") or "cc"


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), or the machine name elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def _compiler_identity(compiler: list[str]) -> str:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return done.stdout.strip()


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _library_name(source: bytes, compiler: list[str], identity: str, flags: tuple[str, ...]) -> str:
    key = _digest(
        source, " ".join(compiler).encode(), identity.encode(), " ".join(flags).encode(), _cpu_features().encode()
    )
    return f"gefen_cpu-{ABI_VERSION}-{key}.so"


def _record_path(cache: Path, source: bytes) -> Path:
    """Where the last library loaded for this source, ABI and CPU is recorded (any compiler)."""
    return cache / f"gefen_cpu-{ABI_VERSION}-{_digest(source, _cpu_features().encode())}.last"


def _remember(cache: Path, source: bytes, library: Path) -> None:
    try:
        record = _record_path(cache, source)
        temporary = record.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(library.name)
        os.replace(temporary, record)
    except OSError:
        pass  # only an optimisation for processes without a compiler


def _recorded_library(cache: Path, source: bytes) -> Path | None:
    try:
        name = _record_path(cache, source).read_text().strip()
    except OSError:
        return None
    path = cache / name
    return path if name and "/" not in name and path.is_file() else None


def _compile(compiler: list[str], flags: tuple[str, ...], target: Path) -> str:
    """Compile into ``target`` atomically; return the compiler's error text ('' on success)."""
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(handle)
    try:
        done = subprocess.run(
            [*compiler, *flags, "-o", temporary, str(_SOURCE)],
            capture_output=True,
            text=True,
            timeout=_COMPILE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
        os.replace(temporary, target)
        return ""
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _first_error(text: str) -> str:
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    return (lines or text.splitlines() or ["failed"])[0].strip()


def _open(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    version = library.gefen_abi_version()
    if version != ABI_VERSION:
        raise OSError(f"{path} has ABI version {version}, expected {ABI_VERSION}")
    return library


def _disabled(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in ("0", "false", "no", "off")


def _prebuilt() -> tuple[ctypes.CDLL | None, CpuKernelStatus | None, list[str]]:
    """The best shipped library this CPU runs, or ``(None, None, problems)``."""
    problems = []
    for path in prebuilt_candidates(ABI_VERSION, frozenset(_cpu_features().split())):
        try:
            library = _open(path)
        except OSError as exc:  # e.g. the OpenMP build without libgomp: try the next one
            problems.append(f"{path.name}: {exc}")
            continue
        openmp = bool(library.gefen_openmp_enabled())
        return library, CpuKernelStatus(True, str(path), openmp=openmp, prebuilt=True), problems
    return None, None, problems


def _build() -> tuple[ctypes.CDLL | None, CpuKernelStatus]:
    if _disabled("GEFEN_KERNELS_CPU"):
        return None, CpuKernelStatus(False, reason="disabled by GEFEN_KERNELS_CPU=0")
    prebuilt_problems: list[str] = []
    if not _disabled("GEFEN_KERNELS_PREBUILT"):
        library, status, prebuilt_problems = _prebuilt()
        if library is not None and status is not None:
            return library, status
    source = _SOURCE.read_bytes()
    cache = _cache_dir()
    compiler = find_compiler()
    if compiler is None:
        missing = f"no C compiler found (looked for {_requested_compiler()!r})"
        if prebuilt_problems:
            missing += f", and no prebuilt library loads ({'; '.join(prebuilt_problems)})"
        recorded = _recorded_library(cache, source)
        if recorded is None:
            return None, CpuKernelStatus(False, reason=missing)
        try:
            library = _open(recorded)
        except OSError as exc:
            return None, CpuKernelStatus(False, reason=f"{missing}, and the cached {recorded.name} fails: {exc}")
        return library, CpuKernelStatus(True, str(recorded), "", False, 0.0, (), bool(library.gefen_openmp_enabled()))
    command = " ".join(compiler)
    identity = _compiler_identity(compiler)
    errors: list[str] = []
    for extra in _FLAG_SETS:
        flags = (*BASE_FLAGS, *extra)
        target = cache / _library_name(source, compiler, identity, flags)
        compiled, seconds = False, 0.0
        if not target.exists():
            started = time.perf_counter()
            error = _compile(compiler, flags, target)
            seconds = time.perf_counter() - started
            if error:
                errors.append(f"{' '.join(extra) or 'plain'}: {_first_error(error)}")
                continue
            compiled = True
        try:
            library = _open(target)
        except OSError as exc:
            errors.append(f"loading {target}: {exc}")
            continue
        _remember(cache, source, target)
        openmp = bool(library.gefen_openmp_enabled())
        return library, CpuKernelStatus(True, str(target), command, compiled, seconds, flags, openmp)
    return None, CpuKernelStatus(False, compiler=command, reason=f"{command} could not build it: " + "; ".join(errors))


def load_cpu_library() -> ctypes.CDLL | None:
    """The loaded CPU kernel library, built on first use; ``None`` (after one warning) if it cannot be."""
    global _LIBRARY, _STATUS
    if _STATUS is not None:
        return _LIBRARY
    with _LOCK:
        if _STATUS is None:
            try:
                library, status = _build()
            except Exception as exc:  # a cache or build problem must never fail a step
                library, status = None, CpuKernelStatus(False, reason=f"{type(exc).__name__}: {exc}")
            _LIBRARY = library
            _STATUS = status
            if library is None:
                warnings.warn(
                    f"gefen-kernels: the CPU kernel is unavailable ({status.reason}); Gefen runs its reference "
                    "path on CPU tensors. Set GEFEN_KERNELS_CC to a working C compiler to enable it.",
                    CpuKernelUnavailableWarning,
                    stacklevel=2,
                )
    return _LIBRARY


def cpu_kernel_status() -> CpuKernelStatus:
    """The status of the CPU kernel, building it first if this process has not tried yet."""
    load_cpu_library()
    assert _STATUS is not None
    return _STATUS


def reset_cpu_library() -> None:
    """Forget this process's attempt so the next use tries again (after changing the environment).

    A library already loaded stays mapped; the next load reopens the cached file.
    """
    global _LIBRARY, _STATUS
    with _LOCK:
        _LIBRARY = None
        _STATUS = None

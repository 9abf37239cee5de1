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
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_REQ = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)(?:\[[^\]]*\])?(?P<spec>.*)$")


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


def build(out: Path, root: Path = ROOT) -> list[Path]:
    uv = shutil.which("uv") or "uv"
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name in published_packages(root):
        subprocess.run(
            [uv, "build", "--package", name, "--wheel", "--out-dir", str(out), "--offline", "--quiet"],
            cwd=root,
            check=True,
            capture_output=True,
            timeout=600,
        )
        found = sorted(out.glob(f"{name.replace('-', '_')}-*.whl"))
        if not found:
            raise RuntimeError(f"no wheel was built for {name}")
        wheels.append(found[-1])
    return wheels


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


def verify(dist: Path, root: Path = ROOT) -> list[str]:
    """Install each published wheel into its own clean venv (no network) and import it."""
    uv = shutil.which("uv") or "uv"
    packages = published_packages(root)
    wheels = {name: sorted(dist.glob(f"{name.replace('-', '_')}-*.whl"))[-1] for name in packages}
    site = _third_party_site(root)
    lines = []
    for name, package in packages.items():
        with tempfile.TemporaryDirectory(prefix=f"verify-{name}-") as tmp:
            venv = Path(tmp) / "venv"
            subprocess.run(
                [uv, "venv", str(venv), "--python", sys.executable, "--quiet"], check=True, capture_output=True
            )
            python = venv / "bin" / "python"
            alone = not any(not r.startswith("gefen") for r in package.requirements)
            if not alone:
                venv_site = next((venv / "lib").glob("python3*/site-packages"))
                (venv_site / "zz_third_party.pth").write_text(str(site) + "\n")
            needed = [str(wheels[n]) for n in _closure(name, packages)]
            subprocess.run(
                [uv, "pip", "install", "--python", str(python), "--offline", "--no-deps", "--quiet", *needed],
                check=True,
                capture_output=True,
                timeout=900,
            )
            probe = (
                f"import importlib.util, {package.module} as m\n"
                f"assert m.__file__.startswith({str(venv)!r}), m.__file__\n"
                "print(m.__version__, importlib.util.find_spec('torch') is not None)"
            )
            result = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, timeout=300)
            version, has_torch = result.stdout.split()
            if version != package.version:
                raise RuntimeError(f"{name}: installed version {version} != {package.version}")
            if alone and has_torch == "True":
                raise RuntimeError(f"{name} installed alone pulled in torch")
            note = "alone" if alone else "with torch from the workspace"
            if name == "gefen-kernels":
                shipped = _prebuilt_in_wheel(wheels[name])
                if wheels[name].name.endswith("-none-any.whl") or not shipped:
                    raise RuntimeError(f"{wheels[name].name} carries no prebuilt CPU kernel")
                note += f"; prebuilt {len(shipped)} libraries"
            if name == "gefen":
                note += f"; fused CPU step without a compiler on {_fused_step_without_compiler(python, Path(tmp))}"
            lines.append(f"{name} {version} ok ({note})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check-pins", help="check that every workspace pin admits its sibling's version")
    build_parser = sub.add_parser("build", help="build every published wheel")
    build_parser.add_argument("--out", type=Path, default=ROOT / "dist")
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
        for wheel in build(args.out):
            print(wheel)
        return 0
    for line in verify(args.dist):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

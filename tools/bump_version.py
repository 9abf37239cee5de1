"""Bump one workspace package's version and open its CHANGELOG section.

    uv run python tools/bump_version.py gefen-core minor   # 0.1.0 -> 0.2.0
    uv run python tools/bump_version.py gefen-core 0.3.1   # explicit

Updates ``packages/<name>/pyproject.toml``, ``src/<module>/_version.py`` and moves the
``[Unreleased]`` entries of ``CHANGELOG.md`` under a new version heading. It refuses a
version that does not increase. Run ``uv run python tools/release.py check-pins`` afterwards: the meta-package's
pins must still admit every sibling's version.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


def parse(version: str) -> tuple[int, int, int]:
    match = _VERSION.match(version)
    if not match:
        raise ValueError(f"{version!r} is not MAJOR.MINOR.PATCH")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def next_version(current: str, part: str) -> str:
    major, minor, patch = parse(current)
    if part == "major":
        return f"{major + 1}.0.0"
    if part == "minor":
        return f"{major}.{minor + 1}.0"
    if part == "patch":
        return f"{major}.{minor}.{patch + 1}"
    if parse(part) <= (major, minor, patch):
        raise ValueError(f"new version {part} must be greater than {current}")
    return part


def package_dir(root: Path, name: str) -> Path:
    directory = root / "packages" / name
    if not (directory / "pyproject.toml").exists():
        raise ValueError(f"no workspace package {name!r} under {root / 'packages'}")
    return directory


def bump(root: Path, name: str, part: str, today: str | None = None) -> str:
    directory = package_dir(root, name)
    pyproject = directory / "pyproject.toml"
    text = pyproject.read_text()
    current_match = re.search(r'^version = "([^"]+)"$', text, flags=re.M)
    if current_match is None:
        raise ValueError(f"{pyproject} has no version line")
    current = current_match.group(1)
    new = next_version(current, part)
    module = name.replace("-", "_")
    version_file = directory / "src" / module / "_version.py"
    if not version_file.exists():
        raise ValueError(f"{version_file} is missing")
    changelog = directory / "CHANGELOG.md"
    log = changelog.read_text()
    if "## [Unreleased]" not in log:
        raise ValueError(f"{changelog} has no [Unreleased] section")
    date = today or datetime.date.today().isoformat()
    pyproject.write_text(text.replace(f'version = "{current}"', f'version = "{new}"', 1))
    version_file.write_text(f'__version__ = "{new}"\n')
    changelog.write_text(log.replace("## [Unreleased]", f"## [Unreleased]\n\n## [{new}] - {date}", 1))
    return new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", help="distribution name, e.g. gefen-core")
    parser.add_argument("part", help="major, minor, patch or an explicit MAJOR.MINOR.PATCH")
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    try:
        new = bump(args.root, args.package, args.part)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.package} -> {new}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

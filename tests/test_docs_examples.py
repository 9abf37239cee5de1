"""Every fenced Python block in the docs and READMEs runs, unless tagged not runnable.

A block is skipped only when its fence says why: `` ```python no-run: <reason> ``. Blocks of
one file run in order in one namespace (like a reader pasting them), in a temporary
working directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python(?P<info>[^\n]*)\n(?P<body>.*?)^```", re.M | re.S)


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("packages/*/README.md"))]
    return [p for p in found if p.exists() and ".venv" not in p.parts]


def blocks(path: Path) -> list[tuple[int, str, str]]:
    text = path.read_text()
    out = []
    for match in FENCE.finditer(text):
        line = text[: match.start()].count("\n") + 1
        out.append((line, match.group("info").strip(), match.group("body")))
    return out


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path: Path) -> None:
    namespace: dict[str, object] = {"__name__": "__docs__"}
    previous = Path.cwd()
    os.chdir(tmp_path)
    try:
        for line, info, body in blocks(path):
            if info.startswith("no-run"):
                reason = info.partition(":")[2].strip()
                assert reason, f"{path}:{line}: a no-run block must say why (```python no-run: <reason>)"
                continue
            assert not info, f"{path}:{line}: unknown fence info {info!r}"
            code = compile(body, f"{path.relative_to(ROOT)}:{line}", "exec")
            exec(code, namespace)
    finally:
        os.chdir(previous)


def test_no_run_tags_need_a_reason() -> None:
    sample = "```python no-run: needs a GPU\nx = 1\n```\n"
    match = FENCE.search(sample)
    assert match is not None and match.group("info") == " no-run: needs a GPU"


@pytest.mark.parametrize("name", ["Gefen", "GefenMuon"])
def test_the_documented_signatures_are_the_code_s(name: str) -> None:
    """gefen-core's README writes each optimizer's signature out; it had drifted (GefenMuon's
    ``ns_schedule`` shown positional where it is keyword-only, Gefen's ``differentiable``
    missing). The names, their order and the keyword-only marker must be the code's."""
    import inspect

    import gefen_core

    text = (ROOT / "packages" / "gefen-core" / "README.md").read_text()
    match = re.search(rf"^`{name}\((?P<args>.*?)\)`", text, re.M | re.S)
    assert match is not None, f"no signature of {name} in gefen-core's README"
    documented = []
    for raw in re.split(r",\s*(?![^()]*\))", " ".join(match.group("args").split())):  # commas outside (...)
        documented.append("*" if raw.strip() == "*" else raw.split("=")[0].strip())
    actual = []
    for parameter in inspect.signature(getattr(gefen_core, name)).parameters.values():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in actual:
            actual.append("*")
        actual.append(parameter.name)
    assert documented == actual

"""The README's example runs and prints what its comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from hybrid_toys import single_threaded_torch  # noqa: F401 (autouse fixture)

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_prints_the_documented_values() -> None:
    (example, *_) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    lines = output.getvalue().splitlines()
    assert lines[0].startswith("(('embed.weight', 'backup'), ('hidden.bias', 'backup'), ('hidden.weight', 'muon')")
    assert lines[1] == "[0.0015, 0.0005]"
    assert lines[2] == "('muon', 'backup')"

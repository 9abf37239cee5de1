"""The ``gefen`` command itself: ``--version`` and importing ``MODULE:FUNCTION`` from the current directory."""

from __future__ import annotations

import sys
from pathlib import Path

import gefen_contracts
import gefen_core
import pytest
from gefen.cli.main import main

_TARGET = """
import torch


def target():
    torch.manual_seed(0)
    batches = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(20)]
    return torch.nn.Linear(3, 1), batches, lambda model, b: torch.nn.functional.mse_loss(model(b[0]), b[1])
"""


def test_version_prints_every_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    lines = dict(line.split(" ", 1) for line in capsys.readouterr().out.splitlines())
    packages = {
        "gefen",
        "gefen-contracts",
        "gefen-core",
        "gefen-kernels",
        "gefen-portable",
        "gefen-dcp",
        "gefen-hybrid",
    }
    assert packages < set(lines) and "torch" in lines
    assert lines["gefen-core"] == gefen_core.__version__
    assert lines["gefen-contracts"] == gefen_contracts.__version__


def test_a_target_module_in_the_current_directory_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cwd_target_module.py").write_text(_TARGET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_target_module", raising=False)
    out = tmp_path / "out"
    arguments = ["find-lr", "cwd_target_module:target", "--optimizer", "adamw", "--steps", "3", "--threads", "1"]
    assert main([*arguments, "--out", str(out)]) == 0  # it needed PYTHONPATH=. before
    assert (out / "find-lr.json").stat().st_size > 0


def test_python_dash_m_gefen_runs_the_cli() -> None:
    """``python -m gefen`` (where the console script is not on PATH) is the same command."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "gefen", "--version"], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"gefen-core {gefen_core.__version__}" in done.stdout


def _as_a_terminal_job() -> None:
    import signal

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(child) for child in listing.read().split()]


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as stat:  # a zombie not yet reaped is gone too
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's children from /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_the_command_and_its_training_process_with_one_line(tmp_path: Path, how: str) -> None:
    """A terminal's Ctrl-C signals the whole foreground group: the command and its training
    process each printed a traceback and the command exited -2. ``kill`` and ``timeout`` signal
    the command alone (SIGTERM), which died and left its training process running. Now one
    line, exit 130, and no process left."""
    import os
    import signal
    import subprocess
    import time

    log = tmp_path / "stderr.txt"
    with log.open("wb") as stderr:
        command = [sys.executable, "-m", "gefen", "demo", "--steps", "100000", "--model-size", "tiny"]
        command += ["--optimizers", "adamw", "--threads", "1", "--out", str(tmp_path / "out")]
        # a group of its own with the signals' default actions, as a terminal's foreground job has
        # (a test runner's process may ignore or block them, and both are inherited)
        process = subprocess.Popen(
            command,
            stderr=stderr,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_as_a_terminal_job,  # noqa: PLW1509 - before exec, no thread of the child runs yet
        )
        try:
            deadline = time.monotonic() + 120
            while b"step/s" not in log.read_bytes():  # the child is training (its progress bar)
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            children = _children(process.pid)
            assert children, "the demo trains in a process of its own"
            if how == "ctrl-c":
                os.killpg(process.pid, signal.SIGINT)
            else:
                process.terminate()
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    text = log.read_text(errors="replace")
    assert code == 130, text
    assert "gefen demo: interrupted" in text and "Traceback" not in text, text
    assert all(_gone(child) for child in children), children


def test_ctrl_c_while_the_parsers_are_built_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Building a command's parser imports torch (about two seconds): a Ctrl-C there printed a
    whole ``KeyboardInterrupt`` traceback instead of the promised one line."""
    cli_main = sys.modules["gefen.cli.main"]  # (gefen.cli's ``main`` attribute is the function)

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "build_parser", interrupted)
    assert main(["demo", "--steps", "3"]) == 130
    assert capsys.readouterr().err == "gefen demo: interrupted\n"
    assert main(["bench", "dcp"]) == 130
    assert capsys.readouterr().err == "gefen bench dcp: interrupted\n"


def test_more_threads_than_four_per_cpu_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``--threads 100000`` segfaulted in OpenMP without a word (20,000 failed to create them)."""
    import os

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "muon", "--threads", "100000"])
    assert exit_info.value.code == 2
    limit = 4 * (os.cpu_count() or 1)
    assert f"gefen bench muon: error: --threads 100000 is more than {limit}" in capsys.readouterr().err

"""The ``gefen`` command's arguments: every command has ``--help`` (printed without importing
torch), and a bad argument is a usage error (exit 2) before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gefen.cli.main import main

COMMANDS = [
    [],
    ["demo"],
    ["bench"],
    *(["bench", name] for name in ("memory", "quality", "step", "muon", "portable", "dcp", "guard", "dp")),
    ["conformance"],
    ["inspect"],
    ["find-lr"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "gefen")
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gefen") and len(out) > 200


def test_help_and_version_print_without_importing_torch() -> None:
    """A command adds its arguments (whose defaults and choices come from modules that import
    torch) only when it is chosen, so ``gefen --help``, ``gefen bench --help`` and ``gefen
    --version`` answer without torch's import (3.5 s on a quiet 2-core machine)."""
    probe = (
        "import sys\n"
        "from gefen.cli.main import main\n"
        "for argv in (['--help'], ['bench', '--help'], ['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert "COMMAND" in result.stdout and "BENCHMARK" in result.stdout and "gefen-core " in result.stdout
    assert result.stdout.splitlines()[-1] == "torch imported: False"


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--lr", "adamw"])
    assert exit_info.value.code == 2
    assert "NAME=LR" in capsys.readouterr().err


BAD_VALUES = [
    (["demo", "--steps", "0"], "--steps must be a positive int"),
    (["demo", "--optimizers", "nosuch"], "unknown optimizer 'nosuch'"),
    (["demo", "--batch-size", "0"], "--batch-size must be an int >= 1"),
    (["demo", "--eval-every", "-1"], "--eval-every must be an int >= 0"),
    (["demo", "--threads", "-2"], "threads must be an int >= 0"),
    (["demo", "--lr", "nosuch=0.1"], "not among the optimizers"),
    (["bench", "memory", "--steps", "1"], "steps must be an int >= 2"),
    (["bench", "memory", "--models", "nosuch"], "unknown model size 'nosuch'"),
    (["bench", "dp", "--repeats", "0"], "repeats must be a positive int"),
    (["conformance", "os:"], "cannot load os:"),
    (["conformance", "os:sep"], "neither a ConformanceTarget nor a callable"),
    (["find-lr", "--threads", "-1"], "--threads must be >= 0"),
    (["find-lr", "--weight-decay", "-1"], "cannot build the optimizer 'gefen'"),
    (["find-lr", "--optimizer", "os:getcwd"], "cannot build the optimizer 'os:getcwd'"),
    # a repeated entry names two rows alike: refused before the work, not after it
    (["demo", "--optimizers", "adamw,adamw"], "optimizers lists 'adamw' more than once"),
    (["bench", "memory", "--models", "tiny,tiny"], "models lists 'tiny' more than once"),
    (["bench", "memory", "--optimizers", "nosuch"], "unknown optimizer 'nosuch'"),
    (["bench", "quality", "--tasks", "char-tiny,char-tiny"], "tasks lists 'char-tiny' more than once"),
    (["bench", "quality", "--lr-grid", "1e-3,1e-3"], "--lr-grid names a learning rate twice"),
    (["bench", "dcp", "--ranks", "1,1"], "--ranks lists '1' more than once"),
    (["bench", "portable", "--models", "tiny,tiny"], "models lists 'tiny' more than once"),
    (["bench", "portable", "--models", "1m"], "no decoder of the sized family comes within 25% of 1,000,000"),
    (["bench", "dcp", "--model", "3m"], "the smallest 5,050,112"),
    (["bench", "step", "--arms", "gefen-fused,gefen-fused"], "arms lists 'gefen-fused' more than once"),
    (["bench", "dp", "--bruteforce-bins", "4096"], "--bruteforce-bins must be in [256, 4096)"),
]


@pytest.mark.parametrize(("command", "message"), BAD_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_bad_option_values_are_usage_errors_before_any_work(
    command: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is exit 2 with one line naming it, before any process starts or any model
    trains: not a traceback, nor a failure minutes later."""
    with pytest.raises(SystemExit) as exit_info:
        main(command)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_negative_parameter_count_for_inspect_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "somewhere", "--max-parameters", "-1"])
    assert exit_info.value.code == 2 and "expected an int >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("below", ["", "sub/dir"], ids=["the-file", "below-it"])
def test_an_output_folder_that_is_or_lies_below_a_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], below: str
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "dp", "--out", str(afile / below if below else afile)])
    message = f"({afile} is a file)" if below else "is a file, not a folder"
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc takes no folder on Linux")
def test_an_output_folder_where_nothing_can_be_written_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Root passes every permission check and a read-only file system none: the run wrote
    nothing after all its work (a PermissionError). A file is written there to know."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "dp", "--out", "/proc/gefen-bench-out"])
    assert exit_info.value.code == 2 and "nothing can be written there" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "portable", "--optimizers", "nope"], "gefen bench portable: error: unknown arm 'nope'"),
        (["bench", "dcp", "--optimizers", "recipe:nope"], "gefen bench dcp: error: unknown arm 'nope'"),
        (["bench", "dcp", "--optimizers", "no_such_module:factory"], "arm 'no_such_module:factory' cannot be loaded"),
        (["bench", "portable", "--ranks", "99"], "must be ints from 1 to 8"),
        (["demo", "--lr", "gefen=inf"], "positive finite LR"),
    ],
    ids=["portable-arm", "dcp-recipe-arm", "dcp-module-arm", "ranks", "demo-lr"],
)
def test_a_typo_is_a_usage_error_before_any_work(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Each ran the baseline (or trained) first: an unknown arm ended in a note and exit 0, 99
    ranks started 99 processes, an infinite rate failed in the training process."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_a_cuda_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["bench", "step", "--device", "cuda"], ["bench", "quality", "--device", "cuda"]):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_unavailable_optimizers_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from gefen.bench.optimizers import unavailable_reason

    missing = next((n for n in ("adamw-4bit", "adamw-8bit") if unavailable_reason(n) is not None), None)
    if missing is None:
        pytest.skip("every optional optimizer is installed here")
    for command, message in (
        (["demo", "--optimizers", missing], "no optimizer can run here"),
        (["find-lr", "--optimizer", missing], "is not available here"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(command)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_step_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--d-model", "66"])
    assert exit_info.value.code == 2
    assert "--d-model must be divisible by 4" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--d-model", "16", "--layers", "1", "--vocab", "32", "--arms", "gefen-fused,no-such"])
    assert exit_info.value.code == 2
    assert "unknown arm(s) ['no-such']" in capsys.readouterr().err


def test_bench_quality_bad_options_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "quality", "--tasks", "char-tiny", "--sweep-seeds", "0"])
    assert exit_info.value.code == 2
    assert "--sweep-seeds must be a positive int, got 0" in capsys.readouterr().err


def test_bench_quality_refuses_an_unknown_device() -> None:
    from gefen.bench.quality import QualityOptions

    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'mps'"):
        QualityOptions(tasks=("char-tiny",), optimizers=("adamw",), device="mps")

"""``gefen conformance MODULE:FACTORY``: exit 0 on an honest adopter, non-zero naming the failed claim otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conformance_broken_adopters import EXPECTED_FAILURES
from gefen.cli.main import main


def test_honest_adopter_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "gefen_example_sgd:conformance_factory"]) == 0
    assert "checkpoint.native_roundtrip" in capsys.readouterr().out


@pytest.mark.parametrize("factory", ["mutating_query_factory", "undeclared_state_key_factory"])
def test_broken_adopter_exits_one_and_names_the_check(factory: str, capsys: pytest.CaptureFixture[str]) -> None:
    check, fragment = EXPECTED_FAILURES[factory]
    assert main(["conformance", f"conformance_broken_adopters:{factory}"]) == 1
    out = capsys.readouterr().out
    assert check in out and fragment in out


def test_a_waiver_that_names_nothing_of_the_run_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    """``--waive bogus`` (a typo) was taken in silence and waived nothing."""
    assert main(["conformance", "gefen_example_sgd:conformance_factory", "--waive", "bogus"]) == 0
    err = capsys.readouterr().err
    assert "warning: --waive 'bogus' names no check or claim of this run" in err
    main(["conformance", "gefen_example_sgd:conformance_factory", "--waive", "checkpoint.native_roundtrip"])
    assert "warning" not in capsys.readouterr().err


def test_json_report_and_unimportable_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "conformance_broken_adopters:mutating_query_factory", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    for target in ("no_such_module:factory", "conformance_broken_adopters:absent", "no_colon"):
        with pytest.raises(SystemExit) as exit_info:
            main(["conformance", target])
        assert exit_info.value.code == 2 and target.partition(":")[0] in capsys.readouterr().err


def test_a_target_module_raising_while_imported_is_named_with_its_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a ContractError (a ValueError) raised while the adopter's module builds its contract was
    # reported as "a conformance target must be given as MODULE:FACTORY"
    (tmp_path / "adopter_with_bad_contract.py").write_text("raise ValueError('declared field m has no geometry')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["conformance", "adopter_with_bad_contract:factory"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "declared field m has no geometry" in err and "MODULE:FACTORY" not in err

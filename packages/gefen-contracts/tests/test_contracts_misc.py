from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from gefen_contracts import ContractError, ContractTypeError, StaleTransactionError
from gefen_contracts.kernels import run_kernel_plugins
from gefen_contracts.limits import PortableStateLimits
from gefen_contracts.transactions import StagedTransaction


class Owner:
    pass


def test_limits_rules() -> None:
    limits = PortableStateLimits()
    assert limits.max_metadata_bytes == 64 << 20
    small = PortableStateLimits(max_collective_metadata_bytes=1 << 20)
    assert small.max_metadata_bytes == 1 << 20
    # replace() carries the resolved value: lowering the collective bound below it needs 0 again
    with pytest.raises(ContractError, match="max_metadata_bytes must not exceed"):
        dataclasses.replace(limits, max_collective_metadata_bytes=1 << 20)
    lowered = dataclasses.replace(limits, max_collective_metadata_bytes=1 << 20, max_metadata_bytes=0)
    assert lowered.max_metadata_bytes == 1 << 20
    with pytest.raises(ContractError):
        PortableStateLimits(chunk_bytes=0)
    with pytest.raises(ContractTypeError):
        PortableStateLimits(chunk_bytes=True)
    with pytest.raises(ContractError, match="max_tree_depth"):
        PortableStateLimits(max_tree_depth=257)
    with pytest.raises(ContractError, match="max_fragment_tensor_bytes"):
        PortableStateLimits(max_fragment_tensor_bytes=10, max_collective_tensor_bytes=5)
    assert limits.collective().max_fragment_tensor_bytes == limits.max_collective_tensor_bytes


def test_staged_transaction_is_single_use_owned_and_fresh() -> None:
    owner, other = Owner(), Owner()
    staged = StagedTransaction(owner, kind="load", token=1, payload="payload")
    with pytest.raises(StaleTransactionError, match="another optimizer"):
        staged.claim(other, kind="load", current_token=1)
    with pytest.raises(StaleTransactionError, match="expected"):
        staged.claim(owner, kind="other", current_token=1)
    with pytest.raises(StaleTransactionError, match="changed"):
        staged.claim(owner, kind="load", current_token=2)
    assert not staged.consumed
    assert staged.claim(owner, kind="load", current_token=1) == "payload"
    with pytest.raises(StaleTransactionError, match="consumed"):
        staged.claim(owner, kind="load", current_token=1)
    with pytest.raises(ContractTypeError):
        StagedTransaction(1, kind="x", token=0, payload=None)


def test_kernel_plugins_report_what_they_could_not_serve_and_never_raise() -> None:
    def serves_all() -> object:
        return {}

    def no_cuda() -> object:
        return {"cuda": "CUDA is not available"}

    def broken() -> object:
        raise ImportError("missing library")

    def wrong_type() -> object:
        return ["cpu"]

    reports = run_kernel_plugins(
        [("all", serves_all), ("cpu-only", no_cuda), ("broken", broken), ("wrong", wrong_type)]
    )
    assert [r.entry_point for r in reports] == ["all", "cpu-only", "broken", "wrong"]
    assert reports[0].reason("cuda") is None and reports[0].error is None
    assert reports[1].reason("cuda") == "CUDA is not available" and reports[1].reason("cpu") is None
    assert reports[2].reason("cpu") == "ImportError: missing library"
    assert reports[3].error is not None and "mapping" in reports[3].error


def test_import_attribute_finds_a_module_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `pytest --gefen-conformance MODULE:FACTORY` runs the `pytest` script, which (unlike
    # `python -m`) does not put the current directory on sys.path: the spec was not found
    from gefen_contracts.testing import import_attribute

    (tmp_path / "cwd_factory_module.py").write_text("def factory():\n    return 'found'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_factory_module", raising=False)
    assert import_attribute("cwd_factory_module:factory")() == "found"

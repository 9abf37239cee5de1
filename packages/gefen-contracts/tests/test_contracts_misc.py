from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from gefen_contracts import (
    ContractError,
    ContractTypeError,
    KernelRegistry,
    KernelUnavailableError,
    PortableStateLimits,
    StagedTransaction,
    StaleTransactionError,
    parse_op_id,
)


class Owner:
    pass


def test_limits_rules() -> None:
    limits = PortableStateLimits()
    assert limits.max_metadata_bytes == 64 << 20
    small = PortableStateLimits(max_collective_metadata_bytes=1 << 20)
    assert small.max_metadata_bytes == 1 << 20
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


class FakeProvider:
    def __init__(self, name: str, ops: set[str], accept: bool) -> None:
        self._name, self._ops, self._accept = name, frozenset(ops), accept

    @property
    def name(self) -> str:
        return self._name

    def op_ids(self) -> frozenset[str]:
        return self._ops

    def supports(self, op_id: str, *args: Any, **kwargs: Any) -> bool:
        return self._accept and bool(args) and args[0] == "cpu"

    def implementation(self, op_id: str) -> Callable[..., Any]:
        return lambda *a: (self._name, op_id, a)


def test_kernel_registry_lookup_require_and_op_ids() -> None:
    assert parse_op_id("gefen.block_step/1") == ("gefen.block_step", 1)
    for bad in ("block_step/1", "gefen.block_step", "gefen.block_step/0", "Gefen.x/1"):
        with pytest.raises(ContractError):
            parse_op_id(bad)
    registry = KernelRegistry([FakeProvider("slow", {"gefen.op/1"}, False), FakeProvider("fast", {"gefen.op/1"}, True)])
    impl = registry.lookup("gefen.op/1", "cpu")
    assert impl is not None and impl("cpu")[0] == "fast"
    assert registry.lookup("gefen.op/1", "cuda") is None
    assert registry.lookup("gefen.other/1", "cpu") is None
    with pytest.raises(KernelUnavailableError, match="do not support"):
        registry.require("gefen.op/1", "cuda")
    with pytest.raises(KernelUnavailableError, match="no registered provider"):
        registry.require("gefen.other/1", "cpu")
    with pytest.raises(ContractTypeError):
        registry.register(object())  # type: ignore[arg-type]

"""Every Protocol: structural recognition, the feature mapping, and the kit's negative check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from gefen_contracts import (
    STANDARD_FEATURES,
    CheckpointSupport,
    FeatureStatus,
    NotSupportedError,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    TrainingSupport,
)
from gefen_contracts.enums import CheckpointTransport, LoadAtomicity, ParameterLayout, Precision, ProcessGroupScope
from gefen_contracts.protocols import (
    FEATURE_PROTOCOLS,
    PROTOCOL_FEATURES,
    CanonicalLocalState,
    CollectiveScoped,
    Composite,
    ContractProvider,
    IdentityBindable,
    ModeTaggedState,
    ParameterShapedState,
    PortableAdapter,
    StagedNativeLoad,
    StepPreflight,
)
from gefen_contracts.testing import CheckStatus, ConformanceTarget, run_conformance

ALL_PROTOCOLS = (
    ContractProvider,
    ModeTaggedState,
    StepPreflight,
    StagedNativeLoad,
    IdentityBindable,
    CanonicalLocalState,
    PortableAdapter,
    ParameterShapedState,
    CollectiveScoped,
    Composite,
)


def test_every_standard_feature_maps_to_a_protocol_and_back() -> None:
    assert set(FEATURE_PROTOCOLS) == set(STANDARD_FEATURES)
    for protocol, feature in PROTOCOL_FEATURES.items():
        assert FEATURE_PROTOCOLS[feature] is protocol
    for protocol in ALL_PROTOCOLS:
        assert protocol.__doc__ and len(protocol.__doc__) > 200, f"{protocol.__name__} needs a specification"
        assert not isinstance(object(), protocol)


class Refuses(torch.optim.SGD):
    """Implements every optional Protocol but supports none of them (except the contract)."""

    error: type[Exception] = NotSupportedError

    def _refuse(self, feature: str) -> Any:
        if self.error is NotSupportedError:
            raise NotSupportedError(feature, ("this test optimizer refuses",))
        raise self.error(f"{feature} broke")

    def optimizer_contract(self) -> OptimizerContract:
        return OptimizerContract(
            "test.Refuses",
            OptimizerStateLayout((), ()),
            OptimizerCapabilities(
                training=(TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE),),
                checkpoints=(
                    CheckpointSupport(
                        CheckpointTransport.NATIVE_OPTIMIZER,
                        frozenset({ParameterLayout.REPLICATED}),
                        ProcessGroupScope.NONE,
                        LoadAtomicity.NONE,
                    ),
                ),
                precisions=frozenset({Precision.FLOAT32}),
                supported_parameter_ranks=None,
                features={name: FeatureStatus.no("refused on purpose") for name in STANDARD_FEATURES},
            ),
        )

    def state_mode_tags(self, parameter: Any) -> frozenset[str]:
        return frozenset()

    def preflight_step(self) -> None:
        return None

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> Any:
        return self._refuse("staged_native_load")

    def commit_staged_state_dict(self, staged: Any) -> None:
        self._refuse("staged_native_load")

    def prepare_post_sharding(self, rebindings: Sequence[Any], *, manifest: Any, scope: object | None = None) -> Any:
        return self._refuse("post_sharding")

    def commit_post_sharding(self, staged: Any) -> None:
        self._refuse("post_sharding")

    def post_sharding(self, rebindings: Sequence[Any], *, manifest: Any, scope: object | None = None) -> None:
        self._refuse("post_sharding")

    def sharding_manifest(self) -> None:
        return None

    def shard_bindings(self) -> tuple[()]:
        return ()

    def shard_identity(self, parameter: Any) -> Any:
        raise KeyError(parameter)

    def export_local_state(self) -> Any:
        return self._refuse("canonical_local_state")

    def prepare_local_import(self, document: Mapping[str, Any]) -> Any:
        return self._refuse("canonical_local_state")

    def commit_local_import(self, staged: Any) -> None:
        self._refuse("canonical_local_state")

    def portable_layout(self) -> Any:
        return self._refuse("portable_state")

    def portable_export(self) -> Any:
        return self._refuse("portable_state")

    def portable_prepare_import(self, **kwargs: Any) -> Any:
        return self._refuse("portable_state")

    def portable_commit_import(self, staged: Any) -> None:
        self._refuse("portable_state")

    def collective_scope(self) -> None:
        return None

    def initialize_collective_state(self) -> bool:
        return bool(self._refuse("collective_scope"))

    def refresh_collective_state(self) -> bool:
        return bool(self._refuse("collective_scope"))

    def collective_budget(self) -> int:
        return 0

    def child_optimizers(self) -> Any:
        return self._refuse("composite")

    def parameter_routing(self) -> Any:
        return self._refuse("composite")


class Misbehaves(Refuses):
    error = ValueError


def test_a_structural_implementation_is_recognised_by_every_protocol() -> None:
    optimizer = Refuses([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    for protocol in ALL_PROTOCOLS:
        assert isinstance(optimizer, protocol), protocol.__name__


def _factory(cls: type[Refuses]) -> Any:
    return lambda named: cls([p for _, p in named], lr=0.1)


def test_negative_claims_refusing_with_not_supported_pass_the_kit() -> None:
    report = run_conformance(ConformanceTarget(factory=_factory(Refuses), name="refuses"))
    result = next(r for r in report.results if r.name == "contract.negative_claims_refuse")
    assert result.status is CheckStatus.PASSED, report.format()


@pytest.fixture(scope="module")
def misbehaving_report() -> Any:
    return run_conformance(ConformanceTarget(factory=_factory(Misbehaves), name="misbehaves"))


@pytest.mark.parametrize(
    "action",
    [
        "stage_state_dict",
        "post_sharding",
        "export_local_state",
        "portable_export",
        "initialize_collective_state",
        "parameter_routing",
    ],
)
def test_a_negative_claim_raising_the_wrong_error_is_named(action: str, misbehaving_report: Any) -> None:
    failure = next(r for r in misbehaving_report.failures if r.name == "contract.negative_claims_refuse")
    assert f"{action}()" in failure.detail and "instead of NotSupportedError" in failure.detail


def test_a_contributed_check_may_not_take_a_name_already_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results are found by check name: a contributed check named like a built-in one (or twice in
    one entry point) would have its pytest item report the other's result. Its entry point fails,
    naming the clash; a well-named one is taken."""
    import importlib.metadata

    from gefen_contracts.testing.checks import builtin_checks
    from gefen_contracts.testing.runner import CONFORMANCE_ENTRY_POINT_GROUP, contributed_checks

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def covers(self, claims: frozenset[str]) -> frozenset[str]:
            return frozenset()

        def run(self, context: Any) -> None:
            pass

    class Entry:
        def __init__(self, name: str, checks: list[Named]) -> None:
            self.name, self._checks = name, checks

        def load(self) -> Any:
            return lambda: self._checks

    builtin = builtin_checks()[0].name
    entries = [
        Entry("a-clash", [Named(builtin)]),
        Entry("b-twice", [Named("x.twice")] * 2),
        Entry("c-ok", [Named("x.ok")]),
    ]
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        lambda group: entries if group == CONFORMANCE_ENTRY_POINT_GROUP else [],
    )
    checks, broken = contributed_checks()
    assert [c.name for c in checks] == ["x.ok"]
    assert [r.name for r in broken] == ["entry_point:a-clash", "entry_point:b-twice"]
    assert builtin in broken[0].detail and "already taken" in broken[1].detail

from __future__ import annotations

import dataclasses

import pytest
from contract_builders import simple_capabilities, simple_contract, simple_layout
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_STAGED_NATIVE_LOAD,
    CheckpointSupport,
    ContractError,
    ContractTypeError,
    FeatureStatus,
    NotSupportedError,
    OptimizerContract,
    OptimizerStateLayout,
    TrainingSupport,
)
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.codec import from_primitive, to_primitive
from gefen_contracts.contract import CONTRACT_SCHEMA_VERSION, OptimizerChildContract, schema_compatible
from gefen_contracts.enums import CheckpointTransport, LoadAtomicity, ParameterLayout, ProcessGroupScope, TopologyChange
from gefen_contracts.frozen import FrozenMap

REPL = frozenset({ParameterLayout.REPLICATED})


def test_feature_status_requires_reasons_only_when_negative() -> None:
    assert FeatureStatus.no("because").reasons == ("because",)
    with pytest.raises(ContractError, match="say why"):
        FeatureStatus(False)
    with pytest.raises(ContractError, match="must not carry"):
        FeatureStatus(True, ("x",))
    with pytest.raises(ContractError, match="blank"):
        FeatureStatus(False, (" ",))
    with pytest.raises(ContractTypeError):
        FeatureStatus(1)  # type: ignore[arg-type]


def test_checkpoint_support_transitions_and_exact_types() -> None:
    transition = TopologyTransition(
        frozenset({ParameterLayout.REPLICATED}),
        frozenset({ParameterLayout.FLATTENED_ELEMENT_SHARD}),
        frozenset({TopologyChange.PLACEMENT_RESHARD}),
    )
    entry = CheckpointSupport(
        CheckpointTransport.CANONICAL_GLOBAL,
        frozenset(),
        ProcessGroupScope.ADAPTER_DEFINED,
        LoadAtomicity.GROUP_VOTED,
        (transition,),
    )
    assert entry.allows_transition(ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD)
    assert not entry.allows_transition(ParameterLayout.FLATTENED_ELEMENT_SHARD, ParameterLayout.REPLICATED)
    assert entry.atomic_load
    with pytest.raises(ContractError, match="kinds"):
        TopologyTransition(REPL, REPL, frozenset())
    assert transition.update_rtol == 0.0  # exact unless stated
    reshard = frozenset({TopologyChange.PLACEMENT_RESHARD})
    approximate = TopologyTransition(REPL, REPL, reshard, 0.125)
    assert from_primitive(to_primitive(approximate), TopologyTransition) == approximate
    with pytest.raises(ContractTypeError, match="update_rtol must be a float"):
        TopologyTransition(REPL, REPL, reshard, 1)  # type: ignore[arg-type]
    for bad in (-0.1, 1.0, float("nan"), float("inf")):
        with pytest.raises(ContractError, match="update_rtol"):
            TopologyTransition(REPL, REPL, reshard, bad)
    with pytest.raises(ContractTypeError, match="same_topology"):
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER, frozenset({"junk"}), ProcessGroupScope.NONE, LoadAtomicity.NONE
        )  # type: ignore[arg-type]
    with pytest.raises(ContractTypeError, match="requires_collective"):
        CheckpointSupport(
            CheckpointTransport.NATIVE_OPTIMIZER,
            REPL,
            ProcessGroupScope.NONE,
            LoadAtomicity.NONE,
            requires_collective="false",
        )  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="same_topology layouts or transitions"):
        CheckpointSupport(CheckpointTransport.NATIVE_OPTIMIZER, frozenset(), ProcessGroupScope.NONE, LoadAtomicity.NONE)
    with pytest.raises(ContractTypeError):
        TrainingSupport(ParameterLayout.REPLICATED, ProcessGroupScope.NONE, requires_complete_logical_matrix=1)  # type: ignore[arg-type]


def test_capabilities_consistency_rules() -> None:
    with pytest.raises(ContractError, match="canonical_local"):
        simple_capabilities(features={FEATURE_CANONICAL_LOCAL_STATE: FeatureStatus.yes()})
    with pytest.raises(ContractError, match="atomic"):
        simple_capabilities(
            checkpoints=(
                CheckpointSupport(
                    CheckpointTransport.NATIVE_OPTIMIZER, REPL, ProcessGroupScope.NONE, LoadAtomicity.NONE
                ),
            )
        )
    with pytest.raises(ContractError, match="post_sharding"):
        simple_capabilities(features={FEATURE_CANONICAL_IDENTITY: FeatureStatus.yes()})
    with pytest.raises(ContractError, match="twice"):
        entry = simple_capabilities().checkpoints[0]
        simple_capabilities(checkpoints=(entry, entry))
    with pytest.raises(ContractError, match="namespaced"):
        simple_capabilities(features={"shiny": FeatureStatus.yes()})
    with pytest.raises(ContractTypeError, match="FeatureStatus"):
        simple_capabilities(features={FEATURE_STAGED_NATIVE_LOAD: True})
    with pytest.raises(ContractTypeError, match="training"):
        simple_capabilities(training=("x",))
    caps = simple_capabilities(
        features={FEATURE_STAGED_NATIVE_LOAD: FeatureStatus.yes(), "vendor.extra": FeatureStatus.no("later")}
    )
    assert caps.supports(FEATURE_STAGED_NATIVE_LOAD) and not caps.supports(FEATURE_PORTABLE_STATE)
    assert caps.feature(FEATURE_PORTABLE_STATE).reasons == ("not declared by the optimizer",)
    assert caps.checkpoint_support(CheckpointTransport.NATIVE_OPTIMIZER, ParameterLayout.REPLICATED) is not None
    assert caps.supports_training(ParameterLayout.REPLICATED)
    assert isinstance(caps.features, FrozenMap)
    hash(caps)


def test_contract_rules() -> None:
    contract = simple_contract(extensions={"test.codebook": {"entries": 256, "bounds": [-1.0, 1.0]}})
    assert contract.schema_version == CONTRACT_SCHEMA_VERSION
    assert contract.extensions["test.codebook"]["entries"] == 256  # type: ignore[index]
    hash(contract)
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.implementation = "x"  # type: ignore[misc]
    with pytest.raises(ContractError, match="namespaced"):
        simple_contract(extensions={"Codebook": 1})
    with pytest.raises(ContractTypeError, match="state_layout"):
        simple_contract(state_layout=object())
    with pytest.raises(ContractTypeError, match="capabilities"):
        simple_contract(capabilities=object())
    with pytest.raises(ContractError, match="schema_version"):
        simple_contract(schema_version="1.0")
    assert schema_compatible("3.7") and not schema_compatible("2.0") and not schema_compatible("3")
    with pytest.raises(NotSupportedError, match="not declared"):
        contract.require(FEATURE_PORTABLE_STATE)
    contract.require(FEATURE_STAGED_NATIVE_LOAD)
    with pytest.raises(ContractTypeError, match="contract"):
        OptimizerChildContract("muon", "x.Y", {"not": "a contract"})  # type: ignore[arg-type]


def test_composite_namespaces_must_equal_child_roles() -> None:
    child = OptimizerChildContract("backup", "test.Optimizer", simple_contract())
    layout = OptimizerStateLayout(simple_layout().fields, (), composite_namespaces=("backup",))
    composite = OptimizerContract("test.Composite", layout, simple_capabilities(), children=(child,))
    assert composite.child("backup") is child
    with pytest.raises(ContractError, match="composite_namespaces"):
        OptimizerContract("test.Composite", simple_layout(), simple_capabilities(), children=(child,))
    with pytest.raises(ContractError, match="differs"):
        OptimizerChildContract("backup", "other.Name", simple_contract())

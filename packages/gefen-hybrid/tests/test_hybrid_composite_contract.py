"""The composite's contract is derived from its children's, and the conformance kit passes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from gefen_contracts import (
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    CheckpointSupport,
    ContractError,
    FeatureStatus,
    OptimizerContract,
    OptimizerStateLayout,
    StateField,
    StateGeometry,
    StateRole,
    StateScope,
)
from gefen_contracts.capabilities import TopologyTransition
from gefen_contracts.enums import (
    CheckpointTransport,
    LoadAtomicity,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    TopologyChange,
)
from gefen_contracts.testing import ConformanceTarget, assert_conformant, run_conformance
from gefen_hybrid import (
    ADAMW_CONTRACT,
    CompositeOptimizer,
    ContractedAdamW,
    derive_composite_contract,
    intersect_checkpoint_support,
)
from gefen_hybrid.conformance import composite_factory
from hybrid_toys import (  # noqa: F401 (autouse fixture)
    CONTRIBUTED_WAIVERS,
    SIGN_CONTRACT,
    SignMomentum,
    adamw_factory,
    sign_factory,
    single_threaded_torch,
)
from torch import nn

REPL, DTENSOR, FLAT = (
    ParameterLayout.REPLICATED,
    ParameterLayout.DTENSOR_1D_DEFAULT_WORLD,
    ParameterLayout.FLATTENED_ELEMENT_SHARD,
)
MUON_TAG, BACKUP_TAG = "gefen.role=muon", "gefen.role=backup"


def _composite(backup: object = adamw_factory) -> CompositeOptimizer:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    return CompositeOptimizer.from_factories(model, {"muon": sign_factory, "backup": backup})  # type: ignore[dict-item]


def test_children_namespaces_and_training_claims_per_role() -> None:
    contract = _composite().optimizer_contract()
    assert contract.implementation == "gefen.CompositeOptimizer"
    assert [(c.role, c.implementation) for c in contract.children] == [
        ("muon", "gefen_tests.SignMomentum"),
        ("backup", "gefen.ContractedAdamW"),
    ]
    assert contract.child("backup").contract == ADAMW_CONTRACT
    assert contract.state_layout.composite_namespaces == ("muon", "backup")
    capabilities = contract.capabilities
    assert {(t.layout, t.mode_tags) for t in capabilities.training} == {
        (REPL, frozenset({MUON_TAG})),
        (DTENSOR, frozenset({MUON_TAG})),
        (REPL, frozenset({BACKUP_TAG})),
        (DTENSOR, frozenset({BACKUP_TAG})),
    }
    assert capabilities.supports_training(REPL, mode_tags={MUON_TAG})
    # AdamW trains flattened shards, but only post_sharding binds them and SignMomentum cannot be bound
    assert not capabilities.supports_training(FLAT, mode_tags={BACKUP_TAG})
    assert capabilities.precisions == SIGN_CONTRACT.capabilities.precisions  # the common subset
    assert capabilities.supported_parameter_ranks is None  # AdamW takes any rank


def test_a_one_child_composite_lists_one_namespace() -> None:
    optimizer = CompositeOptimizer({"backup": ContractedAdamW([("b", nn.Parameter(torch.zeros(3)))])})
    contract = optimizer.optimizer_contract()
    assert contract.state_layout.composite_namespaces == ("backup",)
    assert [c.role for c in contract.children] == ["backup"]
    saved = optimizer.state_dict()
    assert saved["child_implementations"] == {"backup": "gefen.ContractedAdamW"}
    assert not any(str(key).startswith("muon.") for key in saved)


def test_native_claim_is_the_layouts_both_children_share_and_atomic_when_both_stage() -> None:
    (native,) = _composite().optimizer_contract().capabilities.checkpoints
    assert native.transport is CheckpointTransport.COMPOSITE_NATIVE
    assert native.same_topology == {REPL}  # SignMomentum claims REPLICATED only, AdamW also DTensor
    assert native.atomicity is LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION


def test_features_are_supported_only_when_every_child_supports_them_and_say_which_child_does_not() -> None:
    features = _composite().optimizer_contract().capabilities.features
    assert features[FEATURE_COMPOSITE].supported
    scope = features[FEATURE_COLLECTIVE_SCOPE]
    assert not scope.supported
    assert scope.reasons == (
        "child 'muon' (gefen_tests.SignMomentum): toy optimizer: learns nothing collectively",
        "child 'backup' (gefen.ContractedAdamW): AdamW learns nothing collectively (no codebook, no scope)",
    )


@dataclass
class _Fake:
    """A stand-in child that only publishes a contract (for derivation rules alone)."""

    contract: OptimizerContract

    def optimizer_contract(self) -> OptimizerContract:
        return self.contract


def _with(contract: OptimizerContract, **changes: object) -> OptimizerContract:
    capabilities = replace(contract.capabilities, **changes)
    return replace(contract, capabilities=capabilities)


def _canonical(layouts: set[ParameterLayout]) -> CheckpointSupport:
    return CheckpointSupport(
        CheckpointTransport.CANONICAL_LOCAL, frozenset(layouts), ProcessGroupScope.NONE, LoadAtomicity.GROUP_VOTED
    )


def _both_support(feature: str, extra_entry: CheckpointSupport | None = None) -> list[tuple[str, _Fake]]:
    features = {**ADAMW_CONTRACT.capabilities.features, feature: FeatureStatus.yes()}
    children = []
    for role, layouts in (("muon", {REPL, FLAT}), ("backup", {REPL})):
        entries = ADAMW_CONTRACT.capabilities.checkpoints
        if extra_entry is not None:
            entries = (*entries, replace(extra_entry, same_topology=frozenset(layouts)))
        children.append((role, _Fake(_with(ADAMW_CONTRACT, features=features, checkpoints=entries))))
    return children


def test_a_feature_every_child_supports_needs_the_composite_protocol_too() -> None:
    contract = derive_composite_contract("x.Composite", _both_support(FEATURE_COLLECTIVE_SCOPE), frozenset())
    status = contract.capabilities.feature(FEATURE_COLLECTIVE_SCOPE)
    assert status.reasons == (
        "every child supports collective_scope, but the composite does not implement CollectiveScoped yet",
    )


def test_a_transport_is_claimed_as_the_intersection_once_the_composite_implements_it() -> None:
    children = _both_support(FEATURE_CANONICAL_LOCAL_STATE, _canonical({REPL}))
    contract = derive_composite_contract("x.Composite", children, frozenset({FEATURE_CANONICAL_LOCAL_STATE}))
    canonical = [e for e in contract.capabilities.checkpoints if e.transport is CheckpointTransport.CANONICAL_LOCAL]
    assert len(canonical) == 1 and canonical[0].same_topology == {REPL}
    assert canonical[0].atomicity is LoadAtomicity.GROUP_VOTED
    assert contract.capabilities.supports(FEATURE_CANONICAL_LOCAL_STATE)


def test_a_transport_the_children_share_no_layout_for_is_declared_negative() -> None:
    children = _both_support(FEATURE_CANONICAL_LOCAL_STATE, _canonical({REPL}))
    muon_contract = children[0][1].contract
    entries = tuple(
        replace(e, same_topology=frozenset({FLAT})) if e.transport is CheckpointTransport.CANONICAL_LOCAL else e
        for e in muon_contract.capabilities.checkpoints
    )
    children[0] = ("muon", _Fake(_with(muon_contract, checkpoints=entries)))
    contract = derive_composite_contract("x.Composite", children, frozenset({FEATURE_CANONICAL_LOCAL_STATE}))
    status = contract.capabilities.feature(FEATURE_CANONICAL_LOCAL_STATE)
    assert status.reasons == ("the children's canonical_local claims share no layout",)
    assert all(e.transport is not CheckpointTransport.CANONICAL_LOCAL for e in contract.capabilities.checkpoints)


def test_intersect_checkpoint_support_rules() -> None:
    def entry(layouts: set[ParameterLayout], **kw: object) -> CheckpointSupport:
        base = {
            "process_group_scope": ProcessGroupScope.NONE,
            "atomicity": LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
        }
        base.update(kw)
        return CheckpointSupport(CheckpointTransport.NATIVE_OPTIMIZER, frozenset(layouts), **base)  # type: ignore[arg-type]

    out = CheckpointTransport.COMPOSITE_NATIVE
    move = TopologyTransition(frozenset({REPL, FLAT}), frozenset({FLAT}), frozenset(TopologyChange))
    narrow = TopologyTransition(
        frozenset({FLAT}), frozenset({FLAT, DTENSOR}), frozenset({TopologyChange.PLACEMENT_RESHARD})
    )
    (merged,) = intersect_checkpoint_support(
        out,
        [
            [entry({REPL, FLAT}, transitions=(move,), mesh_dimensions=(1, 2), requires_collective=True)],
            [
                entry(
                    {REPL},
                    transitions=(narrow,),
                    process_group_scope=ProcessGroupScope.DEFAULT_WORLD,
                    atomicity=LoadAtomicity.NONE,
                    mesh_dimensions=(1,),
                    mode_tags=frozenset({"x.mode"}),
                )
            ],
        ],
    )
    assert merged.transport is out and merged.same_topology == {REPL}
    assert merged.transitions == (
        TopologyTransition(frozenset({FLAT}), frozenset({FLAT}), frozenset({TopologyChange.PLACEMENT_RESHARD})),
    )
    assert merged.process_group_scope is ProcessGroupScope.DEFAULT_WORLD
    assert merged.atomicity is LoadAtomicity.NONE and merged.requires_collective
    assert merged.mesh_dimensions == (1,) and merged.mode_tags == {"x.mode"}
    assert intersect_checkpoint_support(out, [[entry({REPL})], [entry({DTENSOR})]]) == ()
    assert (
        intersect_checkpoint_support(
            out, [[entry({REPL}, mesh_dimensions=(1,))], [entry({REPL}, mesh_dimensions=(2,))]]
        )
        == ()
    )
    two = intersect_checkpoint_support(
        out,
        [
            [entry({REPL}, process_group_scope=ProcessGroupScope.DEFAULT_WORLD)],
            [entry({REPL}, process_group_scope=ProcessGroupScope.INFERRED_DEVICE_MESH)],
        ],
    )
    assert two[0].process_group_scope is ProcessGroupScope.ADAPTER_DEFINED


def test_children_that_cannot_be_described_together_are_refused_at_construction() -> None:
    conflicting = replace(
        ADAMW_CONTRACT,
        state_layout=OptimizerStateLayout(
            fields=(StateField("momentum_buffer", StateScope.PARAMETER, StateRole.CACHE, StateGeometry.PARAMETER),),
            parameter_variants=(),
        ),
    )
    with pytest.raises(ContractError, match="'momentum_buffer' is declared differently"):
        derive_composite_contract(
            "x.Composite", [("muon", _Fake(SIGN_CONTRACT)), ("backup", _Fake(conflicting))], frozenset()
        )
    half_only = _with(ADAMW_CONTRACT, precisions=frozenset({Precision.FLOAT16}))
    with pytest.raises(ContractError, match="no common parameter precision"):
        derive_composite_contract(
            "x.Composite", [("muon", _Fake(SIGN_CONTRACT)), ("backup", _Fake(half_only))], frozenset()
        )


def test_the_implementation_name_is_the_callers() -> None:
    w = nn.Parameter(torch.randn(2, 2))
    optimizer = CompositeOptimizer({"muon": SignMomentum([("w", w)])}, implementation="gefen.GefenMuonHybrid")
    assert optimizer.optimizer_contract().implementation == "gefen.GefenMuonHybrid"
    with pytest.raises(ValueError, match="whitespace"):
        CompositeOptimizer({"muon": SignMomentum([("w", w)])}, implementation=" gefen.X")


_DTENSOR_WHY = "executed by test_hybrid_distributed.py (gloo, FSDP2)"


@pytest.mark.parametrize(
    ("backup", "waive"),
    [
        (
            adamw_factory,
            {f"training:dtensor_1d_default_world[{t}]": _DTENSOR_WHY for t in (MUON_TAG, BACKUP_TAG)},
        ),
    ],
    ids=["sign+ContractedAdamW"],
)
def test_conformance_kit_passes_on_composites_of_non_gefen_children(backup: object, waive: dict[str, str]) -> None:
    def factory(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        return CompositeOptimizer.from_factories(named, {"muon": sign_factory, "backup": backup})  # type: ignore[dict-item]

    report = run_conformance(ConformanceTarget(factory, name="composite"), waive=waive)
    assert_conformant(report)
    passed = {r.name for r in report.results if r.status.value == "passed"}
    assert {"composite.rules", "checkpoint.native_atomic_load", "state.declared_variants"} <= passed


def test_conformance_kit_passes_on_the_shipped_composite_factory() -> None:
    report = run_conformance(
        "gefen_hybrid.conformance:composite_factory", waive=CONTRIBUTED_WAIVERS, include_contributed=False
    )
    assert_conformant(report)
    assert composite_factory.conformance_waive  # type: ignore[attr-defined]

"""The composite's post_sharding (one plan partitioned by routing, both children prepared before
either commits, sealed) and canonical local state (children's documents nested by role)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_POST_SHARDING,
    ContractError,
    LayoutTamperedError,
    NotSupportedError,
    StaleTransactionError,
    StateValidationError,
)
from gefen_contracts.enums import CheckpointTransport, ParameterLayout
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.testing import (
    deep_snapshot,
    flattened_plan,
    install_parameters,
    replicated_copy_plan,
    snapshot_diff,
)
from gefen_contracts.torch_support import CodebookProcessGroupBinding
from gefen_hybrid import CompositeOptimizer, ContractedAdamW
from hybrid_golden import check_golden
from hybrid_toys import sign_factory, single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn

REPL = ParameterLayout.REPLICATED


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 4)  # the same shape as Hidden.weight, in the other child
        self.Hidden = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.Hidden(self.embed(tokens).mean(dim=1))))  # type: ignore[no-any-return]


FACTORIES = {
    "muon": lambda named: ContractedAdamW(named, lr=2e-2, weight_decay=0.0),
    "backup": lambda named: ContractedAdamW(named, lr=1e-2),
}


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 4, (5, 3), generator=generator)
    return model(tokens).pow(2).mean()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        optimizer.step()


def _composite(model: nn.Module, *, reverse: bool = False) -> CompositeOptimizer:
    named = list(model.named_parameters())
    return CompositeOptimizer.from_factories(named[::-1] if reverse else named, FACTORIES)


def _bound(seed: int = 0, *, reverse: bool = False) -> tuple[nn.Module, CompositeOptimizer, Any]:
    model = _net(seed)
    composite = _composite(model, reverse=reverse)
    named = list(model.named_parameters())
    plan = replicated_copy_plan(named)
    composite.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in named})
    return model, composite, plan


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_binding_partitions_by_routing_and_trains_like_a_composite_built_on_the_copies() -> None:
    model, composite, plan = _bound()
    routing = composite.parameter_routing()
    assert routing == (
        ("Hidden.bias", "backup"),
        ("Hidden.weight", "muon"),
        ("embed.weight", "backup"),
        ("out.bias", "backup"),
        ("out.weight", "muon"),
    )
    children = composite.child_optimizers()
    assert children["muon"].sharding_manifest().fqns == ("Hidden.weight", "out.weight")  # type: ignore[attr-defined]
    assert composite.sharding_manifest() == plan.manifest
    bindings = composite.shard_bindings()
    assert [s.fqn for _, s in bindings] == sorted(plan.targets)
    assert all(composite.shard_identity(t) == s for t, s in bindings)
    with pytest.raises(KeyError):
        composite.shard_identity(torch.zeros(1))
    twin = _net()
    named = list(twin.named_parameters())
    copies = replicated_copy_plan(named)
    install_parameters(twin, {id(p): copies.targets[n] for n, p in named})
    direct = _composite(twin)
    _train(model, composite, 3)
    _train(twin, direct, 3)
    assert _equal(model, twin)
    saved = composite.state_dict()
    assert [fqn for fqn, _ in saved["routing"]] == [fqn for fqn, _ in routing]


def test_a_failure_preparing_the_second_child_leaves_both_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _net()
    composite = _composite(model)
    plan = replicated_copy_plan(list(model.named_parameters()))
    backup = composite.child_optimizers()["backup"]

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault preparing the backup child")

    monkeypatch.setattr(backup, "prepare_post_sharding", boom)
    before = deep_snapshot(composite, model, plan.targets)
    with pytest.raises(RuntimeError, match="injected"):
        composite.post_sharding(plan.rebindings, manifest=plan.manifest)
    assert snapshot_diff(before, composite, model, plan.targets) == []
    monkeypatch.undo()
    composite.post_sharding(plan.rebindings, manifest=plan.manifest)  # a retry works
    assert composite.sharding_manifest() == plan.manifest


def test_a_child_that_would_refuse_at_commit_time_makes_the_commit_stale_before_any_child_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _net()
    composite = _composite(model)
    plan = replicated_copy_plan(list(model.named_parameters()))
    staged = composite.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
    backup = composite.child_optimizers()["backup"]
    monkeypatch.setattr(backup, "prepare_post_sharding", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("gone")))
    before = deep_snapshot(composite, model, plan.targets)
    with pytest.raises(StaleTransactionError, match="no longer accepts"):
        composite.commit_post_sharding(staged)
    assert snapshot_diff(before, composite, model, plan.targets) == []
    assert composite.child_optimizers()["muon"].sharding_manifest() is None  # type: ignore[attr-defined]


def _refused(
    composite: CompositeOptimizer, model: nn.Module, action: Any, error: type[BaseException], match: str
) -> None:
    before = deep_snapshot(composite, model)
    with pytest.raises(error, match=match):
        action()
    assert snapshot_diff(before, composite, model) == []


def test_cross_child_requests_are_refused_before_any_child_is_prepared() -> None:
    model = _net()
    composite = _composite(model)
    plan = replicated_copy_plan(list(model.named_parameters()))
    by_name = {r.shard.fqn: r for r in plan.rebindings}
    hidden = by_name["Hidden.weight"]
    embed = by_name["embed.weight"]  # backup; its target would be the muon child's Hidden.weight tensor
    stealing = [
        *[r for r in plan.rebindings if r is not embed],
        ParameterRebinding(embed.old_parameter, hidden.old_parameter, embed.shard),
    ]
    buffer = torch.zeros(20)
    overlapping = [
        ParameterRebinding(hidden.old_parameter, buffer[:16].view(4, 4), hidden.shard),  # muon
        ParameterRebinding(by_name["Hidden.bias"].old_parameter, buffer[15:19], by_name["Hidden.bias"].shard),  # backup
        *[r for r in plan.rebindings if r.shard.fqn not in ("Hidden.weight", "Hidden.bias")],
    ]
    _refused(
        composite,
        model,
        lambda: composite.post_sharding(stealing, manifest=plan.manifest),
        ContractError,
        "occupies another slot",
    )
    _refused(
        composite, model, lambda: composite.post_sharding(overlapping, manifest=plan.manifest), ContractError, "overlap"
    )
    scope = CodebookProcessGroupBinding(
        __import__("gefen_contracts").identity.ProcessGroupIdentity("solo", ("rank:0",)), "rank:0", None, "cpu"
    )
    _refused(
        composite,
        model,
        lambda: composite.post_sharding(plan.rebindings, manifest=plan.manifest, scope=scope),
        NotSupportedError,
        "collective",
    )


def test_a_composite_with_a_child_that_cannot_be_bound_says_why() -> None:
    model = _net()
    composite = CompositeOptimizer.from_factories(model, {"muon": sign_factory, "backup": FACTORIES["backup"]})
    status = composite.optimizer_contract().capabilities.feature(FEATURE_POST_SHARDING)
    assert not status.supported and "child 'muon' (gefen_tests.SignMomentum): toy optimizer" in status.reasons[0]
    plan = replicated_copy_plan(list(model.named_parameters()))
    _refused(
        composite,
        model,
        lambda: composite.post_sharding(plan.rebindings, manifest=plan.manifest),
        NotSupportedError,
        "toy optimizer",
    )


def test_children_bound_outside_the_composite_are_not_claimed_by_it() -> None:
    model = _net()
    composite = _composite(model)
    for child in composite.child_optimizers().values():
        named = [(n, p) for g in child.param_groups for n, p in zip(g["param_names"], g["params"])]
        plan = replicated_copy_plan(named)
        child.post_sharding(plan.rebindings, manifest=plan.manifest)  # type: ignore[attr-defined]
    features = composite.optimizer_contract().capabilities.features
    for feature in (FEATURE_POST_SHARDING, FEATURE_CANONICAL_IDENTITY, FEATURE_CANONICAL_LOCAL_STATE):
        assert not features[feature].supported and "outside the composite" in features[feature].reasons[0]
    assert composite.sharding_manifest() is None


def test_the_sealed_composite_refuses_new_groups_a_second_binding_and_tampering() -> None:
    model, composite, plan = _bound()
    extra = [("extra.bias", nn.Parameter(torch.zeros(3)))]
    _refused(composite, model, lambda: composite.add_param_group({"params": extra}), RuntimeError, "sealed")
    _refused(
        composite,
        model,
        lambda: composite.post_sharding(plan.rebindings, manifest=plan.manifest),
        RuntimeError,
        "already finalized",
    )
    _train(model, composite, 1)
    composite.zero_grad()
    _loss(model, 1).backward()
    composite.child_optimizers()["backup"].param_groups[0]["params"].reverse()  # the child muon steps first
    _refused(composite, model, composite.step, LayoutTamperedError, "changed outside post_sharding")
    features = composite.optimizer_contract().capabilities.features
    assert not features[FEATURE_CANONICAL_IDENTITY].supported


def _flat_composites(values: nn.Module, *, bound: bool) -> list[tuple[CompositeOptimizer, Any]]:
    members = []
    for member in range(2):
        model = _net()
        named = list(model.named_parameters())
        plan = flattened_plan(named, member, whole_to_first=["out.bias"], values=dict(values.named_parameters()))
        if bound:
            composite = _composite(model)
            composite.post_sharding(plan.rebindings, manifest=plan.manifest)
        else:  # built directly on the shards, with the routing of their logical parameters
            routing = dict(_composite(_net()).parameter_routing())
            split = {
                role: [(n, t) for n, t in plan.named_targets() if routing[n] == role] for role in ("muon", "backup")
            }
            composite = CompositeOptimizer.from_factories(split, FACTORIES)
        members.append((composite, plan))
    return members


def test_flattened_composite_members_train_like_composites_built_on_the_shards_and_like_the_full_tensors() -> None:
    full = _net()
    reference = _composite(full)
    bound, direct = _flat_composites(full, bound=True), _flat_composites(full, bound=False)
    for step in range(3):
        reference.zero_grad(set_to_none=True)
        _loss(full, step).backward()
        grads = {n: p.grad for n, p in full.named_parameters()}
        for composite, plan in (*bound, *direct):
            for rebinding in plan.rebindings:
                extent = rebinding.shard.extent
                start, length = extent.flat_offset, extent.length  # type: ignore[union-attr]
                plan.targets[rebinding.shard.fqn].grad = (
                    grads[rebinding.shard.fqn].reshape(-1)[start : start + length].clone()
                )
            composite.step()
        reference.step()
        for (_, a), (_, b) in zip(bound, direct):
            assert all(torch.equal(a.targets[n], b.targets[n]) for n in a.targets)
        for name, parameter in full.named_parameters():
            gathered = torch.cat([plan.targets[name].detach() for _, plan in bound])
            assert torch.equal(gathered, parameter.detach().reshape(-1)), name  # AdamW is elementwise


def test_canonical_state_nests_the_children_and_routes_into_a_reordered_composite() -> None:
    model, composite, _ = _bound()
    _train(model, composite, 3)
    document = composite.export_local_state()
    assert document["format"] == "gefen.composite_bound_state" and set(document["children"]) == {"muon", "backup"}
    assert document["policy"] == {
        "child_implementations": {"muon": "gefen.ContractedAdamW", "backup": "gefen.ContractedAdamW"}
    }
    assert sorted(document["children"]["muon"]["parameters"]) == ["Hidden.weight", "out.weight"]
    twin_model, twin, _ = _bound(1, reverse=True)
    twin_model.load_state_dict(model.state_dict())
    before = deep_snapshot(twin, twin_model)
    staged = twin.prepare_local_import(document)
    assert snapshot_diff(before, twin, twin_model) == []
    twin.commit_local_import(staged)
    with pytest.raises(StaleTransactionError, match="consumed"):
        twin.commit_local_import(staged)
    _train(model, composite, 3, start=3)
    _train(twin_model, twin, 3, start=3)
    assert _equal(model, twin_model)


def test_a_stale_or_corrupted_composite_import_changes_neither_child() -> None:
    model, composite, _ = _bound()
    _train(model, composite, 2)
    document = composite.export_local_state()
    twin_model, twin, _ = _bound(1)
    _train(twin_model, twin, 1)
    staged = twin.prepare_local_import(document)
    _train(twin_model, twin.child_optimizers()["backup"], 1, start=5)  # a child steps on its own
    _refused(twin, twin_model, lambda: twin.commit_local_import(staged), StaleTransactionError, "changed after")
    broken = composite.export_local_state()
    broken["children"]["backup"]["parameters"]["out.bias"]["state"]["exp_avg"].fill_(float("nan"))
    _refused(twin, twin_model, lambda: twin.prepare_local_import(broken), StateValidationError, "non-finite")
    rerouted = composite.export_local_state()
    rerouted["routing"] = [[fqn, "muon"] for fqn, _ in rerouted["routing"]]
    _refused(twin, twin_model, lambda: twin.prepare_local_import(rerouted), StateValidationError, "routing")


def test_the_composite_contract_follows_the_binding() -> None:
    model = _net()
    composite = _composite(model)
    capabilities = composite.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_POST_SHARDING)
    reason = capabilities.feature(FEATURE_CANONICAL_LOCAL_STATE).reasons[0]
    assert reason.startswith("child 'muon' (gefen.ContractedAdamW): ") and "post_sharding" in reason
    plan = replicated_copy_plan(list(model.named_parameters()))
    composite.post_sharding(plan.rebindings, manifest=plan.manifest)
    capabilities = composite.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_CANONICAL_IDENTITY) and capabilities.supports(FEATURE_CANONICAL_LOCAL_STATE)
    entry = capabilities.checkpoint_support(CheckpointTransport.CANONICAL_LOCAL, REPL)
    assert entry is not None and entry.same_topology == {REPL}


def test_the_composite_document_format_is_pinned_by_a_golden_vector() -> None:
    def build() -> tuple[nn.Module, CompositeOptimizer]:
        model = nn.Module()
        model.Block = nn.Linear(2, 2)
        with torch.no_grad():
            model.Block.weight.copy_(torch.tensor([[1.0, 0.5], [-0.5, 2.0]]))
            model.Block.bias.copy_(torch.tensor([0.25, -0.125]))
        composite = _composite(model)
        plan = replicated_copy_plan(list(model.named_parameters()))
        composite.post_sharding(plan.rebindings, manifest=plan.manifest)
        install_parameters(model, {id(p): plan.targets[n] for n, p in model.named_parameters()})
        return model, composite

    _, composite = build()
    muon = composite.child_optimizers()["muon"]
    native = muon.state_dict()
    native["state"] = {
        0: {"step": torch.tensor(1.0), "exp_avg": torch.full((2, 2), 0.5), "exp_avg_sq": torch.full((2, 2), 0.25)}
    }
    muon.load_state_dict(native)
    golden = check_golden("composite_bound_state.json", composite.export_local_state())
    twin_model, twin = build()
    twin.commit_local_import(twin.prepare_local_import(golden))
    block: Any = twin_model.Block
    assert torch.equal(twin.state[block.weight]["exp_avg"], torch.full((2, 2), 0.5))


def test_a_copy_of_a_finalized_composite_stays_sealed_and_trains_identically() -> None:
    model, composite, _ = _bound()
    _train(model, composite, 2)
    twin_model, twin = copy.deepcopy((model, composite))
    params = {id(p) for child in twin.child_optimizers().values() for g in child.param_groups for p in g["params"]}
    assert {id(t) for t, _ in twin.shard_bindings()} == params  # the copy's bindings hold the copied tensors
    assert twin.parameter_routing() == composite.parameter_routing()
    with pytest.raises(RuntimeError, match="sealed"):
        twin.add_param_group({"params": [("extra", nn.Parameter(torch.zeros(2)))]})
    _train(model, composite, 2, start=2)
    _train(twin_model, twin, 2, start=2)
    assert _equal(model, twin_model)

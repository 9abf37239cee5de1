"""post_sharding (IdentityBindable) of Gefen and GefenMuon in one process: bit-identical training
after rebinding, refusals without mutation, atomicity under injected faults, the sealed layout and
its guard (also inside a closure), the dynamic contract, and copies of a finalized optimizer.

The multi-process side (flattened members and whole-parameter owners under a codebook scope)
is in ``test_core_scope.py``."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_POST_SHARDING,
    ContractError,
    LayoutTamperedError,
    NotSupportedError,
    StaleTransactionError,
)
from gefen_contracts.enums import CheckpointTransport, ParameterLayout, PlacementKind
from gefen_contracts.identity import (
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.testing import deep_snapshot, install_parameters, replicated_copy_plan, snapshot_diff
from gefen_contracts.torch_support import CodebookProcessGroupBinding
from gefen_contracts.torch_support import identity_binding as binding_module
from gefen_core import Gefen, GefenMuon
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)
from torch import nn

REPL, FLAT, OWNER = (
    ParameterLayout.REPLICATED,
    ParameterLayout.FLATTENED_ELEMENT_SHARD,
    ParameterLayout.WHOLE_PARAMETER_OWNER,
)


class Net(nn.Module):
    """Only matrices, so the same model serves Gefen and GefenMuon."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(16, 8) * 0.5)
        self.proj = nn.Linear(8, 12, bias=False)
        self.head = nn.Linear(12, 4, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed[tokens].mean(dim=1))))  # type: ignore[no-any-return]


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _groups(named: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    return [
        {"params": [(n, p) for n, p in named if n == "embed"]},
        {"params": [(n, p) for n, p in named if n != "embed"], "lr": 3e-3},
    ]


FACTORIES: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "gefen": lambda named, **kw: Gefen(_groups(named), lr=1e-2, fused=False, **kw),
    "muon": lambda named, **kw: GefenMuon(_groups(named), lr=1e-2, fused=False, **kw),
}


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 16, (6, 5), generator=generator)
    return torch.nn.functional.mse_loss(model(tokens), torch.randn(6, 4, generator=generator))


def _train(model: nn.Module, optimizer: Any, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        optimizer.step()


def _fresh(kind: str = "gefen", **kw: Any) -> tuple[nn.Module, Any, Any]:
    model = _net()
    named = list(model.named_parameters())
    return model, FACTORIES[kind](named, **kw), replicated_copy_plan(named)


def _bound(kind: str = "gefen", **kw: Any) -> tuple[nn.Module, Any]:
    model, optimizer, plan = _fresh(kind, **kw)
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in model.named_parameters()})
    return model, optimizer


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _refused(optimizer: Any, roots: tuple[Any, ...], action: Callable[[], object], error: type, match: str) -> None:
    before = deep_snapshot(optimizer, *roots)
    with pytest.raises(error, match=match):
        action()
    assert snapshot_diff(before, optimizer, *roots) == []


def _solo_scope() -> CodebookProcessGroupBinding:
    return CodebookProcessGroupBinding(ProcessGroupIdentity("solo", ("rank:0",)), "rank:0", None, torch.device("cpu"))


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_replicated_rebinding_trains_like_an_optimizer_built_on_the_copies(kind: str) -> None:
    model, optimizer = _bound(kind)
    twin = _net()
    named = list(twin.named_parameters())
    copies = replicated_copy_plan(named)
    install_parameters(twin, {id(p): copies.targets[n] for n, p in named})
    reference = FACTORIES[kind](list(twin.named_parameters()))
    _train(model, optimizer, 3)
    _train(twin, reference, 3)
    assert _equal(model, twin)
    assert [g["param_names"] for g in optimizer.param_groups] == [["embed"], ["proj.weight", "head.weight"]]


def test_a_solo_scope_trains_like_no_scope_and_is_recorded() -> None:
    model, optimizer, plan = _fresh()
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest, scope=_solo_scope())
    install_parameters(model, {id(p): plan.targets[n] for n, p in model.named_parameters()})
    control_model, control = _bound()
    _train(model, optimizer, 3)
    _train(control_model, control, 3)
    assert _equal(model, control_model)
    assert optimizer.collective_scope().identity.semantic_name == "solo" and control.collective_scope() is None
    assert optimizer.collective_budget() == 2
    assert optimizer.state_dict()["gefen_shard_identity"]["scope"] == {
        "semantic_name": "solo",
        "ordered_members": ["rank:0"],
    }


def _owner_shards(name: str, shape: tuple[int, ...]) -> tuple[ShardIdentity, ShardIdentity]:
    identity = ParameterIdentity(name, shape)
    group = ProcessGroupIdentity("dp", ("member:0", "member:1"))
    return tuple(  # type: ignore[return-value]
        ShardIdentity(
            identity,
            OWNER,
            LogicalSlice.full(identity) if member == 0 else LogicalSlice(0, 0),
            (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, member, 2),),
            group,
            f"member:{member}",
            owner="member:0",
        )
        for member in (0, 1)
    )


def _flat_shards(name: str, shape: tuple[int, ...]) -> tuple[ShardIdentity, ShardIdentity]:
    identity = ParameterIdentity(name, shape)
    group = ProcessGroupIdentity("dp", ("member:0", "member:1"))
    half = identity.numel // 2
    return tuple(  # type: ignore[return-value]
        ShardIdentity(
            identity,
            FLAT,
            LogicalSlice(member * half, half),
            (ShardPlacement("dp", PlacementKind.FLAT_SHARD, member, 2),),
            group,
            f"member:{member}",
        )
        for member in (0, 1)
    )


def _with_layout(plan: Any, layout: str) -> tuple[list[ParameterRebinding], ShardingManifest]:
    """``plan`` with ``embed`` re-laid out as member 0's owner shard or flattened half."""
    first = plan.rebindings[0]
    assert first.shard.fqn == "embed"
    if layout == "owner":
        mine, other = _owner_shards("embed", (16, 8))
        target = first.new_parameter
    else:
        mine, other = _flat_shards("embed", (16, 8))
        target = nn.Parameter(first.old_parameter.detach().reshape(-1)[:64].clone())
    kept = tuple(s for s in plan.manifest.shards if s.fqn != "embed")
    return [ParameterRebinding(first.old_parameter, target, mine), *plan.rebindings[1:]], ShardingManifest(
        (*kept, mine, other)
    )


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_invalid_requests_are_refused_without_mutation(kind: str) -> None:
    model, optimizer, plan = _fresh(kind)
    rebindings = list(plan.rebindings)
    last = rebindings[-1]
    aliased = rebindings[1].new_parameter.detach().view(-1)[:48].view(4, 12)  # storage of another target
    duplicate = [*rebindings[:-1], ParameterRebinding(last.old_parameter, aliased, last.shard)]
    expanded = [*rebindings[:-1], ParameterRebinding(last.old_parameter, torch.zeros(1).expand(4, 12), last.shard)]
    wrong_shape = [*rebindings[:-1], ParameterRebinding(last.old_parameter, torch.zeros(4, 11), last.shard)]
    foreign = [*rebindings[:-1], ParameterRebinding(nn.Parameter(torch.zeros(4, 12)), last.new_parameter, last.shard)]
    other = ShardingManifest(
        (*plan.manifest.shards[:-1], ShardIdentity(ParameterIdentity("head.other", (4, 12)), REPL, LogicalSlice(0, 48)))
    )
    first = rebindings[0]
    assert first.old_parameter.numel() != last.old_parameter.numel()
    # each slot paired with the other's shard and target: every check of the targets passes
    swapped = [
        ParameterRebinding(first.old_parameter, last.new_parameter, last.shard),
        *rebindings[1:-1],
        ParameterRebinding(last.old_parameter, first.new_parameter, first.shard),
    ]
    unsupported = "owner" if kind == "gefen" else "flat"
    bad_layout, bad_manifest = _with_layout(plan, unsupported)
    cases = [
        (lambda: optimizer.post_sharding(duplicate, manifest=plan.manifest), ContractError, "overlap in storage"),
        (lambda: optimizer.post_sharding(rebindings[:-1], manifest=plan.manifest), ContractError, "missing"),
        (lambda: optimizer.post_sharding(expanded, manifest=plan.manifest), ContractError, "overlaps itself"),
        (lambda: optimizer.post_sharding(wrong_shape, manifest=plan.manifest), ContractError, "shape"),
        (lambda: optimizer.post_sharding(foreign, manifest=plan.manifest), ContractError, "not a parameter of this"),
        (lambda: optimizer.post_sharding(swapped, manifest=plan.manifest), ContractError, "binds a slot of"),
        (lambda: optimizer.post_sharding(rebindings, manifest=other), ContractError, "manifest"),
        (lambda: optimizer.post_sharding(bad_layout, manifest=bad_manifest), ContractError, "binds"),
    ]
    for action, error, match in cases:
        _refused(optimizer, (model, plan.targets), action, error, match)
    assert optimizer.sharding_manifest() is None


def test_capturable_has_no_collective_scope_and_says_why() -> None:
    _, capturable, _ = _fresh(capturable=True)
    status = capturable.optimizer_contract().capabilities.feature(FEATURE_COLLECTIVE_SCOPE)
    assert not status.supported and "capturable" in status.reasons[0]
    with pytest.raises(NotSupportedError, match="capturable"):
        capturable.refresh_collective_state()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_stepped_optimizer_is_not_pristine_and_says_so(kind: str) -> None:
    model, optimizer, _ = _fresh(kind)
    _train(model, optimizer, 1)
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_POST_SHARDING)
    assert not status.supported and status.reasons
    plan = replicated_copy_plan(list(model.named_parameters()))
    _refused(
        optimizer,
        (model,),
        lambda: optimizer.post_sharding(plan.rebindings, manifest=plan.manifest),
        NotSupportedError,
        FEATURE_POST_SHARDING,
    )


def test_prepare_mutates_nothing_and_commit_is_single_use_owned_and_fresh() -> None:
    model, optimizer, plan = _fresh()
    before = deep_snapshot(optimizer, model)
    staged = optimizer.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
    assert snapshot_diff(before, optimizer, model) == []
    other_model, other, _ = _fresh()
    _refused(other, (other_model,), lambda: other.commit_post_sharding(staged), StaleTransactionError, "another")
    optimizer.param_groups[1]["lr"] = 1e-4  # an option changed after prepare outdates it
    _refused(optimizer, (model,), lambda: optimizer.commit_post_sharding(staged), StaleTransactionError, ".")
    fresh = optimizer.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
    optimizer.commit_post_sharding(fresh)
    _refused(optimizer, (model,), lambda: optimizer.commit_post_sharding(fresh), StaleTransactionError, "consumed")


@pytest.mark.parametrize("where", ["plan", "record", "layout_check"])
def test_rebinding_stays_atomic_under_injected_faults(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, plan = _fresh()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected fault in {where}")

    if where == "layout_check":
        calls = {"n": 0}
        check = optimizer._binding.check_layout

        def late(shard: Any, target: Any) -> None:
            calls["n"] += 1
            if calls["n"] == len(plan.rebindings):  # the last slot: every other one passed
                boom()
            check(shard, target)

        monkeypatch.setattr(optimizer._identity_binding, "_check_layout", late)
    elif where == "plan":
        monkeypatch.setattr(binding_module, "plan_rebinding", boom)
    else:  # the record derived from the seal while staging
        monkeypatch.setattr(optimizer._identity_binding, "_derive", boom)
    _refused(
        optimizer,
        (model, plan.targets),
        lambda: optimizer.post_sharding(plan.rebindings, manifest=plan.manifest),
        RuntimeError,
        "injected",
    )
    monkeypatch.undo()
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)  # the retry succeeds ...
    install_parameters(model, {id(p): plan.targets[n] for n, p in model.named_parameters()})
    control_model, control = _bound()
    _train(model, optimizer, 2)
    _train(control_model, control, 2)
    assert _equal(model, control_model)  # ... and trains exactly like a control that never failed


def test_the_sealed_layout_refuses_new_groups_and_a_second_binding() -> None:
    model, optimizer = _bound()
    _refused(
        optimizer,
        (model,),
        lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]}),
        RuntimeError,
        "sealed",
    )
    again = replicated_copy_plan(list(model.named_parameters()))
    _refused(
        optimizer,
        (model,),
        lambda: optimizer.post_sharding(again.rebindings, manifest=again.manifest),
        RuntimeError,
        "already finalized",
    )


TAMPERING: dict[str, Callable[[Any], object]] = {
    "replaced": lambda o: o.param_groups[0]["params"].__setitem__(0, nn.Parameter(torch.zeros(16, 8))),
    "reordered": lambda o: o.param_groups[1]["params"].reverse(),
    "appended": lambda o: o.param_groups[1]["params"].append(nn.Parameter(torch.zeros(2, 2))),
    "renamed": lambda o: o.param_groups[0]["param_names"].__setitem__(0, "other"),
    "group_removed": lambda o: o.param_groups.pop(),
    "foreign_state": lambda o: o.state.__setitem__(nn.Parameter(torch.zeros(1)), {}),
}


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("tamper", sorted(TAMPERING))
def test_tampering_is_caught_before_any_mutation_by_every_entry_point(kind: str, tamper: str) -> None:
    model, optimizer = _bound(kind)
    _train(model, optimizer, 1)
    optimizer.zero_grad()
    _loss(model, 1).backward()
    TAMPERING[tamper](optimizer)
    for action in (
        optimizer.step,
        optimizer.preflight_step,
        optimizer.state_dict,
        optimizer.shard_bindings,
        optimizer.sharding_manifest,
        optimizer.export_local_state,
        optimizer.refresh_collective_state,
        optimizer.initialize_collective_state,
        lambda: optimizer.load_state_dict({"state": {}, "param_groups": []}),
        optimizer.portable_export,
        lambda: optimizer.portable_prepare_import(implementation="", policy={}, common={}, slots=()),
    ):
        _refused(optimizer, (model,), action, LayoutTamperedError, "changed outside post_sharding")
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_CANONICAL_IDENTITY)
    assert not status.supported and "changed outside post_sharding" in status.reasons[0]


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_closure_that_tampers_is_caught_after_it_and_before_any_mutation(kind: str) -> None:
    model, optimizer = _bound(kind)
    _train(model, optimizer, 1)
    seen: dict[str, Any] = {}

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _loss(model, 2)
        loss.backward()
        optimizer.param_groups[1]["params"].reverse()
        seen["snapshot"] = deep_snapshot(optimizer, model)
        return loss

    with pytest.raises(LayoutTamperedError, match="step"):
        optimizer.step(closure)
    assert snapshot_diff(seen["snapshot"], optimizer, model) == []


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_the_contract_is_dynamic_and_every_negative_says_why(kind: str) -> None:
    _model, optimizer, plan = _fresh(kind)
    features = optimizer.optimizer_contract().capabilities.features
    assert features[FEATURE_POST_SHARDING].supported and features[FEATURE_COLLECTIVE_SCOPE].supported
    identity = features[FEATURE_CANONICAL_IDENTITY]
    assert not identity.supported and "post_sharding" in identity.reasons[0]
    transports = {e.transport for e in optimizer.optimizer_contract().capabilities.checkpoints}
    assert CheckpointTransport.CANONICAL_LOCAL not in transports
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    capabilities = optimizer.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_CANONICAL_IDENTITY) and capabilities.supports(FEATURE_CANONICAL_LOCAL_STATE)
    canonical = capabilities.checkpoint_support(CheckpointTransport.CANONICAL_LOCAL, REPL)
    assert canonical is not None and not canonical.requires_collective
    assert capabilities.checkpoint_support(CheckpointTransport.NATIVE_OPTIMIZER, FLAT) is None  # bound: REPL only
    optimizer.param_groups[0]["schedule"] = print  # a group option no document can hold
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_CANONICAL_LOCAL_STATE)
    assert not status.supported and "schedule" in status.reasons[0]
    assert optimizer.optimizer_contract().capabilities.supports(FEATURE_CANONICAL_IDENTITY)
    with pytest.raises(NotSupportedError, match="schedule"):
        optimizer.export_local_state()


def test_queries_of_a_finalized_optimizer() -> None:
    model, optimizer = _bound()
    bindings = optimizer.shard_bindings()
    assert [s.fqn for _, s in bindings] == sorted(n for n, _ in model.named_parameters())
    for tensor, shard in bindings:
        assert optimizer.shard_identity(tensor) == shard
    with pytest.raises(KeyError):
        optimizer.shard_identity(torch.zeros(1))
    with pytest.raises(KeyError, match="post_sharding"):
        _fresh()[1].shard_identity(torch.zeros(1))


@pytest.mark.parametrize(
    "duplicate", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"]
)
def test_a_copy_of_a_finalized_optimizer_stays_sealed(duplicate: Any) -> None:
    model, optimizer = _bound()
    _train(model, optimizer, 2)
    twin_model, twin = duplicate((model, optimizer))
    assert twin.sharding_manifest() == optimizer.sharding_manifest()
    bound = {id(t) for t, _ in twin.shard_bindings()}
    assert bound == {id(p) for group in twin.param_groups for p in group["params"]}
    assert bound.isdisjoint(id(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match="sealed"):
        twin.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
    _train(model, optimizer, 2, start=2)
    _train(twin_model, twin, 2, start=2)
    assert _equal(model, twin_model)

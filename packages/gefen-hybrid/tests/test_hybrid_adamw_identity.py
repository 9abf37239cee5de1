"""ContractedAdamW post_sharding: bit-identical training after rebinding (replicated and
flattened), refusals without mutation, atomicity under injected faults, the sealed layout
and its guard, the dynamic contract, and copies of a finalized optimizer."""

from __future__ import annotations

import copy
import pickle
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
)
from gefen_contracts.enums import CheckpointTransport, ParameterLayout, PlacementKind
from gefen_contracts.identity import LogicalSlice, ParameterIdentity, ShardIdentity, ShardPlacement
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.testing import (
    FLAT_GROUP,
    deep_snapshot,
    flattened_plan,
    install_parameters,
    replicated_copy_plan,
    snapshot_diff,
)
from gefen_contracts.torch_support import CodebookProcessGroupBinding
from gefen_contracts.torch_support import identity_binding as binding_module
from gefen_hybrid import ContractedAdamW
from hybrid_toys import single_threaded_torch  # noqa: F401 (autouse fixture)
from torch import nn

REPL, FLAT = ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.Encoder = nn.Linear(5, 4)  # a capitalised name: compatibility names keep their case
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.Encoder(x)))  # type: ignore[no-any-return]


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _groups(named: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    first = [(n, p) for n, p in named if n.startswith("Encoder")]
    second = [(n, p) for n, p in named if not n.startswith("Encoder")]
    return [{"params": first}, {"params": second, "lr": 3e-3, "weight_decay": 0.0}]


def _adamw(model: nn.Module, **kwargs: Any) -> ContractedAdamW:
    return ContractedAdamW(_groups(list(model.named_parameters())), lr=1e-2, **kwargs)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    return model(torch.randn(6, 5, generator=generator)).pow(2).mean()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        optimizer.step()


def _bound(seed: int = 0, **kwargs: Any) -> tuple[nn.Module, ContractedAdamW]:
    model = _net(seed)
    optimizer = _adamw(model, **kwargs)
    named = list(model.named_parameters())
    plan = replicated_copy_plan(named)
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    install_parameters(model, {id(p): plan.targets[n] for n, p in named})
    return model, optimizer


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True, "amsgrad": True}], ids=["loop", "foreach"])
def test_replicated_rebinding_trains_like_torch_adamw_built_on_the_copies(flags: dict[str, Any]) -> None:
    model, optimizer = _bound(**flags)
    twin = _net()
    named = list(twin.named_parameters())
    copies = replicated_copy_plan(named)
    install_parameters(twin, {id(p): copies.targets[n] for n, p in named})
    reference = torch.optim.AdamW(_groups(list(twin.named_parameters())), lr=1e-2, **flags)
    _train(model, optimizer, 4)
    _train(twin, reference, 4)
    assert _equal(model, twin)
    assert [g["param_names"] for g in optimizer.param_groups] == [
        ["Encoder.weight", "Encoder.bias"],
        ["head.weight", "head.bias"],
    ]


class _FlatMembers:
    """Both members of a two-member flattened layout, each a rebound ContractedAdamW."""

    def __init__(self, values: nn.Module, **flags: Any) -> None:
        self.plans, self.optimizers = [], []
        for member in range(2):
            model = _net()
            named = list(model.named_parameters())
            plan = flattened_plan(named, member, whole_to_first=["head.bias"], values=dict(values.named_parameters()))
            optimizer = ContractedAdamW(named, lr=1e-2, **flags)
            optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
            self.plans.append(plan)
            self.optimizers.append(optimizer)

    def step_with(self, full: nn.Module) -> None:
        for plan, optimizer in zip(self.plans, self.optimizers):
            for name, parameter in full.named_parameters():
                shard = plan.rebindings[[r.shard.fqn for r in plan.rebindings].index(name)].shard
                assert type(shard.extent) is LogicalSlice
                start, length = shard.extent.flat_offset, shard.extent.length
                assert parameter.grad is not None
                plan.targets[name].grad = parameter.grad.reshape(-1)[start : start + length].clone()
            optimizer.step()

    def assert_slices_of(self, full: nn.Module) -> None:
        for name, parameter in full.named_parameters():
            gathered = torch.cat([plan.targets[name].detach() for plan in self.plans])
            assert torch.equal(gathered, parameter.detach().reshape(-1)), name


@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": True, "amsgrad": True}], ids=["loop", "foreach"])
def test_flattened_members_train_exactly_like_the_full_tensors(flags: dict[str, Any]) -> None:
    full = _net()
    reference = ContractedAdamW(full.named_parameters(), lr=1e-2, **flags)
    members = _FlatMembers(full, **flags)
    assert members.plans[1].targets["head.bias"].numel() == 0  # member 1 holds an empty shard
    for step in range(4):
        reference.zero_grad(set_to_none=True)
        _loss(full, step).backward()
        members.step_with(full)
        reference.step()
        members.assert_slices_of(full)
    contract = members.optimizers[1].optimizer_contract()
    native = contract.capabilities.checkpoint_support(CheckpointTransport.NATIVE_OPTIMIZER, FLAT)
    canonical = contract.capabilities.checkpoint_support(CheckpointTransport.CANONICAL_LOCAL, FLAT)
    assert native is not None and canonical is not None and canonical.same_topology == {FLAT}


def _snapshot_refusal(
    optimizer: Any, roots: tuple[Any, ...], action: Any, error: type[BaseException], match: str
) -> None:
    before = deep_snapshot(optimizer, *roots)
    with pytest.raises(error, match=match):
        action()
    assert snapshot_diff(before, optimizer, *roots) == []


def _fresh() -> tuple[nn.Module, ContractedAdamW, Any]:
    model = _net()
    return model, _adamw(model), replicated_copy_plan(list(model.named_parameters()))


def _owner_shard(name: str, shape: tuple[int, ...]) -> ShardIdentity:
    identity = ParameterIdentity(name, shape)
    group = FLAT_GROUP
    return ShardIdentity(
        identity,
        ParameterLayout.WHOLE_PARAMETER_OWNER,
        LogicalSlice.full(identity),
        (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, 0, 2),),
        group,
        "member:0",
        owner="member:0",
    )


def test_invalid_requests_are_refused_without_mutation() -> None:
    model, optimizer, plan = _fresh()
    rebindings = list(plan.rebindings)
    duplicate = [
        *rebindings[:-1],
        ParameterRebinding(rebindings[-1].old_parameter, rebindings[1].new_parameter, rebindings[-1].shard),
    ]
    expanded = [
        *rebindings[:-1],
        ParameterRebinding(rebindings[-1].old_parameter, torch.zeros(1).expand(4), rebindings[-1].shard),
    ]
    wrong_shape = [
        *rebindings[:-1],
        ParameterRebinding(rebindings[-1].old_parameter, torch.zeros(5), rebindings[-1].shard),
    ]
    other = ShardingManifest(
        (*plan.manifest.shards[:-1], ShardIdentity(ParameterIdentity("head.other", (4,)), REPL, LogicalSlice(0, 4)))
    )
    cases = [
        (lambda: optimizer.post_sharding(duplicate, manifest=plan.manifest), ContractError, "share a target"),
        (lambda: optimizer.post_sharding(rebindings[:-1], manifest=plan.manifest), ContractError, "missing"),
        (lambda: optimizer.post_sharding(expanded, manifest=plan.manifest), ContractError, "overlaps itself"),
        (lambda: optimizer.post_sharding(wrong_shape, manifest=plan.manifest), ContractError, "global shape"),
        (lambda: optimizer.post_sharding(rebindings, manifest=other), ContractError, "manifest"),
        (
            lambda: optimizer.post_sharding(rebindings, manifest=plan.manifest, scope=_scope()),
            NotSupportedError,
            "collectively",
        ),
    ]
    for action, error, match in cases:
        _snapshot_refusal(optimizer, (model, plan.targets), action, error, match)
    owner = _owner_shard("Encoder.weight", (4, 5))
    kept = tuple(s for s in plan.manifest.shards if s.fqn != "Encoder.weight")
    owner_manifest = ShardingManifest((*kept, owner, _owner_member(owner)))
    whole = [ParameterRebinding(rebindings[0].old_parameter, rebindings[0].new_parameter, owner), *rebindings[1:]]
    _snapshot_refusal(
        optimizer, (model,), lambda: optimizer.post_sharding(whole, manifest=owner_manifest), ContractError, "binds"
    )
    assert optimizer.sharding_manifest() is None


def _owner_member(owner: ShardIdentity) -> ShardIdentity:
    return ShardIdentity(
        owner.parameter,
        owner.layout,
        LogicalSlice(0, 0),
        (ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, 1, 2),),
        owner.process_group,
        "member:1",
        owner="member:0",
    )


def _scope() -> CodebookProcessGroupBinding:
    from gefen_contracts.identity import ProcessGroupIdentity

    return CodebookProcessGroupBinding(ProcessGroupIdentity("solo", ("rank:0",)), "rank:0", None, "cpu")


def test_a_stepped_optimizer_is_not_pristine_and_says_so() -> None:
    model, optimizer, _ = _fresh()
    _train(model, optimizer, 1)
    optimizer.zero_grad(set_to_none=True)
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_POST_SHARDING)
    assert not status.supported and "pristine" in status.reasons[0]
    plan = replicated_copy_plan(list(model.named_parameters()))
    _snapshot_refusal(
        optimizer,
        (model,),
        lambda: optimizer.post_sharding(plan.rebindings, manifest=plan.manifest),
        NotSupportedError,
        "pristine",
    )


def test_prepare_mutates_nothing_and_commit_is_single_use_owned_and_fresh() -> None:
    model, optimizer, plan = _fresh()
    before = deep_snapshot(optimizer, model)
    staged = optimizer.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
    assert snapshot_diff(before, optimizer, model) == []
    other_model, other, _ = _fresh()
    _snapshot_refusal(
        other, (other_model,), lambda: other.commit_post_sharding(staged), StaleTransactionError, "another optimizer"
    )
    next(iter(model.parameters())).detach().mul_(2)  # an in-place write after prepare outdates it
    _snapshot_refusal(
        optimizer, (model,), lambda: optimizer.commit_post_sharding(staged), StaleTransactionError, "changed"
    )
    fresh = optimizer.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
    optimizer.commit_post_sharding(fresh)
    _snapshot_refusal(
        optimizer, (model,), lambda: optimizer.commit_post_sharding(fresh), StaleTransactionError, "consumed"
    )


@pytest.mark.parametrize("where", ["plan", "stage", "layout_check"])
def test_rebinding_stays_atomic_under_injected_faults(where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, plan = _fresh()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected fault in {where}")

    calls = {"n": 0}

    def late_layout_fault(shard: Any, target: Any) -> None:
        calls["n"] += 1
        if calls["n"] == len(plan.rebindings):  # the last slot: everything before it passed
            boom()

    if where == "layout_check":
        monkeypatch.setattr(optimizer._identity_binding, "_check_layout", late_layout_fault)
    else:
        monkeypatch.setattr(binding_module, {"plan": "plan_rebinding", "stage": "staged_groups"}[where], boom)
    _snapshot_refusal(
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
    _train(model, optimizer, 3)
    _train(control_model, control, 3)
    assert _equal(model, control_model)  # ... and trains exactly like a control that never failed


def test_the_sealed_layout_refuses_new_groups_and_a_second_binding() -> None:
    model, optimizer = _bound()
    _snapshot_refusal(
        optimizer,
        (model,),
        lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}),
        RuntimeError,
        "sealed",
    )
    again = replicated_copy_plan(list(model.named_parameters()))
    _snapshot_refusal(
        optimizer,
        (model,),
        lambda: optimizer.post_sharding(again.rebindings, manifest=again.manifest),
        RuntimeError,
        "already finalized",
    )


TAMPERING = {
    "replaced": lambda o: o.param_groups[0]["params"].__setitem__(0, nn.Parameter(torch.zeros(4, 5))),
    "reordered": lambda o: o.param_groups[1]["params"].reverse(),
    "appended": lambda o: o.param_groups[1]["params"].append(nn.Parameter(torch.zeros(2))),
    "renamed": lambda o: o.param_groups[0]["param_names"].__setitem__(0, "other"),
    "group_removed": lambda o: o.param_groups.pop(),
    "foreign_state": lambda o: o.state.__setitem__(nn.Parameter(torch.zeros(1)), {}),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERING))
def test_tampering_is_caught_before_any_mutation_by_every_entry_point(tamper: str) -> None:
    model, optimizer = _bound()
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
        lambda: optimizer.load_state_dict({"state": {}, "param_groups": []}),
    ):
        _snapshot_refusal(optimizer, (model,), action, LayoutTamperedError, "changed outside post_sharding")
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_CANONICAL_IDENTITY)
    assert not status.supported and "changed outside post_sharding" in status.reasons[0]


def test_a_closure_that_tampers_is_caught_after_it_and_before_any_mutation() -> None:
    model, optimizer = _bound()
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


def test_the_contract_is_dynamic_and_every_negative_says_why() -> None:
    _model, optimizer, plan = _fresh()
    features = optimizer.optimizer_contract().capabilities.features
    assert features[FEATURE_POST_SHARDING].supported
    assert (
        not features[FEATURE_CANONICAL_IDENTITY].supported
        and "post_sharding" in features[FEATURE_CANONICAL_IDENTITY].reasons[0]
    )
    transports = {e.transport for e in optimizer.optimizer_contract().capabilities.checkpoints}
    assert CheckpointTransport.CANONICAL_LOCAL not in transports
    optimizer.post_sharding(plan.rebindings, manifest=plan.manifest)
    capabilities = optimizer.optimizer_contract().capabilities
    assert capabilities.supports(FEATURE_POST_SHARDING)  # still: the optimizer is bound
    assert capabilities.supports(FEATURE_CANONICAL_IDENTITY) and capabilities.supports(FEATURE_CANONICAL_LOCAL_STATE)
    canonical = capabilities.checkpoint_support(CheckpointTransport.CANONICAL_LOCAL, REPL)
    assert canonical is not None and canonical.same_topology == {REPL} and not canonical.requires_collective
    assert capabilities.checkpoint_support(CheckpointTransport.NATIVE_OPTIMIZER, FLAT) is None  # no flat binding here
    optimizer.param_groups[0]["schedule"] = print  # a group option no document can hold
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_CANONICAL_LOCAL_STATE)
    assert not status.supported and "'schedule' holds a builtin_function_or_method" in status.reasons[0]
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
        _adamw(_net()).shard_identity(torch.zeros(1))
    sealed = optimizer._identity_binding.sealed
    assert sealed is not None
    assert sealed.compatibility_names(0) == ("Encoder.weight", "Encoder.bias")


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
        twin.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    _train(model, optimizer, 2, start=2)
    _train(twin_model, twin, 2, start=2)
    assert _equal(model, twin_model)


def test_a_pickle_written_before_the_record_carried_a_scope_still_loads_sealed() -> None:
    # ContractedAdamW pickled its seal as (manifest, slots) before IdentityBinding added the scope
    model, optimizer = _bound()
    state = optimizer.__getstate__()
    state["_identity_record"] = state["_identity_record"][:2]
    older = pickle.loads(pickle.dumps((model, state)))
    twin = ContractedAdamW.__new__(ContractedAdamW)
    twin.__setstate__(older[1])
    assert twin.sharding_manifest() == optimizer.sharding_manifest()
    assert [shard for _, shard in twin.shard_bindings()] == [shard for _, shard in optimizer.shard_bindings()]


def test_a_loaded_checkpoint_without_state_for_some_parameters_still_steps() -> None:
    model, optimizer = _bound()
    optimizer.zero_grad()
    _loss(model, 0).backward()
    model.head.bias.grad = None  # this parameter takes no step, so it gets no state
    optimizer.step()
    saved = optimizer.state_dict()
    twin_model, twin = _bound(1)
    twin_model.load_state_dict(model.state_dict())
    twin.load_state_dict(saved)
    _train(model, optimizer, 2, start=1)
    _train(twin_model, twin, 2, start=1)  # torch-style lazy state creation still works after a load
    assert _equal(model, twin_model)


def test_a_non_finite_option_keeps_adamw_out_of_canonical_documents() -> None:
    """The one option-record rule set (``gefen_contracts.torch_support.option_records``): a
    non-finite float option is refused by canonical documents as by portable state (the
    canonical check of ContractedAdamW's own copy let it through)."""
    _, optimizer = _bound()
    assert optimizer.optimizer_contract().capabilities.supports(FEATURE_CANONICAL_LOCAL_STATE)
    optimizer.param_groups[0]["eps_floor"] = float("inf")
    status = optimizer.optimizer_contract().capabilities.feature(FEATURE_CANONICAL_LOCAL_STATE)
    assert not status.supported
    assert "param_groups[0] option 'eps_floor' holds a non-finite float" in status.reasons[0]
    with pytest.raises(NotSupportedError, match="eps_floor"):
        optimizer.export_local_state()

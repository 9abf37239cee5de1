"""Portable state of a ``post_sharding``-bound Gefen and GefenMuon in one process.

The transports read the sealed layout: a bound replicated and a bound one-member flattened
Gefen (and a bound replicated and a one-member whole-owner GefenMuon) export their own shards, and a twin bound the same
way imports them and continues bit-exactly. The contract then declares ``PORTABLE_SUPPORT``
(``MUON_PORTABLE_SUPPORT``), parameter-shaped state is refused for flattened and owner layouts with its reason, and
corrupted records are refused with nothing changed. The multi-member cases (gloo) are in the
repository's ``tests/test_bound_resharding.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from gefen_contracts import FEATURE_PARAMETER_SHAPED_STATE, FEATURE_PORTABLE_STATE, StateValidationError
from gefen_contracts.enums import CheckpointTransport, ParameterLayout, PlacementKind
from gefen_contracts.exchange import PortableExport
from gefen_contracts.identity import (
    LogicalSlice,
    ParameterIdentity,
    ProcessGroupIdentity,
    ShardIdentity,
    ShardPlacement,
)
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.testing import (
    ShardingPlan,
    deep_snapshot,
    flattened_plan,
    gather_flat,
    replicated_copy_plan,
    snapshot_diff,
)
from gefen_contracts.torch_support import CodebookProcessGroupBinding
from gefen_core import Gefen, GefenMuon
from gefen_core.contract import PORTABLE_SUPPORT
from gefen_core.muon_contract import MUON_PORTABLE_SUPPORT
from gefen_core_test_support import imported_slots

SOLO = ProcessGroupIdentity("tests.solo", ("member:0",))
STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def single_threaded_torch() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class Net(torch.nn.Module):
    """An embedding, a matrix with a bias and a head: 1-D and 2-D parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(16, 8) * 0.5)
        self.hidden = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(24, 8, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed[tokens])))  # type: ignore[no-any-return]


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _backward(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, 16, (6, 4), generator=generator)
    target = torch.randn(6, 4, 8, generator=generator)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(tokens), target).backward()  # type: ignore[no-untyped-call]


def _matrices(named: list[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in named if p.dim() == 2]


def _owner_plan(named: list[tuple[str, torch.nn.Parameter]]) -> ShardingPlan:
    """Every matrix owned by the one member of :data:`SOLO` (a whole-parameter-owner layout)."""
    rebindings, shards, targets = [], [], {}
    for name, parameter in named:
        identity = ParameterIdentity(name, tuple(parameter.shape))
        placement = ShardPlacement("dp", PlacementKind.WHOLE_PARAMETER_OWNER, 0, 1)
        shard = ShardIdentity(
            identity,
            ParameterLayout.WHOLE_PARAMETER_OWNER,
            LogicalSlice.full(identity),
            (placement,),
            SOLO,
            "member:0",
            owner="member:0",
        )
        target = torch.nn.Parameter(parameter.detach().clone())
        rebindings.append(ParameterRebinding(parameter, target, shard))
        shards.append(shard)
        targets[name] = target
    return ShardingPlan(tuple(rebindings), ShardingManifest(tuple(shards)), targets)


def _scope(kind: str) -> CodebookProcessGroupBinding | None:
    """A one-member codebook scope for whole-parameter owners (GefenMuon steps them only under a scope)."""
    if kind != "muon_owner":
        return None
    return CodebookProcessGroupBinding(SOLO, "member:0", None, torch.device("cpu"))


#: ``kind -> (optimizer factory, plan builder)``.
KINDS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], ShardingPlan]]] = {
    "gefen_replicated": (lambda named: Gefen(named, lr=1e-2, fused=False), replicated_copy_plan),
    "gefen_flattened": (
        lambda named: Gefen(named, lr=1e-2, fused=False),
        lambda named: flattened_plan(named, 0, group=SOLO),
    ),
    "muon_replicated": (lambda named: GefenMuon(_matrices(named), lr=2e-2, fused=False), replicated_copy_plan),
    "muon_owner": (lambda named: GefenMuon(_matrices(named), lr=2e-2, fused=False), _owner_plan),
}


class Bound:
    """A full driver model and an optimizer bound to copies (or slices) of its parameters."""

    def __init__(self, kind: str, driver: torch.nn.Module) -> None:
        factory, planner = KINDS[kind]
        named = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in driver.named_parameters()]
        self.optimizer = factory(named)
        covered = {name for group in self.optimizer.param_groups for name in group["param_names"]}
        self.plan = planner([(name, p) for name, p in named if name in covered])
        self.optimizer.post_sharding(self.plan.rebindings, manifest=self.plan.manifest, scope=_scope(kind))
        self.driver = driver

    def train(self, start: int, steps: int) -> None:
        for step in range(start, start + steps):
            _backward(self.driver, step)
            self._feed()
            self.optimizer.step()
            self._publish()

    def _feed(self) -> None:
        """Give every bound tensor its piece of the driver's gradient."""
        grads = {name: p.grad for name, p in self.driver.named_parameters()}
        for rebinding in self.plan.rebindings:
            extent = rebinding.shard.extent
            assert type(extent) is LogicalSlice
            target = self.plan.targets[rebinding.shard.fqn]
            flat = grads[rebinding.shard.fqn].detach().reshape(-1)  # type: ignore[union-attr]
            target.grad = flat[extent.flat_offset : extent.flat_offset + target.numel()].clone().view_as(target)

    def _publish(self) -> None:
        """Write the bound tensors back into the driver (what an adapter's gather does)."""
        with torch.no_grad():
            full = dict(self.driver.named_parameters())
            for rebinding in self.plan.rebindings:
                if rebinding.shard.layout is not ParameterLayout.FLATTENED_ELEMENT_SHARD:
                    full[rebinding.shard.fqn].copy_(self.plan.targets[rebinding.shard.fqn])
        if any(r.shard.layout is ParameterLayout.FLATTENED_ELEMENT_SHARD for r in self.plan.rebindings):
            gather_flat(self.driver, [self.plan])


def _twin(kind: str, source: Bound) -> Bound:
    driver = _net(seed=1)
    driver.load_state_dict(source.driver.state_dict())
    return Bound(kind, driver)


def _import(optimizer: Any, export: PortableExport, slots: Any = None) -> None:
    staged = optimizer.portable_prepare_import(
        implementation=export.implementation,
        policy=export.policy,
        common=export.common,
        slots=imported_slots(export.slots if slots is None else slots),
    )
    optimizer.portable_commit_import(staged)


def _same_exports(got: PortableExport, expected: PortableExport) -> bool:
    if (got.implementation, got.policy, got.manifest) != (expected.implementation, expected.policy, expected.manifest):
        return False
    for a, b in zip(got.slots, expected.slots, strict=True):
        if (a.layout, dict(a.options), a.variant, dict(a.counters)) != (
            b.layout,
            dict(b.options),
            b.variant,
            dict(b.counters),
        ):
            return False
        if a.block_period != b.block_period:
            return False
        pairs = (
            (a.element_fields, b.element_fields),
            (a.block_fields, b.block_fields),
            (a.replica_fields, b.replica_fields),
        )
        for mine, theirs in pairs:
            if mine.keys() != theirs.keys() or not all(torch.equal(mine[k], theirs[k]) for k in mine):  # type: ignore[arg-type]
                return False
    return True


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bound_optimizer_declares_portable_state_over_its_sealed_layout(kind: str) -> None:
    bound = Bound(kind, _net())
    capabilities = bound.optimizer.optimizer_contract().capabilities
    assert capabilities.features[FEATURE_PORTABLE_STATE].supported
    (entry,) = [c for c in capabilities.checkpoints if c.transport is CheckpointTransport.CANONICAL_GLOBAL]
    assert entry == (MUON_PORTABLE_SUPPORT if kind.startswith("muon") else PORTABLE_SUPPORT)
    assert bound.optimizer.portable_layout().manifest == bound.plan.manifest
    shaped = capabilities.features[FEATURE_PARAMETER_SHAPED_STATE]
    transports = {c.transport for c in capabilities.checkpoints}
    if kind == "gefen_replicated":  # whole replicated tensors: the native state is still parameter-shaped
        assert shaped.supported and CheckpointTransport.PARAMETER_SHAPED in transports
    else:  # flattened element shards, whole-matrix owners: checkpointed as portable state
        assert not shaped.supported and "portable state" in " ".join(shaped.reasons)
        assert CheckpointTransport.PARAMETER_SHAPED not in transports


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_bound_round_trip_continues_bit_exactly(kind: str) -> None:
    source = Bound(kind, _net())
    source.train(0, STEPS)
    export = source.optimizer.portable_export()
    assert {slot.layout.shard for slot in export.slots} == set(source.plan.manifest.shards)
    assert {slot.variant for slot in export.slots} != {"pristine"}
    twin = _twin(kind, source)
    _import(twin.optimizer, export)
    assert _same_exports(twin.optimizer.portable_export(), export)
    assert twin.optimizer.global_step == source.optimizer.global_step
    assert torch.equal(twin.optimizer.codebook, source.optimizer.codebook)
    source.train(STEPS, STEPS)
    twin.train(STEPS, STEPS)
    for name, tensor in source.plan.targets.items():
        assert torch.equal(twin.plan.targets[name], tensor), name


def _corruptions(export: PortableExport) -> dict[str, tuple[list[Any], str]]:
    slots = imported_slots(export.slots)
    index = next(i for i, s in enumerate(slots) if s.variant != "pristine" and s.element_fields)
    slot = slots[index]
    scale, codes = slot.element_fields["momentum_scale"], slot.element_fields["momentum_codes"]
    assert isinstance(scale, torch.Tensor) and isinstance(codes, torch.Tensor)

    def with_slot(**changes: Any) -> list[Any]:
        edited = list(slots)
        edited[index] = replace(slot, **changes)
        return edited

    global_step = export.common["global_step"]
    assert type(global_step) is int
    nan = scale.clone().reshape(-1)
    nan[0] = float("nan")
    return {
        "non-finite momentum scale": (
            with_slot(element_fields={**slot.element_fields, "momentum_scale": nan.view_as(scale)}),
            "finite",
        ),
        "wrong shape": (
            with_slot(element_fields={**slot.element_fields, "momentum_codes": codes.reshape(-1)[:-1].clone()}),
            "shape",
        ),
        "codes as float": (
            with_slot(element_fields={**slot.element_fields, "momentum_codes": codes.float()}),
            "uint8",
        ),
        "step beyond the global step": (
            with_slot(counters={**slot.counters, "step": global_step + 1}),
            "counter",
        ),
        "unknown variant": (with_slot(variant="adam"), "unknown variant"),
        "a missing slot": (slots[:-1], "slot records"),
        "slots out of place": (slots[::-1], "out of place"),
    }


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_corrupted_records_are_refused_without_mutation(kind: str) -> None:
    source = Bound(kind, _net())
    source.train(0, STEPS)
    export = source.optimizer.portable_export()
    target = _twin(kind, source)
    target.train(0, 1)
    before = deep_snapshot(target.optimizer)
    for what, (slots, match) in _corruptions(export).items():
        with pytest.raises(StateValidationError, match=match):
            target.optimizer.portable_prepare_import(
                implementation=export.implementation, policy=export.policy, common=export.common, slots=slots
            )
        assert not snapshot_diff(before, target.optimizer), what

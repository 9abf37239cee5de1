"""Identity claims as executed checks: ``post_sharding`` (bit-identical training, refusals
without mutation, prepare/commit rules, sealing), the sealed-layout guard, and flattened
element shards (training and same-topology checkpoints, two members simulated in one
process)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ...enums import CheckpointTransport, ParameterLayout
from ...errors import LayoutTamperedError, StaleTransactionError
from ...protocols import CanonicalLocalState, Composite, IdentityBindable
from ...rebinding import ParameterRebinding
from ..claims import atomic_claim, checkpoint_claim, training_claim
from ..context import CheckContext, Unverifiable
from ..corruption import corrupted_variants
from ..snapshot import deep_snapshot, snapshot_diff
from .canonical import corrupted_documents
from .plans import ShardingPlan, install_parameters, replicated_copy_plan
from .refusals import expect_refusal
from .twins import BoundTwin, FlatWorld, build_model_and_optimizer, flat_step, named_trainable

__all__ = ["FlattenedCheckpointsCheck", "FlattenedTrainingCheck", "PostShardingCheck", "SealedLayoutGuardCheck"]

POST_SHARDING = "feature:post_sharding"
CANONICAL_IDENTITY = "feature:canonical_identity"
_FLAT = ParameterLayout.FLATTENED_ELEMENT_SHARD.value


def _same_shape_pair(named: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    for i in range(len(named)):
        for j in range(i + 1, len(named)):
            if named[i][1].shape == named[j][1].shape:
                return i, j
    return 0, 1


def _with_target(plan: ShardingPlan, index: int, target: torch.Tensor) -> list[ParameterRebinding]:
    rebindings = list(plan.rebindings)
    old = rebindings[index]
    rebindings[index] = ParameterRebinding(old.old_parameter, target, old.shard)
    return rebindings


class PostShardingCheck:
    """``post_sharding`` on a pristine optimizer: identical-copy rebinding trains bit-identically
    to a twin built directly on the copies; invalid or stale requests are refused without
    mutation; prepare mutates nothing and commit is single-use; the layout is sealed."""

    name = "identity.post_sharding"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({POST_SHARDING}) & claims

    def run(self, context: CheckContext) -> None:
        problems: list[str] = []
        model, optimizer = build_model_and_optimizer(context)
        if not isinstance(optimizer, IdentityBindable):
            raise AssertionError("claims post_sharding without implementing IdentityBindable")
        named = named_trainable(model)
        plan = replicated_copy_plan(named)
        roots = (optimizer, model, plan.targets)
        before = deep_snapshot(*roots)
        staged = optimizer.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
        diffs = snapshot_diff(before, *roots)
        if diffs:
            problems.append("prepare_post_sharding changed the optimizer: " + "; ".join(diffs[:3]))
        optimizer.commit_post_sharding(staged)
        expect_refusal(
            problems,
            "committing a prepared post_sharding twice",
            roots,
            lambda: optimizer.commit_post_sharding(staged),
            StaleTransactionError,
        )
        install_parameters(model, {id(p): plan.targets[name] for name, p in named})
        self._queries(problems, optimizer, plan)
        twin_model, _ = build_model_and_optimizer(context)
        twin_named = named_trainable(twin_model)
        twin_plan = replicated_copy_plan(twin_named)
        install_parameters(twin_model, {id(p): twin_plan.targets[name] for name, p in twin_named})
        twin = context.target.factory(twin_plan.named_targets())  # type: ignore[arg-type]
        context.train(model, optimizer, context.target.steps)
        context.train(twin_model, twin, context.target.steps)
        context.assert_models_bitwise_equal(model, twin_model, "training after post_sharding vs built on the copies")
        sealed_roots = (optimizer, model)
        extra = nn.Parameter(torch.zeros(2))
        expect_refusal(
            problems,
            "add_param_group after post_sharding",
            sealed_roots,
            lambda: optimizer.add_param_group({"params": [extra]}),
            Exception,
        )
        again = replicated_copy_plan(named_trainable(model))
        expect_refusal(
            problems,
            "a second post_sharding",
            sealed_roots,
            lambda: optimizer.post_sharding(again.rebindings, manifest=again.manifest),
            Exception,
        )
        self._refusals(context, problems)
        assert not problems, "; ".join(problems)

    @staticmethod
    def _queries(problems: list[str], optimizer: Any, plan: ShardingPlan) -> None:
        if optimizer.sharding_manifest() != plan.manifest:
            problems.append("sharding_manifest() is not the manifest post_sharding was given")
        bindings = optimizer.shard_bindings()
        keys = [shard.sort_key for _, shard in bindings]
        if keys != sorted(keys):
            problems.append("shard_bindings() is not sorted by ShardIdentity.sort_key")
        if {shard for _, shard in bindings} != set(plan.manifest.shards):
            problems.append("shard_bindings() does not list every local shard of the manifest")
        for tensor, shard in bindings:
            if tensor is not plan.targets[shard.fqn]:
                problems.append(f"shard_bindings() binds {shard.fqn!r} to another tensor than its target")
        for name, target in plan.targets.items():
            if optimizer.shard_identity(target).fqn != name:
                problems.append(f"shard_identity() of the target of {name!r} names another parameter")
        try:
            optimizer.shard_identity(torch.zeros(1))
            problems.append("shard_identity() of an unbound tensor did not raise KeyError")
        except KeyError:
            pass

    @staticmethod
    def _refusals(context: CheckContext, problems: list[str]) -> None:
        def fresh() -> tuple[nn.Module, Any, ShardingPlan]:
            model, optimizer = build_model_and_optimizer(context)
            return model, optimizer, replicated_copy_plan(named_trainable(model))

        model, optimizer, plan = fresh()
        i, j = _same_shape_pair(named_trainable(model))
        duplicate = _with_target(plan, j, plan.rebindings[i].new_parameter)  # type: ignore[arg-type]
        expect_refusal(
            problems,
            "a duplicate target",
            (optimizer, model, plan.targets),
            lambda: optimizer.post_sharding(duplicate, manifest=plan.manifest),
            Exception,
        )
        missing = list(plan.rebindings[:-1])
        expect_refusal(
            problems,
            "a request missing one slot",
            (optimizer, model, plan.targets),
            lambda: optimizer.post_sharding(missing, manifest=plan.manifest),
            Exception,
        )
        first, second = plan.rebindings[0], plan.rebindings[1]
        a, b = first.old_parameter, second.old_parameter
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if a.numel() > 0 and b.numel() > 0:
            buffer = torch.zeros(a.numel() + b.numel(), dtype=a.dtype)
            shared = _with_target(plan, 0, buffer[: a.numel()].view(a.shape))
            overlapping = buffer[a.numel() - 1 : a.numel() - 1 + b.numel()].view(b.shape)
            shared[1] = ParameterRebinding(b, overlapping, second.shard)
            expect_refusal(
                problems,
                "targets overlapping in storage",
                (optimizer, model, buffer),
                lambda: optimizer.post_sharding(shared, manifest=plan.manifest),
                Exception,
            )
        big = next((k for k, r in enumerate(plan.rebindings) if r.shard.parameter.numel >= 2), None)
        if big is not None:
            shape = plan.rebindings[big].shard.parameter.global_shape
            expanded = _with_target(plan, big, torch.zeros(1).expand(shape))
            expect_refusal(
                problems,
                "a self-overlapping (expanded) target",
                (optimizer, model),
                lambda: optimizer.post_sharding(expanded, manifest=plan.manifest),
                Exception,
            )
        staged = optimizer.prepare_post_sharding(plan.rebindings, manifest=plan.manifest)
        context.train(model, optimizer, 1)
        expect_refusal(
            problems,
            "a post_sharding prepared before a step",
            (optimizer, model, plan.targets),
            lambda: optimizer.commit_post_sharding(staged),
            StaleTransactionError,
        )
        trained_model, trained_optimizer = context.trained()
        trained: Any = trained_optimizer
        trained.zero_grad(set_to_none=True)  # refused for its state, not for a leftover gradient
        late = replicated_copy_plan(named_trainable(trained_model))
        expect_refusal(
            problems,
            "post_sharding after a step (not pristine)",
            (trained, trained_model, late.targets),
            lambda: trained.post_sharding(late.rebindings, manifest=late.manifest),
            Exception,
        )


def _tamper_first_slot(optimizer: Any) -> nn.Parameter:
    group = optimizer.param_groups[0]
    old = group["params"][0]
    new = nn.Parameter(old.detach().clone())
    new.grad = torch.ones_like(new)
    group["params"][0] = new
    return new


class SealedLayoutGuardCheck:
    """After ``post_sharding``, replacing a slot of ``param_groups[0]["params"]`` between steps,
    or inside the closure, makes ``step()`` raise ``LayoutTamperedError`` before any mutation."""

    name = "identity.sealed_layout_guard"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({POST_SHARDING, CANONICAL_IDENTITY}) & claims

    def run(self, context: CheckContext) -> None:
        problems: list[str] = []
        twin = BoundTwin.replicated(context)
        context.train(twin.model, twin.optimizer, 1)
        twin.optimizer.zero_grad(set_to_none=True)
        context.target.loss_fn(twin.model, 1).backward()  # type: ignore[no-untyped-call]
        swapped = _tamper_first_slot(twin.optimizer)
        expect_refusal(
            problems,
            "step() after param_groups[0]['params'][0] was replaced",
            (twin.optimizer, twin.model, swapped),
            twin.optimizer.step,
            LayoutTamperedError,
        )

        inside = BoundTwin.replicated(context)
        context.train(inside.model, inside.optimizer, 1)
        recorded: dict[str, Any] = {}

        def closure() -> torch.Tensor:
            inside.optimizer.zero_grad(set_to_none=True)
            loss = context.target.loss_fn(inside.model, 2)
            loss.backward()  # type: ignore[no-untyped-call]
            recorded["new"] = _tamper_first_slot(inside.optimizer)
            recorded["snapshot"] = deep_snapshot(inside.optimizer, inside.model, recorded["new"])
            return loss.detach()

        try:
            inside.optimizer.step(closure)
            problems.append("step(closure) whose closure replaced a slot was accepted")
        except LayoutTamperedError:
            if "snapshot" not in recorded:
                problems.append("step(closure) raised before running the closure")
            else:
                diffs = snapshot_diff(recorded["snapshot"], inside.optimizer, inside.model, recorded["new"])
                if diffs:
                    problems.append(
                        "a closure that replaced a slot was caught only after mutation: " + "; ".join(diffs[:3])
                    )
        except Exception as exc:
            problems.append(
                f"step(closure) with a tampering closure raised {type(exc).__name__} ({exc}), expected LayoutTamperedError"
            )
        assert not problems, "; ".join(problems)


def _member_queries(problems: list[str], member: int, optimizer: Any, plan: ShardingPlan) -> None:
    """On each member of a flattened layout the identity queries name that member's own shards
    (the lie it catches: every member bound to the offset-0 shard)."""
    own = {r.shard for r in plan.rebindings}
    listed = {shard for _, shard in optimizer.shard_bindings()}
    if listed != own:
        problems.append(f"member {member}: shard_bindings() does not list exactly this member's shards")
    for rebinding in plan.rebindings:
        shard = rebinding.shard
        found = optimizer.shard_identity(rebinding.new_parameter)
        if found != shard:
            problems.append(
                f"member {member}: shard_identity() of its {shard.fqn!r} shard names {found.logical_slice} on "
                f"{found.local_member!r}, not {shard.logical_slice} on {shard.local_member!r}"
            )


def _flat_claims(claims: frozenset[str], transport: str) -> frozenset[str]:
    wanted = {checkpoint_claim(transport, _FLAT), atomic_claim(transport, _FLAT)}
    return frozenset(wanted) & claims


class FlattenedTrainingCheck:
    """Flattened element shards train bit-identically to an optimizer built directly on the
    shards (the ``IdentityBindable`` promise), for two members simulated in one process, one
    of which holds an empty shard."""

    name = "identity.flattened_training"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        prefix = training_claim(_FLAT)
        return frozenset(c for c in claims if c == prefix or c.startswith(prefix + "["))

    def run(self, context: CheckContext) -> None:
        if POST_SHARDING not in context.claims:
            raise Unverifiable("flattened training is bound by post_sharding, which this optimizer does not claim")
        bound = FlatWorld(context, bound=True)
        direct = FlatWorld(context, bound=False)
        for rebound, built in zip(bound.optimizers, direct.optimizers):
            if isinstance(rebound, Composite) and rebound.parameter_routing() != built.parameter_routing():
                raise Unverifiable(
                    "the composite's factory routes the 1-D shards differently than the logical parameters, so no "
                    "twin can be built directly on the shards; verify flattened training in the composite's own tests"
                )
        problems: list[str] = []
        for member, (optimizer, plan) in enumerate(zip(bound.optimizers, bound.plans)):
            _member_queries(problems, member, optimizer, plan)
        assert not problems, "; ".join(problems)
        driver = context.target.model_builder(0)
        for step in range(context.target.steps):
            flat_step(driver, step, bound, (bound, direct))
            bound.compare(direct, f"step {step}: rebound flattened shards vs an optimizer built on the shards")


class FlattenedCheckpointsCheck:
    """Same-topology checkpoints of flattened shards: native and canonical-local round trips into
    fresh rebound twins (reordered for canonical) continue bit-exactly; claimed atomic loads
    refuse corrupted payloads (and another member's document) without mutation."""

    name = "identity.flattened_checkpoints"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return (
            _flat_claims(claims, CheckpointTransport.NATIVE_OPTIMIZER.value)
            | _flat_claims(claims, CheckpointTransport.COMPOSITE_NATIVE.value)
            | _flat_claims(claims, CheckpointTransport.CANONICAL_LOCAL.value)
        )

    def run(self, context: CheckContext) -> None:
        claims = self.covers(context.claims)
        native_atomic = {
            atomic_claim(t.value, _FLAT)
            for t in (CheckpointTransport.NATIVE_OPTIMIZER, CheckpointTransport.COMPOSITE_NATIVE)
        }
        native = bool(
            _flat_claims(claims, CheckpointTransport.NATIVE_OPTIMIZER.value)
            | _flat_claims(claims, CheckpointTransport.COMPOSITE_NATIVE.value)
        )
        canonical = bool(_flat_claims(claims, CheckpointTransport.CANONICAL_LOCAL.value))
        steps = context.target.steps
        driver = context.target.model_builder(0)
        world = FlatWorld(context)
        for step in range(steps):
            flat_step(driver, step, world, (world,))
        step = steps
        problems: list[str] = []
        if native:
            values = world.values(driver)
            saved = [context.weights_only_roundtrip(o.state_dict()) for o in world.optimizers]
            restored = FlatWorld(context, values=values)
            for optimizer, state in zip(restored.optimizers, saved):
                optimizer.load_state_dict(state)
            step = self._continue(context, driver, world, restored, "native", step)
            if native_atomic & claims:
                self._cross_member(context, problems, "native")
                target = FlatWorld(context, values=values)
                for name, corrupted in corrupted_variants(saved[0]):
                    expect_refusal(
                        problems,
                        f"a corrupted flattened native checkpoint ({name})",
                        (target.optimizers[0], target.plans[0].targets),
                        partial(target.optimizers[0].load_state_dict, corrupted),
                        Exception,
                    )
        if canonical:
            if not all(isinstance(o, CanonicalLocalState) for o in world.optimizers):
                raise AssertionError("claims canonical_local without CanonicalLocalState")
            values = world.values(driver)
            documents = [context.weights_only_roundtrip(o.export_local_state()) for o in world.optimizers]
            restored = FlatWorld(context, reverse=True, values=values)
            for optimizer, document in zip(restored.optimizers, documents):
                optimizer.commit_local_import(optimizer.prepare_local_import(document))
            step = self._continue(context, driver, world, restored, "canonical local", step)
            if atomic_claim(CheckpointTransport.CANONICAL_LOCAL.value, _FLAT) in claims:
                self._cross_member(context, problems, "canonical local")
                target = FlatWorld(context, values=values)
                member = target.optimizers[1]
                roots = (member, target.plans[1].targets)
                for name, corrupted in corrupted_documents(documents[1]):
                    expect_refusal(
                        problems,
                        f"a corrupted flattened document ({name})",
                        roots,
                        partial(member.prepare_local_import, corrupted),
                        Exception,
                    )
        assert not problems, "; ".join(problems)

    @staticmethod
    def _cross_member(context: CheckContext, problems: list[str], what: str) -> None:
        """Member 0's checkpoint given to member 1, with shards of equal size on both (so only
        identity can refuse it): a load that checks shapes alone must fail here (with an empty last
        shard on member 1, any shape check refused and proved nothing)."""
        driver = context.target.model_builder(0)
        source = FlatWorld(context, whole_last=False)
        for step in range(context.target.steps):
            flat_step(driver, step, source, (source,))
        target = FlatWorld(context, values=source.values(driver), whole_last=False)
        member = target.optimizers[1]
        sizes = [[t.numel() for t in plan.targets.values()] for plan in source.plans]
        if sizes[0] != sizes[1]:  # a parameter with an odd element count: no equal cut exists
            context.notes.append(f"{what}: cross-member refusal not checked (the model has no equal two-way cut)")
            return
        if what == "native":
            saved = context.weights_only_roundtrip(source.optimizers[0].state_dict())
            attempt: Any = partial(member.load_state_dict, saved)
        else:
            document = context.weights_only_roundtrip(source.optimizers[0].export_local_state())
            attempt = partial(member.prepare_local_import, document)
        expect_refusal(
            problems,
            f"member 0's {what} checkpoint given to member 1 (shards of equal size)",
            (member, target.plans[1].targets),
            attempt,
            Exception,
        )

    @staticmethod
    def _continue(
        context: CheckContext, driver: nn.Module, world: FlatWorld, restored: FlatWorld, what: str, start: int
    ) -> int:
        """Step both worlds with ``world``'s gradients from step ``start``; ``restored`` must follow
        bit-exactly. Returns the next step index."""
        steps = context.target.steps
        for step in range(start, start + steps):
            flat_step(driver, step, world, (world, restored))
            world.compare(restored, f"continuation after a flattened {what} round trip, step {step}")
        return start + steps

"""Composite rules: roles, routing and checkpoint claims bounded by the children."""

from __future__ import annotations

from ...enums import CheckpointTransport
from ...protocols import Composite
from ..context import CheckContext

__all__ = ["CompositeRulesCheck"]


class CompositeRulesCheck:
    name = "composite.rules"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({"feature:composite"}) & claims

    def run(self, context: CheckContext) -> None:
        model, optimizer = context.trained()
        assert isinstance(optimizer, Composite), "claims composite without Composite"
        contract = optimizer.optimizer_contract()  # type: ignore[attr-defined]
        children = optimizer.child_optimizers()
        roles = tuple(children)
        assert roles == tuple(c.role for c in contract.children), (
            f"child_optimizers() roles {roles} differ from the contract's children"
        )
        assert roles == contract.state_layout.composite_namespaces, "namespaces must equal the present child roles"
        routing = optimizer.parameter_routing()
        assert list(routing) == sorted(routing), "parameter_routing() must be sorted"
        fqns = [fqn for fqn, _ in routing]
        assert fqns == sorted({n for n, p in model.named_parameters() if p.requires_grad}), (
            "parameter_routing() must cover every trainable parameter exactly once"
        )
        assert {role for _, role in routing} <= set(roles), "routing names an unknown role"
        for entry in contract.capabilities.checkpoints:
            for child in contract.children:
                if child.contract is None:
                    raise AssertionError(
                        f"the composite claims {entry.transport.value} although child {child.role!r} publishes no contract"
                    )
                wanted = (
                    CheckpointTransport.NATIVE_OPTIMIZER
                    if entry.transport is CheckpointTransport.COMPOSITE_NATIVE
                    else entry.transport
                )
                child_layouts = {
                    layout
                    for e in child.contract.capabilities.checkpoints
                    if e.transport is wanted
                    for layout in e.same_topology
                }
                extra = entry.same_topology - child_layouts
                assert not extra, (
                    f"the composite claims {entry.transport.value} for {sorted(x.value for x in extra)} which child "
                    f"{child.role!r} does not claim"
                )
                if entry.atomic_load:
                    atomic = all(
                        e.atomic_load for e in child.contract.capabilities.checkpoints if e.transport is wanted
                    )
                    assert atomic, (
                        f"the composite claims an atomic {entry.transport.value} load but {child.role!r} does not"
                    )

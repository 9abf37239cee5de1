"""Checks of the contract object itself: valid, immutable, deterministic, pure, silent."""

from __future__ import annotations

import dataclasses

import torch

from ...capabilities import FEATURE_PORTABLE_STATE
from ...codec import from_primitive, to_primitive
from ...contract import OptimizerContract, schema_compatible
from ...protocols import FEATURE_PROTOCOLS, PROTOCOL_FEATURES, Composite, ContractProvider, PortableAdapter
from ...revalidate import revalidate
from ..claims import CONTRACT_CLAIM
from ..context import CheckContext, Unverifiable
from ..snapshot import deep_snapshot, snapshot_diff

__all__ = ["ContractHonestyCheck", "ContractNoCollectivesCheck", "ContractValidityCheck", "ProtocolDeclarationCheck"]

_ALWAYS = frozenset({CONTRACT_CLAIM})


class ContractValidityCheck:
    name = "contract.valid_and_immutable"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return _ALWAYS

    def run(self, context: CheckContext) -> None:
        _, optimizer = context.fresh()
        assert isinstance(optimizer, ContractProvider), "the optimizer has no optimizer_contract() method"
        contract = optimizer.optimizer_contract()
        assert type(contract) is OptimizerContract, f"optimizer_contract() returned {type(contract).__name__}"
        assert schema_compatible(contract.schema_version), f"unreadable schema {contract.schema_version!r}"
        assert revalidate(contract) == contract, "the contract does not survive revalidation"
        assert from_primitive(to_primitive(contract), OptimizerContract) == contract, "codec round trip differs"
        try:
            object.__getattribute__(contract, "__setattr__")("implementation", "mutated")
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError("the contract can be mutated with setattr")
        hash(contract)


class ContractHonestyCheck:
    """Deterministic and behaviour-neutral: querying changes nothing and later steps are
    bit-identical to a never-queried twin."""

    name = "contract.deterministic_and_pure"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return _ALWAYS

    def run(self, context: CheckContext) -> None:
        steps = context.target.steps
        model_a, queried = context.fresh()
        model_b, control = context.fresh()
        for phase in range(2):
            before = deep_snapshot(queried, model_a)
            first = queried.optimizer_contract()  # type: ignore[attr-defined]
            second = queried.optimizer_contract()  # type: ignore[attr-defined]
            diffs = snapshot_diff(before, queried, model_a)
            assert not diffs, "optimizer_contract() changed the optimizer: " + "; ".join(diffs)
            assert first == second, "two optimizer_contract() calls on an unchanged optimizer differ"
            twin = control.optimizer_contract()  # type: ignore[attr-defined]
            assert first == twin, "equal optimizers published different contracts"
            context.train(model_a, queried, steps, start=phase * steps)
            context.train(model_b, control, steps, start=phase * steps)
            context.assert_models_bitwise_equal(model_a, model_b, "training after contract queries")


class ContractNoCollectivesCheck:
    name = "contract.no_collectives"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return _ALWAYS

    def run(self, context: CheckContext) -> None:
        if not torch.distributed.is_available():
            raise Unverifiable("torch.distributed is not available")
        from ...torch_support.collectives import CollectiveCounter

        _model, optimizer = context.trained()
        counter = CollectiveCounter()
        with counter.patched():
            optimizer.optimizer_contract()  # type: ignore[attr-defined]
        assert counter.total == 0, f"optimizer_contract() ran collectives: {counter.calls}"


def _served_through_children(optimizer: object, feature: str) -> bool:
    """A composite serves ``portable_state`` when every child is a ``PortableAdapter``: that is
    how an optimizer-agnostic driver (gefen-portable's composite wrapper) exports and imports it."""
    if feature != FEATURE_PORTABLE_STATE or not isinstance(optimizer, Composite):
        return False
    children = list(optimizer.child_optimizers().values())
    return bool(children) and all(isinstance(child, PortableAdapter) for child in children)


class ProtocolDeclarationCheck:
    """Each implemented Protocol has an explicit feature status; each claimed feature has
    its Protocol implemented (a composite's ``portable_state`` claim may instead be served by
    children that all implement ``PortableAdapter``)."""

    name = "contract.protocols_declared"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return _ALWAYS

    def run(self, context: CheckContext) -> None:
        _, optimizer = context.trained()
        features = optimizer.optimizer_contract().capabilities.features  # type: ignore[attr-defined]
        problems = []
        for protocol, feature in PROTOCOL_FEATURES.items():
            if isinstance(optimizer, protocol) and feature not in features:
                problems.append(
                    f"implements {protocol.__name__} but neither claims nor declares negative feature {feature!r}"
                )
        for feature, status in features.items():
            wanted = FEATURE_PROTOCOLS.get(feature)
            if status.supported and wanted is not None and not isinstance(optimizer, wanted):
                if _served_through_children(optimizer, feature):
                    continue
                problems.append(f"claims feature {feature!r} but does not implement {wanted.__name__}")
        assert not problems, "; ".join(problems)

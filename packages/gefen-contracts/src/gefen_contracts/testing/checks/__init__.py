"""The kit's built-in checks."""

from __future__ import annotations

from ..context import ConformanceCheck
from .checkpoint import AtomicLoadCheck, CanonicalLocalRoundTripCheck, NativeRoundTripCheck
from .composite import CompositeRulesCheck
from .contract import ContractHonestyCheck, ContractNoCollectivesCheck, ContractValidityCheck, ProtocolDeclarationCheck
from .negative import NegativeClaimsCheck
from .state import StateDeclarationCheck
from .training import ReplicatedTrainingCheck

__all__ = ["BUILTIN_CHECKS"]


def builtin_checks() -> tuple[ConformanceCheck, ...]:
    return (
        ContractValidityCheck(),
        ContractHonestyCheck(),
        ContractNoCollectivesCheck(),
        ProtocolDeclarationCheck(),
        StateDeclarationCheck(),
        NegativeClaimsCheck(),
        ReplicatedTrainingCheck(),
        NativeRoundTripCheck(),
        AtomicLoadCheck(),
        CanonicalLocalRoundTripCheck(),
        CompositeRulesCheck(),
    )


BUILTIN_CHECKS = builtin_checks

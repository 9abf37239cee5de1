"""The kit's built-in checks."""

from __future__ import annotations

from ..context import ConformanceCheck
from .canonical import CanonicalLocalCheck
from .checkpoint import AtomicLoadCheck, NativeRefusalsCheck, NativeRoundTripCheck, TorchRecipeCheck
from .composite import CompositeRulesCheck
from .contract import ContractHonestyCheck, ContractNoCollectivesCheck, ContractValidityCheck, ProtocolDeclarationCheck
from .identity import FlattenedCheckpointsCheck, FlattenedTrainingCheck, PostShardingCheck, SealedLayoutGuardCheck
from .negative import NegativeClaimsCheck
from .state import StateDeclarationCheck
from .training import CopiesCheck, ParameterRanksCheck, PrecisionsCheck, ReplicatedTrainingCheck

__all__ = ["builtin_checks"]


def builtin_checks() -> tuple[ConformanceCheck, ...]:
    return (
        ContractValidityCheck(),
        ContractHonestyCheck(),
        ContractNoCollectivesCheck(),
        ProtocolDeclarationCheck(),
        StateDeclarationCheck(),
        NegativeClaimsCheck(),
        ReplicatedTrainingCheck(),
        CopiesCheck(),
        PrecisionsCheck(),
        ParameterRanksCheck(),
        NativeRoundTripCheck(),
        TorchRecipeCheck(),
        AtomicLoadCheck(),
        NativeRefusalsCheck(),
        PostShardingCheck(),
        SealedLayoutGuardCheck(),
        CanonicalLocalCheck(),
        FlattenedTrainingCheck(),
        FlattenedCheckpointsCheck(),
        CompositeRulesCheck(),
    )

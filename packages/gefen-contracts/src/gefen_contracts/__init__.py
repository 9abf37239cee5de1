"""gefen-contracts: the optimizer convention.

The top level is the day-one tier: what an optimizer author needs to adopt the convention
(the contract and its capabilities, the state schema, the errors). Everything else lives in
documented submodules, by topic (the package README lists them): identity and sharding
(:mod:`~gefen_contracts.identity`, :mod:`~gefen_contracts.manifest`, :mod:`~gefen_contracts.rebinding`),
portable state (:mod:`~gefen_contracts.exchange`, :mod:`~gefen_contracts.limits`), the Protocols
(:mod:`~gefen_contracts.protocols`), the vocabulary (:mod:`~gefen_contracts.enums`), the codec and
digest, kernel plugins (:mod:`~gefen_contracts.kernels`) and staged transactions. Importing this
package loads only the standard library; torch-bound pieces live in
:mod:`gefen_contracts.torch_support` (extra ``[torch]``) and the conformance kit, the entry
point for checking an optimizer, in :mod:`gefen_contracts.testing`.
"""

from __future__ import annotations

# the topic submodules, loaded so that ``gefen_contracts.<topic>.<Name>`` resolves
from . import capabilities as capabilities
from . import codec as codec
from . import contract as contract
from . import digest as digest
from . import enums as enums
from . import errors as errors
from . import exchange as exchange
from . import frozen as frozen
from . import identity as identity
from . import kernels as kernels
from . import limits as limits
from . import manifest as manifest
from . import naming as naming
from . import protocols as protocols
from . import rebinding as rebinding
from . import revalidate as revalidate
from . import state_layout as state_layout
from . import transactions as transactions
from ._version import __version__
from .capabilities import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_COMPOSITE,
    FEATURE_PARAMETER_SHAPED_STATE,
    FEATURE_PORTABLE_STATE,
    FEATURE_POST_SHARDING,
    FEATURE_STAGED_NATIVE_LOAD,
    STANDARD_FEATURES,
    CheckpointSupport,
    FeatureStatus,
    OptimizerCapabilities,
    TrainingSupport,
)
from .contract import OptimizerContract
from .enums import StateGeometry, StateRole, StateScope
from .errors import (
    CodecError,
    CollectiveFailureError,
    ContractError,
    ContractTypeError,
    KernelUnavailableError,
    LayoutTamperedError,
    NotSupportedError,
    StaleTransactionError,
    StateValidationError,
)
from .state_layout import OptimizerStateLayout, StateField, StateVariant

__all__ = [
    "FEATURE_CANONICAL_IDENTITY",
    "FEATURE_CANONICAL_LOCAL_STATE",
    "FEATURE_COLLECTIVE_SCOPE",
    "FEATURE_COMPOSITE",
    "FEATURE_PARAMETER_SHAPED_STATE",
    "FEATURE_PORTABLE_STATE",
    "FEATURE_POST_SHARDING",
    "FEATURE_STAGED_NATIVE_LOAD",
    "STANDARD_FEATURES",
    "__version__",
    "CheckpointSupport",
    "CodecError",
    "CollectiveFailureError",
    "ContractError",
    "ContractTypeError",
    "FeatureStatus",
    "KernelUnavailableError",
    "LayoutTamperedError",
    "NotSupportedError",
    "OptimizerCapabilities",
    "OptimizerContract",
    "OptimizerStateLayout",
    "StaleTransactionError",
    "StateField",
    "StateGeometry",
    "StateRole",
    "StateScope",
    "StateValidationError",
    "StateVariant",
    "TrainingSupport",
]

"""gefen-hybrid: a composite optimizer over two contracted children, and ``ContractedAdamW``.

Depends only on gefen-contracts and torch. Public API:

* :class:`CompositeOptimizer` (roles ``"muon"`` and ``"backup"``), its routing rules
  (:class:`RoutingRules`, :func:`route_model`, :func:`route_named_parameters`,
  :func:`split_by_role`) and its native state-dict format;
* :class:`ContractedAdamW`, ``torch.optim.AdamW`` that keeps the convention (its dynamic
  contract: :func:`adamw_contract` of an :class:`AdamWReadiness`);
* shard identity (``post_sharding``) and canonical local state on both, the composite's
  document being ``gefen.composite_bound_state`` (:data:`COMPOSITE_DOCUMENT_FORMAT`);
* portable state (``PortableAdapter`` on ContractedAdamW; the composite is served child by
  child through gefen-portable's composite wrapper), driven by gefen-portable and gefen-dcp
  (:data:`PORTABLE_SUPPORT`), and parameter-shaped native state on both
  (:data:`PARAMETER_SHAPED_SUPPORT`), which DCP reshards (``gefen_dcp.GefenDCPState`` or
  torch's ``get/set_optimizer_state_dict``);
* :mod:`gefen_hybrid.conformance`: factories for the conformance kit.
"""

from __future__ import annotations

from ._version import __version__
from .adamw import ContractedAdamW
from .adamw_canonical import NO_STATE_VARIANT
from .adamw_contract import (
    ADAMW_CONTRACT,
    ADAMW_IMPLEMENTATION,
    ADAMW_STATE_LAYOUT,
    PARAMETER_SHAPED_SUPPORT,
    PORTABLE_SUPPORT,
    AdamWReadiness,
    adamw_contract,
)
from .composite import DEFAULT_IMPLEMENTATION, STEP_PHASE, ChildFactory, CompositeOptimizer
from .composite_bound_state import COMPOSITE_DOCUMENT_FORMAT, COMPOSITE_DOCUMENT_KEYS, COMPOSITE_DOCUMENT_VERSION
from .composite_contract import derive_composite_contract, intersect_checkpoint_support
from .composite_format import FORMAT, FORMAT_VERSION, children_of_state_dict
from .composite_state import CompositeState
from .roles import ROLE_BACKUP, ROLE_MUON, ROLE_TAG_PREFIX, ROLES, role_tag
from .routing import (
    DEFAULT_BACKUP_SUBSTRINGS,
    OUTPUT_HEAD_NAMES,
    NamedParameter,
    RoutedParameters,
    RoutingDecision,
    RoutingRules,
    RoutingWarning,
    route_model,
    route_named_parameters,
    routing_report,
    split_by_role,
)

__all__ = [
    "ADAMW_CONTRACT",
    "ADAMW_IMPLEMENTATION",
    "ADAMW_STATE_LAYOUT",
    "AdamWReadiness",
    "COMPOSITE_DOCUMENT_FORMAT",
    "COMPOSITE_DOCUMENT_KEYS",
    "COMPOSITE_DOCUMENT_VERSION",
    "ChildFactory",
    "CompositeOptimizer",
    "CompositeState",
    "ContractedAdamW",
    "DEFAULT_BACKUP_SUBSTRINGS",
    "DEFAULT_IMPLEMENTATION",
    "PARAMETER_SHAPED_SUPPORT",
    "FORMAT",
    "FORMAT_VERSION",
    "NO_STATE_VARIANT",
    "NamedParameter",
    "OUTPUT_HEAD_NAMES",
    "PORTABLE_SUPPORT",
    "ROLES",
    "ROLE_BACKUP",
    "ROLE_MUON",
    "ROLE_TAG_PREFIX",
    "RoutedParameters",
    "RoutingDecision",
    "RoutingRules",
    "RoutingWarning",
    "STEP_PHASE",
    "__version__",
    "adamw_contract",
    "children_of_state_dict",
    "derive_composite_contract",
    "intersect_checkpoint_support",
    "role_tag",
    "route_model",
    "routing_report",
    "route_named_parameters",
    "split_by_role",
]

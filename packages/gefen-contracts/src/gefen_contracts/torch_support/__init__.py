"""Torch-bound pieces of the convention (install ``gefen-contracts[torch]``).

Process-group bindings with one backend/device rule set, failure votes and agreement
primitives over a binding, a collective call counter for tests, the tensor leaf adapter
for the digest grammar, and the generic identity machinery every ``IdentityBindable`` /
``CanonicalLocalState`` optimizer shares: request validation (:func:`plan_rebinding`),
the owned sealed layout and its guard (:class:`SealedLayout`), the
``gefen.bound_state`` envelope (:func:`build_bound_state`, :func:`parse_bound_state`) and the
version-counter freshness token of prepared transactions (:func:`state_version_token`), the
``IdentityBindable`` role as one object an optimizer owns (:class:`IdentityBinding`), and
the expansion of a portable record's block fields (:func:`expand_blocks`, :func:`as_imported`),
and the bytes an optimizer holds (:func:`count_state_bytes`: every storage reachable from it,
parameters and gradients excluded; any optimizer, so Gefen is measured as AdamW is), and
what a step that takes ``GradScaler``'s protocol and raises must undo
(:func:`forget_scaler_state`), and torch's state-dict hooks around an export or a load an
optimizer implements itself (:func:`export_with_hooks`, :func:`load_with_hooks`,
:func:`run_load_pre_hooks`, :func:`run_load_post_hooks`).
"""

from __future__ import annotations

from .bindings import CheckpointProcessGroupBinding, CodebookProcessGroupBinding, ProcessGroupBinding
from .block_fields import as_imported, block_count, expand_blocks
from .bound_state import (
    BOUND_STATE_COVERAGE,
    BOUND_STATE_FORMAT,
    BOUND_STATE_FORMAT_VERSION,
    BoundParameter,
    BoundStateDocument,
    build_bound_state,
    parse_bound_state,
)
from .collectives import CollectiveCounter, agree, agree_digest, failure_vote, failure_vote_on_group
from .dcp_keys import with_rejoined_state
from .freshness import state_version_token, tensor_version_token
from .grad_scaler import forget_scaler_state, scaler_overflowed
from .identity_binding import IdentityBinding
from .native_identity import IDENTITY_FORMAT, IDENTITY_KEY, identity_guard, split_identity_guard
from .param_groups import (
    SharedOption,
    check_new_group,
    check_tensor_lr,
    group_params,
    names_mismatch,
    routing_mismatch,
    share_options,
    shared_tensor_options,
)
from .rebinding_plan import (
    RebindingPlan,
    SlotRebinding,
    compatibility_names,
    has_internal_overlap,
    plan_rebinding,
    publish_binding,
    rebuilt_plan,
    staged_groups,
)
from .sealed_layout import SealedLayout
from .state_bytes import StateBytes, count_state_bytes, parameter_count
from .state_dict_hooks import export_with_hooks, load_with_hooks, run_load_post_hooks, run_load_pre_hooks
from .tensors import (
    dtensor_from_local,
    dtype_from_name,
    dtype_name,
    finite_bounds,
    is_dtensor,
    local_tensor,
    on_device,
    storage_overlap,
    tensor_digest,
    tensor_leaf,
)

__all__ = [
    "BOUND_STATE_COVERAGE",
    "BOUND_STATE_FORMAT",
    "BOUND_STATE_FORMAT_VERSION",
    "BoundParameter",
    "IDENTITY_FORMAT",
    "IDENTITY_KEY",
    "IdentityBinding",
    "BoundStateDocument",
    "CheckpointProcessGroupBinding",
    "CodebookProcessGroupBinding",
    "CollectiveCounter",
    "ProcessGroupBinding",
    "RebindingPlan",
    "SealedLayout",
    "SharedOption",
    "SlotRebinding",
    "StateBytes",
    "agree",
    "agree_digest",
    "as_imported",
    "block_count",
    "build_bound_state",
    "check_new_group",
    "group_params",
    "names_mismatch",
    "routing_mismatch",
    "check_tensor_lr",
    "compatibility_names",
    "count_state_bytes",
    "failure_vote",
    "failure_vote_on_group",
    "has_internal_overlap",
    "identity_guard",
    "parse_bound_state",
    "plan_rebinding",
    "publish_binding",
    "rebuilt_plan",
    "run_load_post_hooks",
    "run_load_pre_hooks",
    "split_identity_guard",
    "staged_groups",
    "state_version_token",
    "dtensor_from_local",
    "dtype_from_name",
    "dtype_name",
    "expand_blocks",
    "export_with_hooks",
    "finite_bounds",
    "forget_scaler_state",
    "scaler_overflowed",
    "is_dtensor",
    "load_with_hooks",
    "local_tensor",
    "on_device",
    "parameter_count",
    "storage_overlap",
    "share_options",
    "shared_tensor_options",
    "tensor_digest",
    "tensor_leaf",
    "tensor_version_token",
    "with_rejoined_state",
]

"""The dynamic identity part of ``Gefen``'s and ``GefenMuon``'s contracts.

A claim appears only while the live optimizer is ready for it (cheap checks: the pristine
state, the sealed layout's identity comparison, option types; full validation happens when a
document or checkpoint is exported or prepared), and a missing claim says why:

* ``post_sharding``: pristine and unfinalized (or already finalized, which it stays);
* ``canonical_identity``: finalized and the sealed layout intact;
* ``canonical_local_state`` and its ``CANONICAL_LOCAL`` entry (same topology, the bound
  layouts it supports, fail-before-mutation): see :mod:`gefen_core.canonical_state`;
* ``collective_scope``: ``capturable=False`` (the protocol and learning on demand synchronise
  with the host). ``collective_scope()`` returns the installed binding, ``None`` when unscoped;
  ``initialize_collective_state()`` / ``refresh_collective_state()`` then learn locally;
* training and native checkpoints: before ``post_sharding`` the unbound layouts (plus the
  layouts ``post_sharding`` could bind while pristine); afterwards exactly the bound layouts,
  with ``ADAPTER_DEFINED`` scope when a codebook scope is installed.
"""

from __future__ import annotations

from gefen_contracts import (
    FEATURE_CANONICAL_IDENTITY,
    FEATURE_CANONICAL_LOCAL_STATE,
    FEATURE_COLLECTIVE_SCOPE,
    FEATURE_POST_SHARDING,
    CheckpointSupport,
    FeatureStatus,
)
from gefen_contracts.enums import CheckpointTransport, LoadAtomicity, ParameterLayout, ProcessGroupScope

from .identity import IdentityReadiness

__all__ = ["FRESH", "canonical_local_entry", "identity_features", "training_scope"]

#: The readiness of a pristine, unfinalized optimizer (for callers without one).
FRESH = IdentityReadiness(
    FeatureStatus.yes(),
    FeatureStatus.no("the optimizer is not finalized: call post_sharding with a ShardingManifest"),
    FeatureStatus.yes(),
)


def identity_features(readiness: IdentityReadiness, canonical: FeatureStatus) -> dict[str, FeatureStatus]:
    """The statuses of the identity features."""
    return {
        FEATURE_POST_SHARDING: readiness.post_sharding,
        FEATURE_CANONICAL_IDENTITY: readiness.identity,
        FEATURE_CANONICAL_LOCAL_STATE: canonical,
        FEATURE_COLLECTIVE_SCOPE: readiness.collective_scope,
    }


def training_scope(readiness: IdentityReadiness) -> ProcessGroupScope:
    """Where a bound layout's collectives come from: the adapter's scope, or none."""
    return ProcessGroupScope.ADAPTER_DEFINED if readiness.scoped else ProcessGroupScope.NONE


def canonical_local_entry(
    readiness: IdentityReadiness, canonical: FeatureStatus, supported: frozenset[ParameterLayout]
) -> tuple[CheckpointSupport, ...]:
    """The ``CANONICAL_LOCAL`` entry (empty when canonical local state is not supported now)."""
    layouts = readiness.layouts & supported
    if not canonical.supported or not layouts:
        return ()
    return (
        CheckpointSupport(
            CheckpointTransport.CANONICAL_LOCAL,
            layouts,
            ProcessGroupScope.NONE,
            LoadAtomicity.LOCAL_FAIL_BEFORE_MUTATION,
        ),
    )

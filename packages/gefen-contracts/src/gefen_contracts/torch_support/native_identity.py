"""How a native checkpoint of a bound optimizer carries its identity: the convention's carrier.

A native state dict matches saved and live parameters by position. After ``post_sharding``
positions alone are not enough (another member's slice, a different manifest or scope has
the same positions and, for equal cuts, the same shapes), so an optimizer finalized by
``post_sharding`` adds one top-level key, :data:`IDENTITY_KEY`, built from its
:class:`~gefen_contracts.torch_support.SealedLayout` by :func:`identity_guard`, and checks it
with :func:`split_identity_guard` before staging a load::

    {"format": "gefen.shard_identity", "format_version": 1,
     "scope": None | {"semantic_name": str, "ordered_members": [str, ...]},   # rank-neutral
     "manifest_digest": str,                                                 # the global layout
     "slots": [{"group_index": int, "slot_index": int, "compatibility_name": str,
                "shard": <ShardIdentity record>}, ...]}                      # this member's slots

``slots`` lists every original slot in ``(group, slot)`` order, pruned whole-parameter
non-owners included, so the guard is rank-local while the scope record is the same on every
member. Handles and devices are never written. Loading rules (checked before anything is
staged): a checkpoint with a guard loads only into a finalized optimizer with an equal guard;
a finalized optimizer accepts a checkpoint without one only when it has no scope and every
local slot is an ungrouped replicated parameter (then positions are enough). Unfinalized
optimizers write no guard, so their checkpoints are unchanged. Gefen, GefenMuon and
ContractedAdamW use it; the conformance kit's ``identity.flattened_checkpoints`` gives member
0's checkpoint to member 1 (shards of equal size) and requires a refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..codec import to_primitive
from ..digest import canonical_digest, descriptor_digest
from ..enums import ParameterLayout
from ..errors import CodecError, StateValidationError
from .sealed_layout import SealedLayout

__all__ = ["IDENTITY_FORMAT", "IDENTITY_KEY", "identity_guard", "split_identity_guard"]

IDENTITY_KEY = "gefen_shard_identity"
IDENTITY_FORMAT = "gefen.shard_identity"
_VERSION = 1


def identity_guard(sealed: SealedLayout) -> dict[str, Any]:
    """The guard record of a finalized optimizer (primitives only)."""
    return {
        "format": IDENTITY_FORMAT,
        "format_version": _VERSION,
        "scope": None if sealed.scope is None else sealed.scope.scope_record(),
        "manifest_digest": descriptor_digest(sealed.manifest),
        "slots": [
            {
                "group_index": slot.group_index,
                "slot_index": slot.original_slot_index,
                "compatibility_name": slot.compatibility_name,
                "shard": to_primitive(slot.shard),
            }
            for slot in sealed.slots
        ],
    }


def _same(saved: object, live: object) -> bool:
    """Equal as primitive trees with exact types (``True`` is not ``1``)."""
    try:
        return canonical_digest(saved) == canonical_digest(live)
    except CodecError:
        return False


def _positional_ok(sealed: SealedLayout) -> bool:
    return sealed.scope is None and all(
        shard.layout is ParameterLayout.REPLICATED and shard.process_group is None for _, shard in sealed.bindings
    )


def split_identity_guard(state_dict: object, sealed: SealedLayout | None) -> object:
    """Check the guard of ``state_dict`` against ``sealed`` (``None``: not finalized) and
    return the dict without it.

    Raises :class:`~gefen_contracts.StateValidationError` (nothing is staged) when the guard
    is missing where it is required, present for an unfinalized optimizer, or different from
    the live one. A non-mapping is returned unchanged for the format's own checks.
    """
    if not isinstance(state_dict, Mapping):
        return state_dict
    guard = state_dict.get(IDENTITY_KEY)
    if guard is None:
        if IDENTITY_KEY in state_dict:
            raise StateValidationError(f"{IDENTITY_KEY!r} must be a guard record, not None")
        if sealed is not None and not _positional_ok(sealed):
            raise StateValidationError(
                "this optimizer was finalized by post_sharding (flattened or whole-parameter shards, grouped "
                "parameters or a codebook scope), but the checkpoint carries no shard-identity guard "
                f"({IDENTITY_KEY!r}); it was saved by an optimizer with another layout"
            )
        return state_dict
    if sealed is None:
        raise StateValidationError(
            "the checkpoint was saved by an optimizer finalized by post_sharding; call post_sharding with the same "
            "manifest, local shards and scope before loading it"
        )
    expected = identity_guard(sealed)
    if not isinstance(guard, Mapping) or type(guard.get("format_version")) is not int:
        raise StateValidationError(f"{IDENTITY_KEY!r} must be a dict with an int format_version")
    if guard.get("format") != IDENTITY_FORMAT or guard["format_version"] != _VERSION:
        raise StateValidationError(
            f"{IDENTITY_KEY!r} has format {guard.get('format')!r} version {guard['format_version']!r}; this library "
            f"reads {IDENTITY_FORMAT!r} version {_VERSION}"
        )
    if set(guard) != set(expected):
        raise StateValidationError(f"{IDENTITY_KEY!r} keys must be {sorted(expected)}, got {sorted(map(str, guard))}")
    if not _same(guard["scope"], expected["scope"]):
        raise StateValidationError(
            f"the checkpoint's codebook scope {guard['scope']!r} does not match this optimizer's {expected['scope']!r} "
            "(the scopes disagree)"
        )
    if guard["manifest_digest"] != expected["manifest_digest"]:
        raise StateValidationError("the checkpoint was saved under another sharding manifest")
    if not _same(guard["slots"], expected["slots"]):
        raise StateValidationError(
            "the checkpoint's local-shard identity (slot positions, names or shards) does not match this optimizer's; "
            "it was saved by another member or under another layout"
        )
    return {key: value for key, value in state_dict.items() if key != IDENTITY_KEY}

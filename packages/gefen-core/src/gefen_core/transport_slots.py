"""What Gefen and GefenMuon share in portable import: the feature check, the options each group
adopts from the records of its slots, and the positional ids of the native state they stage.
(The slots themselves, their names and shards: :mod:`gefen_contracts.torch_support.portable_slots`.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gefen_contracts import FeatureStatus, NotSupportedError, StateValidationError
from gefen_contracts.torch_support.option_records import options_equal

__all__ = ["adopted_groups", "positional_state", "require_feature"]


def require_feature(feature: str, status: FeatureStatus) -> None:
    """Raise :class:`~gefen_contracts.NotSupportedError` with the status's reasons unless supported."""
    if not status.supported:
        raise NotSupportedError(feature, status.reasons)


def adopted_groups(
    param_groups: Sequence[Mapping[str, Any]],
    records: Sequence[Sequence[tuple[str, dict[str, Any]]]],
    *,
    keep: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Each live group with the options recorded for its slots (``records[g]``: ``(fqn, options)``).

    The options of one group's slots must agree (types included); a group without records
    keeps its own. The result keeps the live ``params``, ``param_names`` and the options
    named in ``keep`` (the target's execution choices).
    """
    groups: list[dict[str, Any]] = []
    for index, (group, slots) in enumerate(zip(param_groups, records)):
        adopted = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if slots:
            first_fqn, first = slots[0]
            for fqn, options in slots[1:]:
                if not options_equal(first, options):
                    raise StateValidationError(
                        f"param_groups[{index}] holds {first_fqn!r} and {fqn!r}, whose recorded options differ; "
                        "regroup the target so that each group's parameters share their options"
                    )
            adopted = {**dict(first), **{key: group[key] for key in keep if key in group}}
        adopted["params"] = group["params"]
        if "param_names" in group:
            adopted["param_names"] = list(group["param_names"])
        groups.append(adopted)
    return groups


def positional_state(groups: Sequence[Mapping[str, Any]], entries: Mapping[tuple[int, int], Any]) -> dict[int, Any]:
    """Entries keyed by ``(group, live index)`` re-keyed by native parameter id (position in
    ``groups`` order, as :func:`gefen_core.native_records.native_state_dict` numbers them)."""
    offsets, pid = [], 0
    for group in groups:
        offsets.append(pid)
        pid += len(group["params"])
    return {offsets[g] + k: entry for (g, k), entry in entries.items()}

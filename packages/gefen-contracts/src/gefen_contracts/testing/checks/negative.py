"""Negative claims are honest: an implemented but unsupported Protocol refuses its actions
with ``NotSupportedError`` and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...enums import ParameterLayout
from ...errors import NotSupportedError
from ...identity import LogicalSlice, ParameterIdentity, ShardIdentity
from ...manifest import ShardingManifest
from ...protocols import (
    PROTOCOL_FEATURES,
    CanonicalLocalState,
    CollectiveScoped,
    Composite,
    IdentityBindable,
    PortableAdapter,
    StagedNativeLoad,
)
from ...rebinding import ParameterRebinding
from ..claims import CONTRACT_CLAIM
from ..context import CheckContext
from ..snapshot import deep_snapshot, snapshot_diff

__all__ = ["NegativeClaimsCheck", "replicated_plan"]

Action = Callable[[Any, nn.Module], object]


def replicated_plan(model: nn.Module) -> tuple[list[ParameterRebinding], ShardingManifest]:
    """Identity-only rebindings (old is new) and an ungrouped replicated manifest."""
    rebindings, shards = [], []
    for name, parameter in model.named_parameters():
        identity = ParameterIdentity(name, tuple(parameter.shape))
        shard = ShardIdentity(identity, ParameterLayout.REPLICATED, LogicalSlice.full(identity))
        shards.append(shard)
        rebindings.append(ParameterRebinding(parameter, parameter, shard))
    return rebindings, ShardingManifest(tuple(shards))


def _post_sharding_prepare(opt: Any, model: nn.Module) -> object:
    rebindings, manifest = replicated_plan(model)
    return opt.prepare_post_sharding(rebindings, manifest=manifest)


def _post_sharding(opt: Any, model: nn.Module) -> object:
    rebindings, manifest = replicated_plan(model)
    return opt.post_sharding(rebindings, manifest=manifest)


_ACTIONS: dict[type, tuple[tuple[str, Action], ...]] = {
    StagedNativeLoad: (("stage_state_dict", lambda opt, model: opt.stage_state_dict(opt.state_dict())),),
    IdentityBindable: (("prepare_post_sharding", _post_sharding_prepare), ("post_sharding", _post_sharding)),
    CanonicalLocalState: (
        ("export_local_state", lambda opt, model: opt.export_local_state()),
        ("prepare_local_import", lambda opt, model: opt.prepare_local_import({})),
    ),
    PortableAdapter: (
        ("portable_export", lambda opt, model: opt.portable_export()),
        (
            "portable_prepare_import",
            lambda opt, model: opt.portable_prepare_import(implementation="x.y", policy={}, common={}, slots=()),
        ),
    ),
    CollectiveScoped: (
        ("initialize_collective_state", lambda opt, model: opt.initialize_collective_state()),
        ("refresh_collective_state", lambda opt, model: opt.refresh_collective_state()),
    ),
    Composite: (
        ("child_optimizers", lambda opt, model: opt.child_optimizers()),
        ("parameter_routing", lambda opt, model: opt.parameter_routing()),
    ),
}


class NegativeClaimsCheck:
    name = "contract.negative_claims_refuse"

    def covers(self, claims: frozenset[str]) -> frozenset[str]:
        return frozenset({CONTRACT_CLAIM})

    def run(self, context: CheckContext) -> None:
        problems: list[str] = []
        for trained in (False, True):
            model, optimizer = context.trained() if trained else context.fresh()
            features = optimizer.optimizer_contract().capabilities.features  # type: ignore[attr-defined]
            for protocol, actions in _ACTIONS.items():
                feature = PROTOCOL_FEATURES[protocol]
                status = features.get(feature)
                if not isinstance(optimizer, protocol) or status is None or status.supported:
                    continue
                for label, action in actions:
                    before = deep_snapshot(optimizer, model)
                    try:
                        action(optimizer, model)
                    except NotSupportedError:
                        pass
                    except Exception as exc:
                        problems.append(
                            f"{label}() with {feature!r} declared unsupported raised {type(exc).__name__}: {exc} "
                            f"instead of NotSupportedError"
                        )
                    else:
                        problems.append(f"{label}() succeeded although {feature!r} is declared unsupported")
                    diffs = snapshot_diff(before, optimizer, model)
                    if diffs:
                        problems.append(f"{label}() changed the optimizer: " + "; ".join(diffs[:3]))
        assert not problems, "; ".join(problems)

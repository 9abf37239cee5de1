"""Turn a contract into the list of claims the kit must verify."""

from __future__ import annotations

from ..contract import OptimizerContract

__all__ = [
    "CONTRACT_CLAIM",
    "atomic_claim",
    "checkpoint_claim",
    "enumerate_claims",
    "precision_claim",
    "training_claim",
]

CONTRACT_CLAIM = "contract"


def training_claim(layout: str, tags: frozenset[str] = frozenset()) -> str:
    suffix = "[" + ",".join(sorted(tags)) + "]" if tags else ""
    return f"training:{layout}{suffix}"


def precision_claim(precision: str) -> str:
    return f"precision:{precision}"


#: The ranks exercised when a contract supports every rank (``supported_parameter_ranks=None``).
ANY_RANKS = (0, 1, 2, 3, 4)


def rank_claim(rank: int) -> str:
    return f"ranks:{rank}"


def checkpoint_claim(transport: str, layout: str) -> str:
    return f"checkpoint:{transport}:{layout}"


def atomic_claim(transport: str, layout: str) -> str:
    return f"checkpoint:{transport}:{layout}:atomic"


def transition_claim(transport: str, source: str, target: str, kind: str) -> str:
    return f"checkpoint:{transport}:transition:{source}->{target}:{kind}"


def enumerate_claims(contract: OptimizerContract) -> frozenset[str]:
    """Every positive claim of ``contract`` as a stable string."""
    claims = {CONTRACT_CLAIM}
    capabilities = contract.capabilities
    for name, status in capabilities.features.items():
        if status.supported:
            claims.add(f"feature:{name}")
    for training in capabilities.training:
        claims.add(training_claim(training.layout.value, training.mode_tags))
    for precision in capabilities.precisions:
        claims.add(precision_claim(precision.value))
    ranks = capabilities.supported_parameter_ranks
    claims.update(rank_claim(rank) for rank in (ANY_RANKS if ranks is None else ranks))
    for entry in capabilities.checkpoints:
        transport = entry.transport.value
        for layout in entry.same_topology:
            claims.add(checkpoint_claim(transport, layout.value))
            if entry.atomic_load:
                claims.add(atomic_claim(transport, layout.value))
        for transition in entry.transitions:
            for source in transition.source_layouts:
                for target in transition.target_layouts:
                    for kind in transition.kinds:
                        claims.add(transition_claim(transport, source.value, target.value, kind.value))
    return frozenset(claims)

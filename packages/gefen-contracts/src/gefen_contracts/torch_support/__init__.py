"""Torch-bound pieces of the convention (install ``gefen-contracts[torch]``).

Process-group bindings with one backend/device rule set, failure votes and agreement
primitives over a binding, a collective call counter for tests, and the tensor leaf
adapter for the digest grammar.
"""

from __future__ import annotations

from .bindings import CheckpointProcessGroupBinding, CodebookProcessGroupBinding, ProcessGroupBinding
from .collectives import CollectiveCounter, agree, agree_digest, failure_vote, failure_vote_on_group
from .tensors import tensor_digest, tensor_leaf

__all__ = [
    "CheckpointProcessGroupBinding",
    "CodebookProcessGroupBinding",
    "CollectiveCounter",
    "ProcessGroupBinding",
    "agree",
    "agree_digest",
    "failure_vote",
    "failure_vote_on_group",
    "tensor_digest",
    "tensor_leaf",
]

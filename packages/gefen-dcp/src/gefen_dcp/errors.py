"""Specific exception types of gefen-dcp (all but :class:`PlannerRequiredError` are
:class:`GefenCheckpointError`, a :class:`gefen_contracts.StateValidationError`).

Every refusal names what was wrong and where. Errors raised while DCP plans or reads
(inside ``dcp.save`` / ``dcp.load``) reach the caller wrapped in DCP's own
``CheckpointException`` (its ``failures`` hold these per rank); errors raised by
:meth:`gefen_dcp.GefenDCPState.load_state_dict` reach the caller directly, on every rank.
"""

from __future__ import annotations

from gefen_contracts import StateValidationError

__all__ = [
    "CheckpointIntegrityError",
    "CheckpointLayoutError",
    "EnvelopeFormatError",
    "GefenCheckpointError",
    "MetadataFormatError",
    "PlannerRequiredError",
    "StateTensorError",
    "StorageMismatchError",
]


class GefenCheckpointError(StateValidationError):
    """Base class: a checkpoint cannot be saved or loaded; no optimizer was changed."""


class EnvelopeFormatError(GefenCheckpointError):
    """An envelope or digest table is malformed, over a limit, of another format or version,
    or its own digest does not match its content."""


class CheckpointLayoutError(GefenCheckpointError):
    """The checkpoint's parameters, fields, shapes, dtypes or chunks do not fit the live
    optimizer (or the ranks of the group disagree about the live layout)."""


class CheckpointIntegrityError(GefenCheckpointError):
    """Checkpoint bytes were corrupted or truncated: a chunk's SHA-256 digest does not match
    the digest recorded when it was written, a chunk has no (or several) recorded digests, or
    a record does not belong to the checkpoint's catalog."""


class MetadataFormatError(GefenCheckpointError):
    """A DCP ``.metadata`` file is over its size limit, is not a well-formed pickle, or names
    a class outside DCP's metadata classes; refused before anything in it was built or run."""


class StateTensorError(GefenCheckpointError):
    """A state tensor could not be saved as planned: it changed while it was being written
    (a step during a synchronous save), or a chunk was planned but never written before the
    digest table."""


class StorageMismatchError(GefenCheckpointError):
    """The members of the checkpoint group named different storage (class or location),
    namespaces, transactions or limits; raised on every member before any I/O."""


class PlannerRequiredError(TypeError):
    """A :class:`~gefen_dcp.GefenDCPState` entry reached a DCP planner that cannot handle it.

    Save with ``planner=GefenSavePlanner()`` and load with ``planner=GefenLoadPlanner()``;
    both handle every other entry of the state dict exactly like DCP's default planners.
    """

"""``gefen inspect PATH``: describe a checkpoint and verify what its format lets us verify.

:func:`inspect_checkpoint` recognises

* a DCP folder (``.metadata`` inside): gefen-dcp dense-shard states, portable states and
  portable composites, each verified through gefen-dcp's own loaders (every chunk digest);
* a ``torch.save`` file of a convention document: ``gefen.portable_state`` and
  ``gefen.portable_composite_state`` (completion digests verified by gefen-portable),
  ``gefen.bound_state`` and ``gefen.composite_bound_state`` (validated envelopes);
* a ``torch.save`` file of a native state dict: Gefen's ``gefen.native_state``, GefenMuon's
  ``gefen.muon_native_state``, the composite's ``gefen.composite_native_state`` and torch's
  own optimizer format (AdamW, ``ContractedAdamW``), checked structurally.

Files are read with ``torch.load(weights_only=True)``: nothing in them is executed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .dcp import describe_dcp, is_dcp_checkpoint
from .documents import DOCUMENT_FORMATS, describe_document
from .native import describe_native, is_native_state_dict
from .report import CheckpointDescription, ParameterSummary, Problem, format_bytes

__all__ = ["CheckpointDescription", "ParameterSummary", "Problem", "format_bytes", "inspect_checkpoint"]


def inspect_checkpoint(path: str | Path, *, verify: bool = True) -> CheckpointDescription:
    """Describe the checkpoint at ``path`` (module docstring).

    Never raises for a corrupted or unrecognised checkpoint: the description's ``problems``
    say what is wrong and ``ok`` is false. ``FileNotFoundError`` if nothing is at ``path``.
    ``verify=False`` skips the DCP loads (a description from the records alone).
    """
    import torch

    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"no checkpoint at {target}")
    if is_dcp_checkpoint(target):
        return describe_dcp(target, verify=verify)
    if target.is_dir():
        return CheckpointDescription(
            str(target), "folder", "unknown", None,
            problems=(Problem(str(target), "a folder without DCP's .metadata file: not a DCP checkpoint"),),
        )  # fmt: skip
    size = target.stat().st_size
    try:
        loaded = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as exc:
        return CheckpointDescription(
            str(target), "file", "unknown", None, file_bytes=size,
            problems=(Problem(str(target), f"torch.load(weights_only=True) failed: {type(exc).__name__}: {exc}"),),
        )  # fmt: skip
    if isinstance(loaded, Mapping) and loaded.get("format") in DOCUMENT_FORMATS:
        return describe_document(loaded, str(target), size)
    if is_native_state_dict(loaded):
        return describe_native(loaded, str(target), size)
    keys = sorted(map(str, loaded))[:8] if isinstance(loaded, Mapping) else []
    return CheckpointDescription(
        str(target), "file", "unknown", None, file_bytes=size,
        problems=(Problem(str(target), f"not a checkpoint format gefen knows ({type(loaded).__name__}; keys {keys})"),),
    )  # fmt: skip

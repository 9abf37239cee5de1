"""``gefen inspect PATH``: describe a checkpoint and verify what its format lets us verify.

:func:`inspect_checkpoint` recognises

* a DCP folder (``.metadata`` inside): gefen-dcp GefenDCPState entries, portable states and
  portable composites, each verified through gefen-dcp's own loaders (every chunk digest);
* a ``torch.save`` file of a convention document: ``gefen.portable_state`` and
  ``gefen.portable_composite_state`` (completion digests verified by gefen-portable),
  ``gefen.bound_state`` and ``gefen.composite_bound_state`` (validated envelopes);
* a ``torch.save`` file of a native state dict: Gefen's ``gefen.native_state``, GefenMuon's
  ``gefen.muon_native_state``, the composite's ``gefen.composite_native_state`` and torch's
  own optimizer format (AdamW, ``ContractedAdamW``), checked structurally.

and the usual containers: a dict holding such a state dict or document under a key (a
training script's ``{"model": ..., "optimizer": ..., "step": ...}``), and a folder of
``torch.save`` files (a Hugging Face checkpoint folder's ``optimizer.pt``). Anything else is
``UNKNOWN FORMAT`` (``status``), never OK: a DCP folder without a gefen-dcp namespace (torch's
own recipe is verified by loading it into the optimizer), a ``.metadata`` this torch cannot
read, ``model.safetensors``.

Files are read with ``torch.load(weights_only=True)``: nothing in them is executed.
"""

from __future__ import annotations

import pickle
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
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"no checkpoint at {target}")
    if is_dcp_checkpoint(target):
        return describe_dcp(target, verify=verify)
    if target.is_dir():
        return _describe_folder(target, verify)
    return _describe_file(target)


def _unknown(path: str, kind: str, seen: str, file_bytes: int | None = None) -> CheckpointDescription:
    return CheckpointDescription(
        path, kind, "unknown", None, facts=(("recognised", seen),), file_bytes=file_bytes, recognised=False
    )


def _describe_folder(target: Path, verify: bool) -> CheckpointDescription:
    """A folder of ``torch.save`` files (a Hugging Face checkpoint): each one described. A file
    ``torch.load`` cannot read at all (truncated, not a torch file) beside recognised ones is a
    problem: a rank's missing half of a checkpoint; one it refuses as unsafe pickles (a trainer's
    ``training_args.bin``) is only not recognised."""
    files = sorted(p for p in target.iterdir() if p.is_file() and p.suffix in _TORCH_SUFFIXES)
    unreadable: list[Problem] = []
    children = tuple(_describe_file(p, unreadable) for p in files)
    known = tuple(child for child in children if child.recognised)
    others = sorted(p.name for p in target.iterdir() if p.suffix not in _TORCH_SUFFIXES)[:6]
    seen = f"a folder without DCP's .metadata; torch.save files {[p.name for p in files]}, other entries {others}"
    if not known:
        return _unknown(str(target), "folder", seen)
    return CheckpointDescription(
        str(target), "folder", "checkpoint folder", None, facts=(("recognised", seen),), children=known,
        problems=tuple(unreadable),
    )  # fmt: skip


def _describe_file(target: Path, unreadable: list[Problem] | None = None) -> CheckpointDescription:
    """One file; with ``unreadable`` (a folder's), a file ``torch.load`` cannot read at all is
    also added there as a problem."""
    import torch

    size = target.stat().st_size
    if target.suffix == ".safetensors":
        return _unknown(str(target), "file", "a safetensors file (model weights, no optimizer state)", size)
    try:
        loaded = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as exc:
        if isinstance(exc, pickle.UnpicklingError) and "Unsupported global" in str(exc):  # objects it will not run
            return _unknown(str(target), "file", f"torch.load(weights_only=True) refuses its objects: {exc}", size)
        reason = f"torch.load(weights_only=True) cannot read it: {type(exc).__name__}: {exc}"
        if unreadable is not None:  # (the folder reports it, beside the files it recognised)
            unreadable.append(Problem(target.name, reason))
        elif _starts_like_torch_save(target):  # a torch.save file that no longer reads: damaged, not foreign
            problem = Problem(target.name, f"{reason} (it starts like a torch.save file: truncated or damaged)")
            return CheckpointDescription(
                str(target), "file", "torch.save file", None, problems=(problem,), file_bytes=size
            )
        return _unknown(str(target), "file", reason, size)
    found = _describe_value(loaded, str(target), size)
    if found is not None:
        return found
    if isinstance(loaded, Mapping):
        inner = [(str(key), _describe_value(value, f"{target}[{key!r}]", None)) for key, value in loaded.items()]
        children = tuple(child for _, child in inner if child is not None)
        keys = sorted(map(str, loaded))[:8]
        if children:
            unchecked = sorted(key for key, child in inner if child is None)[:8]
            facts = [("keys", ", ".join(keys))]
            if unchecked:  # a model's weights carry no digest: nothing here can tell a flipped bit
                facts.append(("not verified", ", ".join(unchecked) + " (no optimizer state; not checked)"))
            return CheckpointDescription(
                str(target), "file", "container dict", None,
                facts=tuple(facts), children=children, file_bytes=size,
            )  # fmt: skip
        return _unknown(str(target), "file", f"a dict with keys {keys}, none an optimizer state gefen knows", size)
    return _unknown(str(target), "file", f"a {type(loaded).__name__}", size)


#: How a ``torch.save`` file begins: the zip archive of torch >= 1.6, or the legacy format's
#: pickle (protocol 2) of its magic number.
_TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19")


def _starts_like_torch_save(target: Path) -> bool:
    with target.open("rb") as handle:
        head = handle.read(16)
    return any(head.startswith(magic) for magic in _TORCH_SAVE_MAGIC)


def _describe_value(value: object, path: str, size: int | None) -> CheckpointDescription | None:
    if not isinstance(value, Mapping):
        return None
    fmt = value.get("format")
    try:
        if isinstance(fmt, str) and fmt in DOCUMENT_FORMATS:
            return describe_document(value, path, size)
        if is_native_state_dict(value):
            return describe_native(value, path, size)
    except Exception as exc:  # a record too malformed for the checks to walk (any type, any nesting)
        return CheckpointDescription(
            path, "file", fmt if isinstance(fmt, str) else "optimizer state dict", None,
            problems=(Problem("record", f"malformed beyond reading: {type(exc).__name__}: {exc}"),),
            file_bytes=size,
        )  # fmt: skip
    return None


_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

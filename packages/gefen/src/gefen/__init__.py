"""gefen: memory-efficient optimizers for PyTorch and the convention that makes them shardable.

The meta-package wires the workspace packages together and re-exports their public API:

* optimizers: :class:`Gefen`, :class:`GefenMuon` (gefen-core; gefen-kernels' fast paths are
  found by themselves), :class:`GefenMuonHybrid` (:mod:`gefen.hybrid`), and from
  gefen-hybrid :class:`ContractedAdamW`, :class:`CompositeOptimizer`, :class:`RoutingRules`;
* portable state (gefen-portable): :func:`export_portable_state`, :func:`import_portable_state`
  and their composite forms;
* DCP persistence (gefen-dcp): :func:`save_portable_dcp`, :func:`load_portable_dcp`,
  :func:`async_save_portable_dcp`, :class:`GefenDCPState` and its planners and writer;
* the convention's vocabulary as :mod:`gefen.contracts` (``gefen_contracts``).

Names are resolved on first use, so ``import gefen`` (and the ``gefen`` command line) does
not import torch until an optimizer or a checkpoint function is needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import gefen_contracts as contracts

from ._version import __version__

if TYPE_CHECKING:
    from gefen_core import (
        CaptureError,
        Gefen,
        GefenMuon,
        GefenOptionError,
        GefenOptionTypeError,
        GradientError,
        ParameterError,
        ShardAgreementError,
    )
    from gefen_dcp import (
        GefenDCPState,
        GefenFileSystemWriter,
        GefenLoadPlanner,
        GefenSavePlanner,
        async_save_portable_dcp,
        load_portable_dcp,
        save_portable_dcp,
    )
    from gefen_hybrid import DEFAULT_BACKUP_SUBSTRINGS, CompositeOptimizer, ContractedAdamW, RoutingRules
    from gefen_portable import (
        PortableCompositeState,
        PortableState,
        export_portable_composite_state,
        export_portable_state,
        import_portable_composite_state,
        import_portable_state,
    )

    from .hybrid import GefenMuonHybrid

#: Re-exported name -> the module that defines it (imported on first access).
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        (
            "Gefen",
            "GefenMuon",
            "CaptureError",
            "GefenOptionError",
            "GefenOptionTypeError",
            "GradientError",
            "ParameterError",
            "ShardAgreementError",
        ),
        "gefen_core",
    ),
    "GefenMuonHybrid": "gefen.hybrid",
    **dict.fromkeys(
        ("ContractedAdamW", "CompositeOptimizer", "RoutingRules", "DEFAULT_BACKUP_SUBSTRINGS"), "gefen_hybrid"
    ),
    **dict.fromkeys(
        (
            "export_portable_state",
            "import_portable_state",
            "export_portable_composite_state",
            "import_portable_composite_state",
            "PortableState",
            "PortableCompositeState",
        ),
        "gefen_portable",
    ),
    **dict.fromkeys(
        (
            "save_portable_dcp",
            "load_portable_dcp",
            "async_save_portable_dcp",
            "GefenDCPState",
            "GefenSavePlanner",
            "GefenLoadPlanner",
            "GefenFileSystemWriter",
        ),
        "gefen_dcp",
    ),
}

__all__ = [
    "CaptureError",
    "CompositeOptimizer",
    "ContractedAdamW",
    "DEFAULT_BACKUP_SUBSTRINGS",
    "Gefen",
    "GefenDCPState",
    "GefenFileSystemWriter",
    "GefenLoadPlanner",
    "GefenMuon",
    "GefenMuonHybrid",
    "GefenOptionError",
    "GefenOptionTypeError",
    "GefenSavePlanner",
    "GradientError",
    "ParameterError",
    "PortableCompositeState",
    "PortableState",
    "RoutingRules",
    "ShardAgreementError",
    "__version__",
    "async_save_portable_dcp",
    "contracts",
    "export_portable_composite_state",
    "export_portable_state",
    "import_portable_composite_state",
    "import_portable_state",
    "load_portable_dcp",
    "save_portable_dcp",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gefen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

"""torch's state-dict hooks around an export or a load an optimizer implements itself.

``torch.optim.Optimizer.state_dict`` runs the hooks registered with
``register_state_dict_pre_hook`` and ``register_state_dict_post_hook`` (which may replace the
result), and ``load_state_dict`` those of ``register_load_state_dict_pre_hook`` (each may
replace the dict) and ``register_load_state_dict_post_hook``; an optimizer that overrides
either (its own format, a staged load, a composite) must run them the same way, or a
library's hooks are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["export_with_hooks", "load_with_hooks", "run_load_post_hooks", "run_load_pre_hooks"]


def export_with_hooks(optimizer: torch.optim.Optimizer, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``state_dict()`` as torch runs it: pre-hooks, ``build()``, post-hooks (which may replace the result)."""
    for pre_hook in list(optimizer._optimizer_state_dict_pre_hooks.values()):
        pre_hook(optimizer)
    result = build()
    for post_hook in list(optimizer._optimizer_state_dict_post_hooks.values()):
        replaced = post_hook(optimizer, result)
        if replaced is not None:
            result = replaced
    return result


def run_load_pre_hooks(optimizer: torch.optim.Optimizer, state_dict: Any) -> Any:
    """``optimizer``'s load pre-hooks, in order, over a shallow copy of ``state_dict`` (the
    caller's dict is never changed, as in torch); a hook's returned dict replaces it."""
    current = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
    for pre_hook in list(getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {}).values()):
        replaced = pre_hook(optimizer, current)
        if replaced is not None:
            current = replaced
    return current


def run_load_post_hooks(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s load post-hooks, in order."""
    for post_hook in list(getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}).values()):
        post_hook(optimizer)


def load_with_hooks(optimizer: torch.optim.Optimizer, state_dict: Any, load: Callable[[Any], None]) -> None:
    """``load_state_dict()`` as torch runs it: pre-hooks, ``load`` of what they leave, post-hooks."""
    load(run_load_pre_hooks(optimizer, state_dict))
    run_load_post_hooks(optimizer)

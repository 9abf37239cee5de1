"""``ContractedAdamW``: ``torch.optim.AdamW`` that keeps the convention.

Same constructor, same ``foreach``/``fused`` flags, same numerics (the step is torch's own
code path), plus: a published contract, an atomic staged native load, and a side-effect
free step preflight, so that it can be the backup child of a composite and refuse a bad
gradient or checkpoint before anything changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from gefen_contracts import OptimizerContract, StagedTransaction, require_transaction

from .adamw_contract import ADAMW_CONTRACT
from .adamw_state import StagedAdamWState, stage_adamw_state
from .tensor_checks import is_dtensor

__all__ = ["ContractedAdamW"]

_LOAD_KIND = "gefen.ContractedAdamW.native_load"


def _torch_adam_step() -> Callable[..., Any]:
    """``torch.optim.Adam.step`` without torch's hook wrapper.

    torch wraps an optimizer class's ``step`` with a profiler-and-hooks layer (marked
    ``hooked``) the first time the class is instantiated. ``ContractedAdamW.step`` gets that
    layer itself, so it calls the layer underneath; otherwise hooks would fire twice.
    """
    step: Any = torch.optim.Adam.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step  # type: ignore[no-any-return]


def _fused_device_check() -> Callable[[torch.Tensor], None] | None:
    try:
        from torch.optim.optimizer import _device_dtype_check_for_fused
    except ImportError:  # pragma: no cover - older or newer torch without the helper
        return None
    return _device_dtype_check_for_fused


class ContractedAdamW(torch.optim.AdamW):
    """AdamW with a contract (``"gefen.ContractedAdamW"``), ``StagedNativeLoad`` and ``StepPreflight``.

    ``step`` is bit-identical to ``torch.optim.AdamW`` with the same arguments (it runs
    torch's own implementation) but first checks every gradient, so a bad one raises before
    any parameter or state changes. ``load_state_dict`` validates the whole checkpoint before
    publishing it (torch's load is not fail-before-mutation and silently casts dtypes); see
    :mod:`gefen_hybrid.adamw_state` for what is checked. ``differentiable=True`` is refused:
    staged loads and preflights work on plain state.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if differentiable:
            raise ValueError(
                "ContractedAdamW does not support differentiable=True (staged loads and preflights need plain "
                "state); use torch.optim.AdamW for differentiable optimization"
            )
        self._version = 0
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=False,
            fused=fused,
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's __getstate__ keeps only defaults, state and param_groups (copy and pickle).
        super().__setstate__(state)
        self.__dict__.setdefault("_version", 0)

    # -- ContractProvider ----------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """The contract (constant: AdamW's claims do not depend on its configuration)."""
        return ADAMW_CONTRACT

    # -- StepPreflight and step ------------------------------------------------------------

    def preflight_step(self) -> None:
        """Raise the error ``step()`` would raise for the attached gradients; change nothing.

        Checks: sparse gradients, a gradient whose kind (DTensor or not), shape or device
        differs from its parameter, parameters the fused kernel cannot take, and a tensor
        ``lr`` with ``foreach=True`` and ``capturable=False``.
        """
        fused_check = _fused_device_check()
        for index, group in enumerate(self.param_groups):
            if group["foreach"] and isinstance(group["lr"], torch.Tensor) and not group["capturable"]:
                raise RuntimeError("lr as a Tensor is not supported for capturable=False and foreach=True")
            for parameter in group["params"]:
                grad = parameter.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("Adam does not support sparse gradients, please consider SparseAdam instead")
                if is_dtensor(grad) != is_dtensor(parameter):
                    raise RuntimeError(
                        f"param group {index}: a gradient is a {type(grad).__name__} but its parameter is a "
                        f"{type(parameter).__name__}"
                    )
                if grad.shape != parameter.shape or grad.device != parameter.device:
                    raise RuntimeError(
                        f"param group {index}: a gradient of shape {tuple(grad.shape)} on {grad.device} does not "
                        f"match its parameter ({tuple(parameter.shape)} on {parameter.device})"
                    )
                if group["fused"] and fused_check is not None and not self.state.get(parameter):
                    fused_check(parameter)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run ``closure`` (under ``enable_grad``), preflight, then torch's AdamW step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.preflight_step()
        try:
            _torch_adam_step()(self)
        finally:
            self._version += 1  # any step attempt outdates a staged load
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._version = getattr(self, "_version", 0) + 1

    # -- StagedNativeLoad -------------------------------------------------------------------

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``state_dict`` completely and stage it on fresh containers (no hooks, no mutation)."""
        staged = stage_adamw_state(self.param_groups, state_dict)
        return StagedTransaction(self, kind=_LOAD_KIND, token=self._version, payload=staged)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        """Publish a staged load; ``StaleTransactionError`` (and no change) if it is foreign,
        consumed, or this optimizer stepped, loaded or gained a group since staging."""
        payload = require_transaction(staged).claim(self, kind=_LOAD_KIND, current_token=self._version)
        assert isinstance(payload, StagedAdamWState)
        for live, new in zip(self.param_groups, payload.groups):
            live.clear()
            live.update(new)
        fresh: Any = type(self.state)()
        fresh.update(payload.state)
        self.state = fresh
        self._version += 1

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load pre-hooks, stage (full validation), commit, load post-hooks."""
        current: Mapping[str, Any] = dict(state_dict) if isinstance(state_dict, Mapping) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, current)  # type: ignore[arg-type]
            if result is not None:
                current = result
        self.commit_staged_state_dict(self.stage_state_dict(current))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

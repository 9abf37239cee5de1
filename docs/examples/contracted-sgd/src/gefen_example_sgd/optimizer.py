"""``ContractedSGD``: SGD with momentum that publishes a contract and loads atomically."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from gefen_contracts import OptimizerContract, StateValidationError
from gefen_contracts.transactions import StagedTransaction

from .contract import CONTRACT

__all__ = ["ContractedSGD", "conformance_factory"]

_OPTIONS = ("lr", "momentum", "weight_decay")


class ContractedSGD(torch.optim.Optimizer):
    """``p -= lr * buf`` with ``buf = momentum * buf + g`` (``g`` includes weight decay).

    Implements the convention's ``ContractProvider`` and ``StagedNativeLoad`` Protocols.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if type(value) is not float or not math.isfinite(value) or value < 0:
                raise ValueError(f"ContractedSGD: {name} must be a finite float >= 0, got {value!r}")
        if momentum >= 1.0:
            raise ValueError(f"ContractedSGD: momentum must be < 1, got {momentum}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self._version = 0

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch pickles (and deep-copies) only defaults, state and groups: a copy counts anew
        super().__setstate__(state)
        self._version = 0

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if "_version" in self.__dict__:  # torch's __init__ adds the first groups before the counter exists
            self._version += 1  # a load staged before this group no longer matches the groups

    def optimizer_contract(self) -> OptimizerContract:
        return CONTRACT

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                if group["weight_decay"]:
                    grad = grad + group["weight_decay"] * p.float()
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = grad.clone()
                    state["step"] = 0
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(grad)
                state["step"] += 1
                p.add_((state["momentum_buffer"] * -group["lr"]).to(p.dtype))
        self._version += 1
        return loss

    # -- StagedNativeLoad -------------------------------------------------------------

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``state_dict`` completely and stage the new state (nothing mutated)."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            raise StateValidationError("ContractedSGD state dict must have exactly the keys 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if type(groups) is not list or len(groups) != len(self.param_groups):
            raise StateValidationError(f"expected {len(self.param_groups)} param groups")
        # ids are matched by position: ints from state_dict(), parameter names from torch's
        # get_optimizer_state_dict (which re-keys the state by name)
        id_to_param: dict[int | str, torch.Tensor] = {}
        new_groups = []
        for index, (saved, live) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or any(key not in saved for key in ("params", *_OPTIONS)):
                raise StateValidationError(f"param group {index} must hold 'params' and the options {list(_OPTIONS)}")
            ids = saved["params"]
            if type(ids) is not list or len(ids) != len(live["params"]) or any(type(i) not in (int, str) for i in ids):
                raise StateValidationError(
                    f"param group {index} must list {len(live['params'])} parameter ids (ints, or parameter names)"
                )
            for option in _OPTIONS:
                value = saved[option]
                if type(value) is not float or not math.isfinite(value) or value < 0:
                    raise StateValidationError(f"param group {index} option {option!r} must be a finite float >= 0")
            for pid, param in zip(ids, live["params"]):
                if pid in id_to_param:
                    raise StateValidationError(f"parameter id {pid} appears twice")
                id_to_param[pid] = param
            # other saved keys (a scheduler's ``initial_lr``) come along, as torch's load carries them
            extra = {k: copy.deepcopy(v) for k, v in saved.items() if k not in ("params", *_OPTIONS)}
            new_groups.append({**live, **extra, **{k: saved[k] for k in _OPTIONS}})
        saved_state = state_dict["state"]
        if not isinstance(saved_state, Mapping):
            raise StateValidationError("'state' must be a mapping")
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for pid, entry in saved_state.items():
            param = id_to_param.get(pid) if type(pid) in (int, str) else None
            if param is None:
                raise StateValidationError(f"state entry {pid!r} names no parameter")
            if not isinstance(entry, Mapping) or set(entry) != {"momentum_buffer", "step"}:
                raise StateValidationError(f"state of parameter {pid} must hold exactly momentum_buffer and step")
            buf, step = entry["momentum_buffer"], entry["step"]
            if type(step) is not int or step < 1:
                raise StateValidationError(f"step of parameter {pid} must be an int >= 1")
            if not isinstance(buf, torch.Tensor) or buf.dtype is not torch.float32 or buf.shape != param.shape:
                raise StateValidationError(
                    f"momentum_buffer of parameter {pid} must be float32 of shape {tuple(param.shape)}"
                )
            if not torch.isfinite(buf).all():
                raise StateValidationError(f"momentum_buffer of parameter {pid} is not finite")
            new_state[param] = {"momentum_buffer": buf.detach().to(param.device, copy=True), "step": step}
        return StagedTransaction(self, kind="native_load", token=self._version, payload=(new_groups, new_state))

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        payload = staged.claim(self, kind="native_load", current_token=self._version)
        groups: list[dict[str, Any]]
        state: dict[torch.Tensor, dict[str, Any]]
        groups, state = payload  # type: ignore[misc]
        for live, new in zip(self.param_groups, groups):
            live.update(new)
        # torch's state is a defaultdict(dict): a parameter without saved state gets an entry at its step
        self.state = defaultdict(dict, state)
        self._version += 1

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, dict(state_dict))
            if result is not None:
                state_dict = result
        self.commit_staged_state_dict(self.stage_state_dict(state_dict))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def conformance_factory(named_parameters: list[tuple[str, torch.nn.Parameter]]) -> ContractedSGD:
    """The conformance kit's factory for this optimizer."""
    return ContractedSGD([p for _, p in named_parameters], lr=0.05, momentum=0.9, weight_decay=0.01)

"""Plumbing shared by Gefen and GefenMuon: the native checkpoint role (torch's state-dict hooks
around our own formats, the staged load), pickling of the optimizer's own attributes, and
per-device copies of the codebook."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from gefen_contracts import StateValidationError
from gefen_contracts.torch_support import export_with_hooks, load_with_hooks, local_tensor
from gefen_contracts.transactions import StagedTransaction
from torch._compile import _disable_dynamo

from .identity import pickled_identity, restore_identity, verify_layout

__all__ = [
    "NativeCheckpoint",
    "OwnAttributesPickling",
    "codebook_on",
    "publish_groups_and_state",
    "run_eagerly",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def run_eagerly(method: _F) -> _F:
    """Exclude a method from TorchDynamo tracing: ``torch.compile`` then calls it eagerly (one
    graph break, at the call). Traced, GefenMuon's step applied one matrix's update to
    another: TorchDynamo (torch 2.15) names a parameter by the ``param_groups`` path it read
    first and guards only that path, not the work item it reached the parameter through, so a
    frame resumed after a graph break and compiled for one item runs for the next
    (``test_dynamo_guards_a_parameter_reached_through_a_work_item`` is the canary), so its step
    is excluded.
    Gefen's step traces correctly (its kernels are torch custom ops, bit for bit with eager),
    but with Python-float learning rates and int counters Dynamo guards on their values and
    recompiles at every change (``param_groups[0]['lr'] == 0.0033...`` under a schedule; torch
    2.15): ``Gefen.step`` runs this eager path unless ``Gefen.traceable()`` (``capturable=True``
    and tensor learning rates)."""
    # torch.optim's lazy form of ``torch.compiler.disable``: TorchDynamo (2-4 s of imports) is
    # imported at the first call, not with gefen-core, so `gefen --help` or `gefen inspect`, which
    # build no optimizer (torch's add_param_group imports it), never import it
    return cast(_F, _disable_dynamo(method))


class OwnAttributesPickling:
    """Mixin (before ``torch.optim.Optimizer``): pickling and ``copy.deepcopy`` keep the
    attributes named in ``_OWN_ATTRIBUTES``, which torch's ``__getstate__`` drops, and the
    sealed layout, as its tensor-free record rebuilt around the copied tensors."""

    _OWN_ATTRIBUTES: tuple[str, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()  # type: ignore[assignment]
        state["_gefen"] = {name: getattr(self, name) for name in self._OWN_ATTRIBUTES}
        state["_identity_record"] = pickled_identity(self)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        own = dict(state.pop("_gefen", {}))
        record = state.pop("_identity_record", None)
        super().__setstate__(state)  # type: ignore[misc]
        for name, value in own.items():
            setattr(self, name, value)
        restore_identity(self, record)


def codebook_on(codebook: torch.Tensor, copies: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The CPU codebook itself on CPU, else its cached copy on ``device`` (made on first use)."""
    if device.type == "cpu":
        return codebook
    copy = copies.get(device)
    if copy is None:
        copy = codebook.to(device)
        copies[device] = copy
    return copy


def publish_groups_and_state(
    optimizer: torch.optim.Optimizer,
    groups: Sequence[dict[str, Any]],
    state: Mapping[torch.Tensor, dict[str, Any]],
) -> None:
    """Swap staged group contents and per-parameter state in (the live group dicts keep their
    identity, so schedulers holding them see the new values). Cannot raise."""
    for live, new in zip(optimizer.param_groups, groups):
        live.clear()
        live.update(new)
    fresh: defaultdict[torch.Tensor, Any] = defaultdict(dict)
    fresh.update(state)
    optimizer.state = fresh


def _staleness_token(optimizer: Any) -> tuple[int, int]:
    """What a staged native load must find unchanged at its commit: the optimizer's version and
    its global step (a traced capturable step advances only the device count, which
    ``global_step`` reads)."""
    return optimizer._version, optimizer.global_step


_WRITTEN_BEFORE = (
    "Its tensors are this optimizer's live state. If they came from torch's get_optimizer_state_dict as the "
    "template of a dcp.load, the load wrote the checkpoint into them before set_optimizer_state_dict could check "
    "anything, so the optimizer may hold part of the refused checkpoint: load a valid one, or build the optimizer "
    "anew, before stepping"
)


def _holds_live_tensors(optimizer: Any, state_dict: object) -> bool:
    """Whether a state dict's per-parameter tensors share memory with the optimizer's live state."""
    live = {
        local_tensor(value).data_ptr()
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor) and value.numel()
    }
    entries = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not live or not isinstance(entries, Mapping):
        return False
    return any(
        isinstance(value, torch.Tensor) and value.numel() and local_tensor(value).data_ptr() in live
        for entry in entries.values()
        if isinstance(entry, Mapping)
        for value in entry.values()
    )


@dataclass(frozen=True, slots=True)
class NativeCheckpoint:
    """The native ``state_dict`` role of Gefen and GefenMuon, written once: torch's hooks around
    the optimizer's own format, the shard-identity guard of a bound layout, and the staged load
    (validate everything into a payload, then publish it by swaps that cannot raise). Each
    optimizer owns one (its ``_native``); its four checkpoint methods delegate to it, and its
    canonical local state stages and publishes through it. It holds no state of its own."""

    #: The kind of the staged transactions it returns.
    kind: str
    #: ``optimizer -> native state dict`` (without the identity guard).
    export: Callable[[Any], dict[str, Any]]
    #: ``(optimizer, state dict without the guard) -> payload``; raises ``StateValidationError``.
    stage: Callable[[Any, Mapping[str, Any]], Any]
    #: ``(optimizer, payload) -> None``: swap a staged payload in; cannot raise.
    publish: Callable[[Any, Any], None]

    def state_dict(self, optimizer: Any) -> dict[str, Any]:
        def build() -> dict[str, Any]:
            verify_layout(optimizer, "state_dict")
            return optimizer._identity_binding.guard(self.export(optimizer))  # type: ignore[no-any-return]

        return export_with_hooks(optimizer, build)

    def stage_state_dict(self, optimizer: Any, state_dict: Mapping[str, Any]) -> StagedTransaction:
        verify_layout(optimizer, "load_state_dict")
        unguarded = optimizer._identity_binding.unguard(state_dict)
        try:
            payload = self.stage(optimizer, unguarded)
        except StateValidationError as exc:
            # a refusal changes nothing, but torch's recipe hands dcp.load views of the live state
            # as its template, so the checkpoint is in the live tensors before this load is called
            if exc.args and isinstance(exc.args[0], str) and _holds_live_tensors(optimizer, unguarded):
                exc.args = (f"{exc.args[0]}. {_WRITTEN_BEFORE}", *exc.args[1:])
            raise
        return StagedTransaction(optimizer, kind=self.kind, token=_staleness_token(optimizer), payload=payload)

    def commit_staged_state_dict(self, optimizer: Any, staged: StagedTransaction) -> None:
        verify_layout(optimizer, "load_state_dict")
        self.publish(optimizer, staged.claim(optimizer, kind=self.kind, current_token=_staleness_token(optimizer)))

    def load_state_dict(self, optimizer: Any, state_dict: Mapping[str, Any]) -> None:
        load_with_hooks(
            optimizer, state_dict, lambda sd: optimizer.commit_staged_state_dict(optimizer.stage_state_dict(sd))
        )

"""``ContractedAdamW``: ``torch.optim.AdamW`` that keeps the convention.

Same constructor, same ``foreach``/``fused`` flags, same numerics (the step is torch's own
code path), plus: a published (dynamic) contract, an atomic staged native load, a side-effect
free step preflight, post-sharding identity binding with a sealed layout, canonical local
state documents, portable state and parameter-shaped (DCP) checkpoints, so that it can be the
backup child of a composite and refuse a bad gradient, checkpoint or layout change before
anything changes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_LOCAL_STATE,
    ContractError,
    FeatureStatus,
    LayoutTamperedError,
    NotSupportedError,
    OptimizerContract,
    StateValidationError,
)
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.exchange import PortableExport, PortableLayout, PortableSlotState
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import (
    IdentityBinding,
    SealedLayout,
    check_new_group,
    check_tensor_lr,
    group_params,
    load_with_hooks,
    state_version_token,
)
from gefen_contracts.torch_support.option_records import option_blockers
from gefen_contracts.transactions import StagedTransaction, require_transaction

from . import adamw_exchange
from .adamw_canonical import export_adamw_document, native_state_from_document
from .adamw_contract import FRESH_READINESS, AdamWReadiness, adamw_contract
from .adamw_portable import portable_blockers
from .adamw_records import NOT_OPTIONS
from .adamw_state import StagedAdamWState, is_rate, runs_foreach, stage_adamw_state
from .tensor_checks import is_dtensor

__all__ = ["ContractedAdamW"]

_LOAD_KIND = "gefen.ContractedAdamW.native_load"
_IMPORT_KIND = "gefen.ContractedAdamW.local_import"


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


def _check_options(group: Mapping[str, Any], index: int) -> None:
    """The group's rates are numbers or 1-element tensors, and the numbers (not the tensors:
    reading one would synchronise the device every step) in torch's constructor's ranges."""
    for key in ("lr", "eps", "weight_decay"):
        if not is_rate(group[key]):
            raise TypeError(
                f"param_groups[{index}]['{key}'] must be a real number or a 1-element tensor, got {group[key]!r}"
            )
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(is_rate(b) for b in betas):
        raise TypeError(f"param_groups[{index}]['betas'] must be two real numbers or 1-element tensors, got {betas!r}")
    for where, value, upper in (
        ("['lr']", group["lr"], None),
        ("['eps']", group["eps"], None),
        ("['weight_decay']", group["weight_decay"], None),
        ("['betas'][0]", betas[0], 1.0),
        ("['betas'][1]", betas[1], 1.0),
    ):
        # torch checks these only when the optimizer is built; a group added or edited later with
        # beta >= 1 divided by zero or went NaN in the arithmetic, after the groups before it stepped
        if not isinstance(value, torch.Tensor) and not (value >= 0.0 and (upper is None or value < upper)):
            bound = f"in [0, {upper:g})" if upper is not None else ">= 0"
            raise ValueError(f"param_groups[{index}]{where} must be {bound}, got {value!r}")


#: The layouts ``post_sharding`` binds: AdamW is elementwise, so a flattened element shard
#: trains exactly like the same elements of the full tensor.
BINDABLE_LAYOUTS = frozenset({ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD})


def _check_layout(shard: ShardIdentity, target: torch.Tensor | None) -> None:
    if shard.layout not in BINDABLE_LAYOUTS:
        allowed = ", ".join(sorted(layout.value for layout in BINDABLE_LAYOUTS))
        raise ContractError(
            f"post_sharding: ContractedAdamW binds {allowed} shards; {shard.fqn!r} is {shard.layout.value}"
        )


def _state_blockers(state: Mapping[Any, Any]) -> tuple[str, ...]:
    # AdamW creates all of a parameter's state at its first step: pristine means none has any
    stepped = sum(1 for entry in state.values() if entry)
    if stepped:
        return (
            f"{stepped} parameter(s) already have AdamW state: post_sharding binds a pristine optimizer, "
            "before its first step",
        )
    return ()


def _fused_device_check() -> Callable[[torch.Tensor], None] | None:
    try:
        from torch.optim.optimizer import _device_dtype_check_for_fused
    except ImportError:  # pragma: no cover - older or newer torch without the helper
        return None
    return _device_dtype_check_for_fused


class ContractedAdamW(torch.optim.AdamW):
    """AdamW with a contract (``"gefen.ContractedAdamW"``) implementing ``StagedNativeLoad``,
    ``StepPreflight``, ``IdentityBindable``, ``CanonicalLocalState``, ``PortableAdapter`` and
    ``ParameterShapedState``.

    ``step`` is bit-identical to ``torch.optim.AdamW`` with the same arguments (it runs
    torch's own implementation) but first checks every gradient, so a bad one raises before
    any parameter or state changes. ``load_state_dict`` validates the whole checkpoint before
    publishing it (torch's load is not fail-before-mutation and silently casts dtypes); see
    :mod:`gefen_hybrid.adamw_state` for what is checked. ``differentiable=True`` is refused:
    staged loads and preflights work on plain state.

    ``post_sharding`` binds every slot of a pristine optimizer to its live local tensor
    (``REPLICATED`` or ``FLATTENED_ELEMENT_SHARD``) in one transaction and seals the layout:
    afterwards ``add_param_group`` and a second ``post_sharding`` raise, and ``step`` (before
    and after the closure), ``preflight_step``, ``state_dict``, loads and canonical state
    verify the sealed layout in O(local parameters) and raise ``LayoutTamperedError`` before
    any mutation if public containers were changed. ``export_local_state`` /
    ``prepare_local_import`` / ``commit_local_import`` move FQN-keyed ``gefen.bound_state``
    documents (see :mod:`gefen_hybrid.adamw_canonical`). Portable state
    (:mod:`gefen_hybrid.adamw_portable`) works on the sealed layout or, before
    ``post_sharding``, on an implicit ungrouped replicated layout keyed by torch's parameter
    names; its native state (torch's AdamW state) is shaped like plain and DTensor (FSDP2)
    parameters, so ``gefen_dcp.GefenDCPState`` and torch's DCP recipe reshard it.
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
        # torch's AdamW indexes betas[1] before checking it is a pair (an IndexError for (0.9,))
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self._version = 0
        self._identity_binding = IdentityBinding("ContractedAdamW", _check_layout)
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

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults, state and param_groups; the sealed layout travels as its
        # tensor-free record and is rebuilt around the copied tensors.
        state: dict[str, Any] = super().__getstate__()
        binding = self.__dict__.get("_identity_binding")
        state["_identity_record"] = None if binding is None else binding.record()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        record = state.pop("_identity_record", None)
        super().__setstate__(state)
        self.__dict__.setdefault("_version", 0)
        self._identity_binding = IdentityBinding("ContractedAdamW", _check_layout)
        self._identity_binding.restore(self, record)

    # -- ContractProvider ----------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """The contract for the live optimizer (identity and canonical claims are dynamic).

        Cheap: O(local parameters), no collectives, nothing mutated.
        """
        return adamw_contract(self._readiness())

    def _readiness(self) -> AdamWReadiness:
        sealed = self._identity_binding.sealed
        layouts: frozenset[ParameterLayout] = frozenset()
        if sealed is None:
            blockers = _state_blockers(self.state)
            post = FeatureStatus.no(*blockers) if blockers else FeatureStatus.yes()
            identity, canonical = FRESH_READINESS.identity, FRESH_READINESS.canonical
        else:
            layouts = frozenset(shard.layout for _, shard in sealed.bindings)
            try:
                sealed.verify(self.param_groups, self.state, where="optimizer_contract")
            except LayoutTamperedError as exc:
                broken = FeatureStatus.no(str(exc))
                return AdamWReadiness(FeatureStatus.yes(), broken, broken, layouts, broken, broken)
            options = option_blockers(self.param_groups, "canonical", excluded=NOT_OPTIONS, tensors=True)
            post, identity = FeatureStatus.yes(), FeatureStatus.yes()
            canonical = FeatureStatus.no(*options) if options else FeatureStatus.yes()
        portable = portable_blockers(self.param_groups, sealed)
        shaped = (
            FeatureStatus.no(
                "flattened element shards hold state for a slice of the flattened parameter, which no DTensor "
                "describes; checkpoint them as portable state (gefen_dcp.save_portable_dcp)"
            )
            if ParameterLayout.FLATTENED_ELEMENT_SHARD in layouts
            else FeatureStatus.yes()
        )
        return AdamWReadiness(
            post,
            identity,
            canonical,
            layouts,
            FeatureStatus.no(*portable) if portable else FeatureStatus.yes(),
            shaped,
        )

    def _verify_layout(self, where: str) -> None:
        """Raise ``LayoutTamperedError`` if the sealed layout was changed (no-op before post_sharding)."""
        self._identity_binding.verify(self, where)

    def _freshness(self) -> Hashable:
        """The freshness token of prepared transactions: this optimizer's mutation counter, the
        state object, and the version counters of every parameter, option and state value."""
        return (self._version, id(self.state), state_version_token(self.param_groups, self.state))

    # -- StepPreflight and step ------------------------------------------------------------

    def preflight_step(self) -> None:
        """Raise the error ``step()`` would raise for the attached gradients; change nothing.

        Checks: each group's ``lr``, ``eps`` and ``weight_decay`` a real number or a 1-element
        tensor and ``betas`` two of them, the numbers in the ranges torch's constructor allows
        (torch's step raises for a ``None`` or divides by a zero bias correction only in its
        arithmetic, after the groups before it stepped: a composite with this backup would step
        its other child first), ``amsgrad`` turned on after a parameter's first step (torch's
        step raises a ``KeyError`` for its missing ``max_exp_avg_sq``), sparse gradients, a gradient whose kind (DTensor or not), shape, dtype or
        device differs from its parameter, state whose shape no longer matches its (resized)
        parameter, parameters the fused kernel cannot take, a tensor ``lr`` on a device that
        is neither the CPU nor the parameters', a tensor ``lr`` with ``foreach=True`` and
        ``capturable=False``, and an unfused ``capturable=True`` group on a device torch cannot
        capture on (torch asserts that only after creating the state; its fused kernel takes any
        device); first of all, the sealed layout.
        """
        from torch.optim.optimizer import _get_capturable_supported_devices

        self._verify_layout("step")
        fused_check = _fused_device_check()
        capturable_devices = _get_capturable_supported_devices()
        for index, group in enumerate(self.param_groups):
            _check_options(group, index)
            if not group["capturable"] and runs_foreach(group, group["lr"]):
                # torch's multi-tensor Adam refuses these only after stepping the groups before
                if isinstance(group["lr"], torch.Tensor):
                    raise RuntimeError("lr as a Tensor is not supported for capturable=False and foreach=True")
                for beta, value in zip(("beta1", "beta2"), group["betas"]):
                    if isinstance(value, torch.Tensor):
                        raise ValueError(f"{beta} as a Tensor is not supported for capturable=False and foreach=True")
            check_tensor_lr(group["lr"], group["params"], f"param_groups[{index}]")
            for parameter in group["params"]:
                state = self.state.get(parameter)
                if group["amsgrad"] and state and parameter.grad is not None and "max_exp_avg_sq" not in state:
                    raise RuntimeError(
                        f"param group {index}: amsgrad was turned on after a parameter's first step, and its state "
                        "has no max_exp_avg_sq (set amsgrad before the first step, or build a new optimizer)"
                    )
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    held = state.get(key) if state else None
                    if isinstance(held, torch.Tensor) and held.shape != parameter.shape:
                        raise RuntimeError(
                            f"param group {index}: a parameter of shape {tuple(parameter.shape)} holds {key} of "
                            f"shape {tuple(held.shape)} (was it resized after its first step?)"
                        )
                    if (
                        isinstance(held, torch.Tensor)
                        and parameter.grad is not None  # torch never reads the state of one without
                        and (held.dtype != parameter.dtype or held.device != parameter.device)
                    ):
                        # torch's step fails on it in its arithmetic, after earlier groups stepped
                        raise RuntimeError(
                            f"param group {index}: a {parameter.dtype} parameter on {parameter.device} holds {key} "
                            f"as {held.dtype} on {held.device} (the model moved to another dtype or device after "
                            "its first step; move the model before the first step, or build a new optimizer)"
                        )
                grad = parameter.grad
                if grad is None:
                    continue
                if grad.dtype != parameter.dtype:
                    raise RuntimeError(
                        f"param group {index}: a {grad.dtype} gradient does not match its {parameter.dtype} parameter"
                    )
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
                # every parameter, state or not: a loaded state does not make a complex one fusable
                if group["fused"] and fused_check is not None:
                    fused_check(parameter)
                # torch asserts the device in its single-tensor and foreach paths only (the fused
                # kernel takes any), and dynamo traces every group as capturable: not then
                if (
                    group["capturable"]
                    and not group["fused"]
                    and parameter.device.type not in capturable_devices
                    and not torch.compiler.is_compiling()
                ):
                    raise RuntimeError(
                        f"param group {index}: capturable=True needs parameters on {sorted(capturable_devices)}, "
                        f"got one on {parameter.device}"
                    )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Verify the sealed layout, run ``closure`` (under ``enable_grad``), preflight (which
        verifies the layout again), then torch's AdamW step."""
        loss = None
        if closure is not None:
            self._verify_layout("step")
            with torch.enable_grad():
                loss = closure()
        self.preflight_step()
        try:
            _torch_adam_step()(self)
        finally:
            self._version += 1  # any step attempt outdates a staged load
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; refused (``RuntimeError``) once ``post_sharding`` sealed the layout."""
        binding = getattr(self, "_identity_binding", None)  # torch's __init__ adds the first groups
        if binding is not None:
            binding.refuse_new_group()
        if isinstance(param_group, dict) and "params" in param_group:
            params = param_group["params"]
            listed = group_params(params)
            lr = param_group.get("lr", self.defaults.get("lr"))
            check_new_group(
                listed, len(self.param_groups), self.param_groups, lr, param_names=param_group.get("param_names")
            )
            param_group["params"] = listed  # the caller's dict is the group, as torch registers it
        super().add_param_group(param_group)
        self._version = getattr(self, "_version", 0) + 1

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict`` after verifying the sealed layout; once bound by
        ``post_sharding``, with the shard-identity guard (``IDENTITY_KEY``) of the convention."""
        self._verify_layout("state_dict")
        return self._identity_binding.guard(super().state_dict())

    # -- StagedNativeLoad -------------------------------------------------------------------

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``state_dict`` completely and stage it on fresh containers (no hooks, no mutation)."""
        self._verify_layout("load_state_dict")
        unguarded = self._identity_binding.unguard(state_dict)
        if not isinstance(unguarded, Mapping):
            raise StateValidationError(f"a state dict must be a mapping, got {type(unguarded).__name__}")
        staged = stage_adamw_state(self.param_groups, unguarded)
        return StagedTransaction(self, kind=_LOAD_KIND, token=self._version, payload=staged)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        """Publish a staged load; ``StaleTransactionError`` (and no change) if it is foreign,
        consumed, or this optimizer stepped, loaded or gained a group since staging."""
        self._verify_layout("load_state_dict")
        payload = require_transaction(staged).claim(self, kind=_LOAD_KIND, current_token=self._version)
        assert isinstance(payload, StagedAdamWState)
        self._publish_state(payload)

    def _publish_state(self, payload: StagedAdamWState) -> None:
        # Swaps that cannot raise: group dicts updated in place (str keys), state replaced.
        for live, new in zip(self.param_groups, payload.groups):
            live.clear()
            live.update(new)
        fresh: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        fresh.update(payload.state)
        self.state = fresh
        self._version += 1

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load pre-hooks, stage (full validation), commit, load post-hooks."""
        load_with_hooks(self, state_dict, lambda loaded: self.commit_staged_state_dict(self.stage_state_dict(loaded)))

    # -- IdentityBindable -------------------------------------------------------------------

    def prepare_post_sharding(
        self,
        rebindings: Sequence[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        scope: object | None = None,
    ) -> StagedTransaction:
        """Validate a post-sharding request and stage the new layout (nothing mutated).

        Raises ``RuntimeError`` if already finalized, ``NotSupportedError`` if a parameter
        already has state (not pristine) or a ``scope`` is given (AdamW has no collective
        scope), and the ``ContractError``/``ContractTypeError``/``RuntimeError`` of
        ``plan_rebinding`` for an invalid request; layouts other than ``REPLICATED`` and
        ``FLATTENED_ELEMENT_SHARD`` are refused.
        """
        return self._identity_binding.prepare(
            self,
            rebindings,
            manifest=manifest,
            scope=scope,
            blockers=_state_blockers(self.state),
            token=self._freshness(),
        )

    def commit_post_sharding(self, staged: StagedTransaction) -> None:
        """Publish a staged binding by swaps that cannot raise, and seal the layout.

        ``StaleTransactionError`` (nothing changed) for a foreign, consumed or stale
        transaction (this optimizer, its parameters, options or state changed since prepare).
        """
        self._identity_binding.commit(self, staged, token=self._freshness())
        self._version += 1

    def post_sharding(
        self,
        rebindings: Sequence[ParameterRebinding],
        *,
        manifest: ShardingManifest,
        scope: object | None = None,
    ) -> None:
        """``prepare_post_sharding`` then ``commit_post_sharding``."""
        self.commit_post_sharding(self.prepare_post_sharding(rebindings, manifest=manifest, scope=scope))

    def sharding_manifest(self) -> ShardingManifest | None:
        """The finalized manifest (``None`` before ``post_sharding``); verifies the layout first."""
        return self._identity_binding.manifest(self)

    def shard_bindings(self) -> tuple[tuple[Any | None, ShardIdentity], ...]:
        """``(tensor, shard)`` for every local slot, sorted by ``sort_key`` (``()`` before post_sharding)."""
        return self._identity_binding.bindings(self)

    def shard_identity(self, parameter: Any) -> ShardIdentity:
        """The shard bound to ``parameter`` (``KeyError`` for an unbound tensor or before post_sharding)."""
        return self._identity_binding.shard_identity(self, parameter)

    # -- PortableAdapter (:mod:`gefen_hybrid.adamw_exchange`) -----------------------------------

    def portable_layout(self) -> PortableLayout:
        """The local target layout: the sealed one after ``post_sharding``, else one ungrouped
        ``REPLICATED`` shard per parameter keyed by its torch name (no state, no collective)."""
        return adamw_exchange.portable_layout(self)

    def portable_export(self) -> PortableExport:
        """Every local slot's options, variant, ``step`` and fp32 moments (fresh CPU copies)."""
        return adamw_exchange.portable_export(self)

    def portable_prepare_import(
        self,
        *,
        implementation: str,
        policy: Mapping[str, Any],
        common: Mapping[str, Any],
        slots: Sequence[PortableSlotState],
    ) -> StagedTransaction:
        """Validate records projected onto ``portable_layout().slots`` and stage them (no mutation)."""
        return adamw_exchange.portable_prepare_import(
            self, implementation=implementation, policy=policy, common=common, slots=slots
        )

    def portable_commit_import(self, staged: StagedTransaction) -> None:
        """Publish a prepared portable import by swaps that cannot raise (single use)."""
        adamw_exchange.portable_commit_import(self, staged)

    # -- CanonicalLocalState ----------------------------------------------------------------

    def _require_canonical(self, where: str) -> SealedLayout:
        self._verify_layout(where)
        status = self._readiness().canonical
        sealed = self._identity_binding.sealed
        if not status.supported or sealed is None:
            raise NotSupportedError(FEATURE_CANONICAL_LOCAL_STATE, status.reasons)
        return sealed

    def export_local_state(self) -> dict[str, Any]:
        """This optimizer's ``gefen.bound_state`` document (owned, tight, finite CPU copies; no collectives).

        ``NotSupportedError`` before ``post_sharding``; ``StateValidationError`` for state
        that cannot be exported (non-finite, a fractional step).
        """
        sealed = self._require_canonical("export_local_state")
        return export_adamw_document(self.param_groups, self.state, sealed)

    def prepare_local_import(self, document: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``document`` fully and stage it, routed by FQN into this optimizer's own groups.

        Never mutates the optimizer or the document; no hooks run. ``StateValidationError``
        names the first problem (envelope, manifest, another member's shard, variants,
        dtypes, shapes, finiteness, options); see :mod:`gefen_hybrid.adamw_canonical`.
        """
        sealed = self._require_canonical("prepare_local_import")
        native = native_state_from_document(self.param_groups, sealed, document)
        staged = stage_adamw_state(self.param_groups, native)
        return StagedTransaction(self, kind=_IMPORT_KIND, token=self._freshness(), payload=staged)

    def commit_local_import(self, staged: StagedTransaction) -> None:
        """Publish a prepared import (single use; ``StaleTransactionError`` and no change for a
        foreign, consumed or stale one: the optimizer stepped, loaded, or a parameter, option
        or state value changed since preparation). Hooks are bypassed."""
        self._verify_layout("commit_local_import")
        payload = require_transaction(staged).claim(self, kind=_IMPORT_KIND, current_token=self._freshness())
        assert isinstance(payload, StagedAdamWState)
        self._publish_state(payload)

"""``GefenMuon``: Muon whose momentum is stored at about one byte per parameter.

See the package README for the algorithm. This module owns the optimizer object:
construction, the step's orchestration (entry checks, preflight, votes), checkpoints and the
contract; the execution of a planned step (codebook learning, the local, exact, approx,
batched and distributed paths) lives in :mod:`gefen_core.muon_execution`, the numerics in
:mod:`gefen_core.muon_update` and the modules it calls, the collectives in
:mod:`gefen_core.muon_distributed` and :mod:`gefen_core.muon_owners`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from gefen_contracts import OptimizerContract
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.torch_support import check_new_group, forget_scaler_state, group_params

from . import muon_execution
from .amp import has_fp16_gradients, unscale_gradients
from .batched_newton_schulz import DEFAULT_WORKSPACE_BYTES
from .convention_methods import ConventionMethods
from .errors import GefenOptionError, GefenOptionTypeError
from .identity import IdentityRecord, bound_layout, identity_binding, identity_readiness, verify_layout
from .muon_binding import CANONICAL, MuonBinding
from .muon_contract import IMPLEMENTATION, mode_tag, muon_contract
from .muon_distributed import MuonScope, ScopeEntry, agree_step, vote
from .muon_exchange import live_muon_piece, muon_native_from_records
from .muon_native_state import (
    StagedMuonState,
    muon_state_dict,
    parameter_shaped_status,
    slot_layouts,
    stage_muon_state_dict,
)
from .muon_options import MUON_GROUP_OPTIONS, normalize_muon_options
from .muon_plan import MuonPlan, check_entry, check_matrix
from .native_records import GROUP_MIRROR
from .newton_schulz import DEFAULT_COEFFICIENTS, normalize_coefficients
from .ops import MUON_DISPATCHED_OPS, Kernels
from .optimizer_support import (
    NativeCheckpoint,
    OwnAttributesPickling,
    publish_groups_and_state,
    run_eagerly,
)
from .param_groups import optimizer_wide, placed, refuse_optimizer_wide
from .portable_adapter import PortableRole
from .scoped_step import scoped_step

__all__ = ["PORTABLE", "GefenMuon"]


_NATIVE_LOAD = "gefen.muon_native_load"
#: GefenMuon's portable adapter role (its ``portable_*`` methods delegate to it).
PORTABLE = PortableRole(
    "gefen.GefenMuon",
    "matrix(es)",
    frozenset({ParameterLayout.REPLICATED, ParameterLayout.WHOLE_PARAMETER_OWNER}),
    live_muon_piece,
    muon_native_from_records,
)


def _export_native(optimizer: GefenMuon) -> dict[str, Any]:
    return muon_state_dict(
        optimizer.param_groups,
        optimizer.state,
        codebook=optimizer._codebook,
        global_step=optimizer._global_step,
        deterministic=optimizer._deterministic,
    )


def _stage_native(optimizer: GefenMuon, state_dict: Mapping[str, Any]) -> StagedMuonState:
    return stage_muon_state_dict(
        state_dict,
        param_groups=optimizer.param_groups,
        live_state=optimizer.state,
        deterministic=optimizer._deterministic,
    )


def _publish_native(optimizer: GefenMuon, payload: StagedMuonState) -> None:
    publish_groups_and_state(optimizer, payload.groups, payload.state)
    optimizer._codebook = payload.codebook
    optimizer._codebook_copies = {}
    optimizer._global_step = payload.global_step
    optimizer._version += 1


class GefenMuon(
    ConventionMethods,
    OwnAttributesPickling,
    torch.optim.Optimizer,
):
    """Muon (momentum, Newton-Schulz orthogonalisation, a shape-scaled step) for 2-D matrices,
    with the momentum stored as uint8 codes into one learned 256-entry codebook plus one fp32
    scale per block (Gefen's codec): about 1 byte of state per parameter instead of 4.

    Args:
        params: 2-D tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or group dicts.
        lr, weight_decay, momentum, nesterov: as in ``torch.optim.Muon`` (decoupled decay with
            the unscaled ``lr``; ``lr`` may be a 1-element tensor).
        ns_coefficients, ns_steps, eps: the Newton-Schulz quintic, its repetitions and the floor
            of the input normalisation (an explicit list of triples is a schedule).
        ns_schedule: ``None``/``"standard"``, ``"tuned3"``, ``"tuned4"`` or a list of triples.
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, rows/cols))``),
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(rows, cols))``) or ``"spectral_unclamped"``
            (``sqrt(rows/cols)``), as ``torch.optim.Muon`` has them.
        fused: ``None`` runs the kernels registered for the parameters' device (else the reference),
            ``True`` requires one, ``False`` always runs the PyTorch reference.
        sharded_mode: ``"exact"``, ``"approx"`` or ``"distributed"`` for FSDP2 ``Shard(0)``
            DTensors (see :mod:`gefen_core.muon_distributed`).
        fp8_ns, fp8_ns_compile: e4m3 Newton-Schulz GEMMs on GPUs of capability >= 8.9 for
            matrices whose smaller side is at least 1536 (elsewhere one warning and bf16), and
            whether to ``torch.compile`` that iteration.
        batched_ns, batched_ns_workspace_bytes: shape-batched Newton-Schulz for small local
            matrices, within a workspace budget.
        stochastic_round: unbiased stochastic rounding of the momentum codes.
        deterministic: ask kernels for fixed reduction orders; recorded in checkpoints.
        normuon, normuon_beta2, normuon_eps: NorMuon row normalisation with the Frobenius rescale.
        cautious: keep only update entries whose sign agrees with the gradient (experimental).
        capturable: must be ``False`` (CUDA-graph capture is not implemented for GefenMuon).
        verbose: log the step's choices (codebook learning, fp8 fallback, batched chunks).

    Every option from ``lr`` to ``cautious`` except ``fused``, ``stochastic_round`` and
    ``deterministic`` may differ per parameter group.

    Identity and scope (see the package README): ``post_sharding`` binds every slot to a
    complete local matrix (replicated) or to its owner (whole-parameter owner; non-owner slots
    are pruned) and seals the layout, optionally with a codebook scope;
    ``initialize_collective_state`` / ``refresh_collective_state`` learn the codebook on
    demand; canonical local documents cover replicated matrices.
    """

    _identity_implementation = IMPLEMENTATION
    _binding = MuonBinding()
    _portable = PORTABLE
    _canonical = CANONICAL
    _native = NativeCheckpoint(_NATIVE_LOAD, _export_native, _stage_native, _publish_native)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = DEFAULT_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_schedule: Any = None,
        fused: bool | None = None,
        sharded_mode: str = "exact",
        fp8_ns: bool = False,
        fp8_ns_compile: bool = True,
        batched_ns: bool = False,
        batched_ns_workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        stochastic_round: bool = False,
        deterministic: bool = False,
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        cautious: bool = False,
        capturable: bool = False,
        verbose: bool = False,
    ) -> None:
        for name, flag in (
            ("stochastic_round", stochastic_round),
            ("deterministic", deterministic),
            ("capturable", capturable),
            ("verbose", verbose),
        ):
            if type(flag) is not bool:
                raise GefenOptionTypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if capturable:
            raise GefenOptionError(
                "capturable=True is not implemented for GefenMuon (its step synchronises with the host); "
                "use capturable=False"
            )
        defaults = normalize_muon_options(
            {
                "lr": lr,
                "weight_decay": weight_decay,
                "momentum": momentum,
                "nesterov": nesterov,
                "ns_coefficients": ns_coefficients,
                "eps": eps,
                "ns_steps": ns_steps,
                "ns_schedule": ns_schedule,
                "adjust_lr_fn": adjust_lr_fn,
                "sharded_mode": sharded_mode,
                "fp8_ns": fp8_ns,
                "fp8_ns_compile": fp8_ns_compile,
                "batched_ns": batched_ns,
                "batched_ns_workspace_bytes": batched_ns_workspace_bytes,
                "normuon": normuon,
                "normuon_beta2": normuon_beta2,
                "normuon_eps": normuon_eps,
                "cautious": cautious,
            }
        )
        self._dispatch = Kernels(fused)
        self._stochastic_round = stochastic_round
        self._deterministic = deterministic
        self._capturable = capturable
        self._verbose = verbose
        self._codebook: torch.Tensor | None = None
        self._codebook_copies: dict[torch.device, torch.Tensor] = {}
        self._global_step = 0
        self._version = 0
        self._fp8_warned = False
        self._identity: IdentityRecord | None = None
        self._identity_binding = identity_binding(self)
        # the groups inherit what was passed, not its resolution: a named or listed schedule
        # rewrites ns_coefficients / ns_steps (a group runs the resolved triples), but a group
        # that returns to ns_schedule="standard" or gives its own triple must get the
        # constructor's own ns_coefficients / ns_steps, not the other schedule's triples
        if "ns_coefficients" in defaults and defaults["ns_coefficients"] != ns_coefficients:
            defaults["ns_coefficients"] = normalize_coefficients(ns_coefficients)
            defaults["ns_steps"] = ns_steps
        super().__init__(params, {**defaults, GROUP_MIRROR: None})
        if fused is True:
            for device in sorted({p.device for group in self.param_groups for p in group["params"]}, key=str):
                for op in MUON_DISPATCHED_OPS:
                    self._dispatch.require(op, device)
        muon_execution.warn_fp8_at_construction(self)

    # -- construction -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the whole group (every option and every parameter) first, then register it
        (``RuntimeError`` once ``post_sharding`` sealed the layout)."""
        self._identity_binding.refuse_new_group()
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group is missing the 'params' key")
        index = len(self.param_groups)
        given = {key: value for key, value in param_group.items() if key in MUON_GROUP_OPTIONS}
        options = normalize_muon_options({**self.defaults, **given}, index)
        params = param_group["params"]
        listed = group_params(params)  # an empty group is kept, as torch keeps it (ZeRO builds them)
        for where, tensor in placed(listed, index):
            check_matrix(tensor, where)
        check_new_group(listed, index, self.param_groups, options["lr"], param_names=param_group.get("param_names"))
        refuse_optimizer_wide(param_group, index, optimizer_wide(self))
        # validated: the caller's dict becomes the group, as torch registers it (edits to it reach the step)
        param_group.update(options, params=listed)
        super().add_param_group(param_group)
        self._version += 1
        if hasattr(self, "_fp8_warned"):
            muon_execution.warn_fp8_at_construction(self)

    # -- small queries ------------------------------------------------------------------

    @property
    def codebook(self) -> torch.Tensor | None:
        """A copy of the learned fp32 codebook (``None`` before the first non-zero gradient)."""
        return None if self._codebook is None else self._codebook.clone()

    @property
    def global_step(self) -> int:
        """Completed ``step()`` calls (overflow-skipped AMP steps excluded)."""
        return self._global_step

    @property
    def _step_supports_amp_scaling(self) -> bool:
        identity = self._identity
        return (identity is not None and identity.communicates) or has_fp16_gradients(self.param_groups)

    def state_mode_tags(self, parameter: Any) -> frozenset[str]:
        """``{"gefen.muon.sharded_mode=<mode>"}`` of ``parameter``'s group (``ModeTaggedState``)."""
        for group in self.param_groups:
            if any(p is parameter for p in group["params"]):
                return frozenset({mode_tag(group["sharded_mode"])})
        raise KeyError("the tensor is not a parameter of this optimizer")

    def optimizer_contract(self) -> OptimizerContract:
        """What this instance supports now (cheap: O(local parameters), pure, no collectives)."""
        readiness = identity_readiness(self)
        return muon_contract(
            readiness=readiness,
            canonical=CANONICAL.status(self, readiness.identity),
            whole_owner_blocker=self._binding.whole_owner_blocker(self),
            modes=tuple(sorted({group["sharded_mode"] for group in self.param_groups})),
            normuon=tuple(sorted({bool(group["normuon"]) for group in self.param_groups})),
            deterministic=self._deterministic,
            stochastic_round=self._stochastic_round,
            fused=self._dispatch.fused,
            portable=PORTABLE.status(self),
            parameter_shaped=parameter_shaped_status(self.param_groups, bound_layout(self) is not None),
            portable_sealed=bound_layout(self) is not None,
        )

    # -- preflight and step -------------------------------------------------------------

    def preflight_step(self) -> None:
        """Run every check ``step()`` runs before mutating; raise its error; change nothing (no collective)."""
        muon_execution.plan(self)

    @run_eagerly
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon update of every 2-D parameter with a gradient; returns ``closure()``'s loss.

        Under FSDP2 every rank of the mesh must call it (collectives; failures are voted), and
        so must every member of a codebook scope (see :mod:`gefen_core.scoped_step`).

        ``torch.compile`` does not trace this method: it always runs eagerly. Traced by
        TorchDynamo (torch 2.15, any backend, ``"eager"`` included), every update of a group's
        equally shaped matrices landed on its first matrix. Root cause, in TorchDynamo: a frame
        that reads ``self.param_groups[i]`` and then a parameter through a work item passed in
        names the parameter by its ``param_groups`` path and guards that path only, so the frame
        compiled for one item is replayed for the next. The step breaks the graph (the finite
        gradient check, codebook learning, votes), and the frames resumed after each break take
        work items as inputs. A strict-xfail canary in ``tests/test_integration_torch.py`` turns
        red when torch fixes it. The step is dominated by the kernels and Newton-Schulz GEMMs,
        which tracing does not speed up.
        """
        try:
            blocker = self._binding.whole_owner_blocker(self)
            if blocker is not None:
                raise RuntimeError(f"GefenMuon.step: {blocker}")
            identity = self._identity
            if identity is not None and identity.scope is not None:
                return scoped_step(self, closure)
            error: BaseException | None = None
            scope: MuonScope | None = None
            try:
                verify_layout(self, "step")  # before anything reads the (possibly tampered) groups
                scope = slot_layouts(self.param_groups)[1]
                check_entry(self.param_groups)
            except Exception as exc:
                error = exc
            loss = None
            if closure is not None:
                vote(scope, "entry checks", error)
                try:
                    with torch.enable_grad():
                        loss = closure()
                except Exception as exc:
                    error = exc
            plan: MuonPlan | None = None
            if error is None:
                try:
                    plan = muon_execution.plan(self)
                except Exception as exc:
                    error = exc
            vote(scope, "step preflight", error)
            assert plan is not None
            entries = [
                ScopeEntry(item.name, tuple(item.param.shape), item.param.dtype, item.grad is not None)
                for item in plan.scope_items()
            ]
            if agree_step(plan.scope, entries, self, self._codebook).skip:
                return loss
            unscale_gradients(self, [item.grad for item in plan.active if item.grad is not None])
            muon_execution.execute(self, plan)
            return loss
        except BaseException:
            forget_scaler_state(self)  # the scaler keeps them past a raise; a retry would unscale twice
            raise

    _OWN_ATTRIBUTES = (
        "_dispatch",
        "_stochastic_round",
        "_deterministic",
        "_capturable",
        "_verbose",
        "_codebook",
        "_codebook_copies",
        "_global_step",
        "_version",
        "_fp8_warned",
    )

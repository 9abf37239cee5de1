"""``Gefen``: AdamW with about one byte of optimizer state per parameter.

See the package README for the algorithm and :mod:`gefen_core.reference_ops` for the exact
arithmetic. This module owns the optimizer object: construction, ``step()`` and the
Protocol methods, which delegate to the roles the class owns (README "How the code is
arranged"); the step's work is in :mod:`gefen_core.gefen_step`, the numerics in the modules
it calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from gefen_contracts import OptimizerContract
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.torch_support import check_new_group, forget_scaler_state, group_params, scaler_overflowed

from . import gefen_step
from .amp import has_fp16_gradients, unscale_gradients
from .contract import IMPLEMENTATION, gefen_contract
from .convention_methods import ConventionMethods
from .errors import CaptureError, GefenOptionError, GefenOptionTypeError
from .gefen_binding import CANONICAL, GefenBinding
from .gefen_exchange import live_piece, native_from_records
from .identity import IdentityRecord, bound_layout, identity_binding, identity_readiness, verify_layout
from .native_records import GROUP_MIRROR
from .native_state import StagedNativeState, export_state_dict, stage_state_dict
from .ops import Kernels
from .optimizer_support import (
    NativeCheckpoint,
    OwnAttributesPickling,
    publish_groups_and_state,
    run_eagerly,
)
from .param_groups import check_parameters, normalize_group_options, optimizer_wide, refuse_optimizer_wide
from .portable_adapter import PortableRole
from .scoped_step import scoped_step
from .step_plan import capturing

__all__ = ["PORTABLE", "Gefen"]

_NATIVE_LOAD = "gefen.native_load"
#: Gefen's portable adapter role (its ``portable_*`` methods delegate to it).
PORTABLE = PortableRole(
    "gefen.Gefen",
    "parameter(s)",
    frozenset({ParameterLayout.REPLICATED, ParameterLayout.FLATTENED_ELEMENT_SHARD}),
    live_piece,
    native_from_records,
)


def _export_native(optimizer: Gefen) -> dict[str, Any]:
    return export_state_dict(
        optimizer.param_groups,
        optimizer.state,
        codebook=optimizer._codebook,
        global_step=optimizer.global_step,
        deterministic=optimizer._deterministic,
    )


def _stage_native(optimizer: Gefen, state_dict: Mapping[str, Any]) -> StagedNativeState:
    return stage_state_dict(
        state_dict,
        param_groups=optimizer.param_groups,
        live_state=optimizer.state,
        deterministic=optimizer._deterministic,
        capturable=optimizer._capturable,
    )


def _publish_native(optimizer: Gefen, payload: StagedNativeState) -> None:
    publish_groups_and_state(optimizer, payload.groups, payload.state)
    optimizer._codebook = payload.codebook
    optimizer._codebook_copies = {}
    optimizer._global_step = payload.global_step
    optimizer._device_global_steps = {}
    optimizer._version += 1


class Gefen(ConventionMethods, OwnAttributesPickling, torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction, ``eps`` outside the root) whose state is
    about 1 byte per parameter: a block-shared or factored second moment and a first moment
    stored as uint8 indices into one learned 256-entry codebook with a per-block scale.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``) or group dicts.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.AdamW``, with its defaults
            (``lr`` may be a 1-element tensor; ``weight_decay`` 1e-2, 0 before 0.2).
        amsgrad: ``False`` only (as AdamW's default); ``True`` raises ``GefenOptionError``: a
            block-shared or factored ``v`` has no per-element maximum to keep.
        foreach: accepted for AdamW's signature; a performance hint that changes nothing here
            (``fused`` chooses between the kernels and the reference).
        differentiable: ``False`` only (as AdamW's default); ``True`` raises ``GefenOptionError``:
            codes into a learned codebook have no gradient to carry through the step.
        fused: ``None`` runs the kernels registered for the parameters' device (gefen-kernels:
            C on CPU, Triton on CUDA) and the PyTorch reference elsewhere, ``True`` requires
            them, ``False`` always runs the reference (:mod:`gefen_core.ops`).
        factored_v_2d: factored (row x column) second moment for 2-D parameters (block-shared
            when ``False``).
        min_dim_size_to_factor: a 2-D parameter with a dimension below this keeps Adam's
            per-element ``v`` (4 more bytes per parameter) instead of the factored one, as
            Adafactor does (its default, 128; ``0`` factors every matrix). Only narrow
            matrices pay: none of the 52.7M decoder's; on ``char-mini`` (d = 64) it is what
            brings Gefen to AdamW's loss (:func:`gefen_core.param_state.second_moment_variant`).
        clip_threshold: Adafactor's update clipping of factored matrices (``None``: off; it
            trades one task against another, README "Update clipping"; :mod:`.second_moment`).
        force_1d_period_one, force_2d_period_one, period_one_substrings: per-element blocks
            (a scale per element: 9 bytes/element with a per-element ``v``, about 5 with a
            matrix's factored ``v``) for 1-D parameters, 2-D parameters, or names containing a
            substring (needs named parameters). A bound flattened element shard whose cut falls
            on its parameter's blocks keeps the parameter's period; any other is a 1-D tensor
            to these overrides (it steps like an optimizer built on it).
        codebook_refresh_every: relearn the codebook every N steps (0: never); a refresh whose
            gradients are all zero keeps the codebook.
        stochastic_round: unbiased stochastic rounding of momentum codes.
        deterministic: ask kernels for fixed reduction orders; recorded in checkpoints.
        capturable: keep counters and scalars on device so a step can be captured in a CUDA
            graph (run one eager step first).

    The options ``lr`` to ``period_one_substrings`` may differ per parameter group; the rest
    are optimizer-wide.

    Identity and scope (see the package README): ``post_sharding`` binds every slot to its live
    local tensor (replicated or flattened element shards) and seals the layout, optionally with
    a codebook scope over which the codebook is learned; ``initialize_collective_state`` /
    ``refresh_collective_state`` learn it on demand; ``export_local_state`` / ``prepare_local_import`` / ``commit_local_import``
    move FQN-keyed canonical documents.
    """

    _identity_implementation = IMPLEMENTATION
    _binding = GefenBinding()
    _portable = PORTABLE
    _canonical = CANONICAL
    _native = NativeCheckpoint(_NATIVE_LOAD, _export_native, _stage_native, _publish_native)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,  # positional, as in torch.optim.AdamW's signature
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        factored_v_2d: bool = True,
        min_dim_size_to_factor: int = 128,
        clip_threshold: float | None = None,
        force_1d_period_one: bool = False,
        force_2d_period_one: bool = False,
        period_one_substrings: Iterable[str] = (),
        codebook_refresh_every: int = 0,
        stochastic_round: bool = False,
        deterministic: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        for name, flag in (("deterministic", deterministic), ("stochastic_round", stochastic_round)):
            if type(flag) is not bool:
                raise GefenOptionTypeError(f"{name} must be a bool, got {type(flag).__name__}")
        if type(capturable) is not bool:
            raise GefenOptionTypeError(f"capturable must be a bool, got {type(capturable).__name__}")
        if foreach is not None and type(foreach) is not bool:
            raise GefenOptionTypeError(f"foreach must be None, True or False, got {foreach!r}")
        if type(codebook_refresh_every) is not int:
            raise GefenOptionTypeError(
                f"codebook_refresh_every must be an int, got {type(codebook_refresh_every).__name__}"
            )
        if codebook_refresh_every < 0:
            raise GefenOptionError(f"codebook_refresh_every must be >= 0, got {codebook_refresh_every}")
        if capturable and codebook_refresh_every:
            raise GefenOptionError(
                "codebook_refresh_every > 0 is incompatible with capturable=True (refresh is host-driven)"
            )
        substrings = (
            tuple(period_one_substrings) if not isinstance(period_one_substrings, str) else period_one_substrings
        )
        defaults = normalize_group_options(
            {
                "lr": lr,
                "betas": betas,
                "eps": eps,
                "weight_decay": weight_decay,
                "maximize": maximize,
                "factored_v_2d": factored_v_2d,
                "min_dim_size_to_factor": min_dim_size_to_factor,
                "clip_threshold": clip_threshold,
                "force_1d_period_one": force_1d_period_one,
                "force_2d_period_one": force_2d_period_one,
                "period_one_substrings": substrings,
                "amsgrad": amsgrad,
                "differentiable": differentiable,
            }
        )
        self._dispatch = Kernels(fused)
        self._refresh_every = codebook_refresh_every
        self._stochastic_round = stochastic_round
        self._deterministic = deterministic
        self._capturable = capturable
        self._codebook: torch.Tensor | None = None
        self._codebook_copies: dict[torch.device, torch.Tensor] = {}
        self._global_step = 0
        self._device_global_steps: dict[torch.device, torch.Tensor] = {}
        self._version = 0
        #: where the stepping parameters' memory began when a step last checked that none is shared
        self._memory_layout: tuple[int, ...] | None = None
        self._identity: IdentityRecord | None = None
        self._identity_binding = identity_binding(self)
        super().__init__(params, {**defaults, GROUP_MIRROR: None})
        if fused is True:
            gefen_step.require_kernels(self)

    # -- construction -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the whole group (options and parameters) first, then register it
        (``RuntimeError`` once ``post_sharding`` sealed the layout)."""
        self._identity_binding.refuse_new_group()
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError("param_group is missing the 'params' key")
        index = len(self.param_groups)
        options = normalize_group_options(param_group, index)
        params = param_group["params"]
        listed = group_params(params)  # an empty group is kept, as torch keeps it (ZeRO builds them)
        check_parameters(listed, index)
        merged = {**param_group, **options}
        check_new_group(
            listed,
            index,
            self.param_groups,
            merged.get("lr", self.defaults["lr"]),
            param_names=merged.get("param_names"),
        )
        refuse_optimizer_wide(param_group, index, optimizer_wide(self))
        substrings = merged.get("period_one_substrings", self.defaults["period_one_substrings"])
        named = (bool(listed) and all(isinstance(p, tuple) for p in listed)) or merged.get("param_names") is not None
        if substrings and not named:
            raise GefenOptionError(
                f"param_groups[{index}]: period_one_substrings needs named parameters "
                "(pass model.named_parameters() or (name, tensor) pairs)"
            )
        # validated: the caller's dict becomes the group, as torch registers it (edits to it reach the step)
        param_group.update(options, params=listed)
        super().add_param_group(param_group)
        self._version += 1
        self._memory_layout = None

    # -- small queries ------------------------------------------------------------------

    @property
    def codebook(self) -> torch.Tensor | None:
        """A copy of the learned fp32 codebook (``None`` before the first non-zero gradient)."""
        return None if self._codebook is None else self._codebook.clone()

    @property
    def global_step(self) -> int:
        """Completed ``step()`` calls (overflow-skipped AMP steps excluded)."""
        if self._device_global_steps:
            return int(next(iter(self._device_global_steps.values())).item())
        return self._global_step

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # A multi-member scope always takes the scaler's optimizer protocol, so every member
        # agrees on one overflow decision in its step header.
        identity = self._identity
        return (identity is not None and identity.communicates) or has_fp16_gradients(self.param_groups)

    # -- contract and preflight ---------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """What this instance supports now (cheap: O(local parameters), pure, no collectives)."""
        readiness = identity_readiness(self)
        return gefen_contract(
            readiness=readiness,
            canonical=CANONICAL.status(self, readiness.identity),
            deterministic=self._deterministic,
            stochastic_round=self._stochastic_round,
            capturable=self._capturable,
            codebook_refresh_every=self._refresh_every,
            fused=self._dispatch.fused,
            factored_v_2d=tuple(bool(g["factored_v_2d"]) for g in self.param_groups),
            portable=PORTABLE.status(self),
            portable_sealed=bound_layout(self) is not None,
            period_one_1d=all(bool(g["force_1d_period_one"]) for g in self.param_groups),
        )

    def preflight_step(self) -> None:
        """Run every check ``step()`` runs before mutating; raise its error; change nothing."""
        gefen_step.plan(self)

    # -- step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW-like update of every parameter with a gradient; returns ``closure()``'s loss.

        With a codebook scope every member must call it (see :mod:`gefen_core.scoped_step`).
        Under ``torch.compile`` the step is traced only when :meth:`traceable` says so, and
        runs eagerly otherwise (one graph break, at this call).
        """
        if torch.compiler.is_compiling() and not self.traceable():
            return _step_eagerly(self, closure)
        try:
            identity = self._identity
            if identity is not None and identity.scope is not None:
                return scoped_step(self, closure)
            if capturing() and not self._capturable:
                raise CaptureError("this step is being captured in a CUDA graph; construct Gefen with capturable=True")
            loss = None
            if closure is not None:
                verify_layout(self, "step")
                with torch.enable_grad():
                    loss = closure()
            if scaler_overflowed(self):  # before the plan: an overflowed first gradient is not an error
                return loss
            plan = None
            try:
                plan = gefen_step.plan(self)
                gefen_step.relearn_if_outgrown(self, plan)
                # a generator: without a scaler the gradients are not walked at all
                unscale_gradients(self, (w.param.grad for w in plan.works if w.param.grad is not None))
                for work in plan.moving:
                    gefen_step.move_state(work)
            except Exception as exc:  # under FSDP2 the other members must not wait in a collective
                gefen_step.agree_on_mesh(self, None, exc)
                raise
            gefen_step.agree_on_mesh(self, plan, None)
            stats = gefen_step.factored_stats(self, plan)
            gefen_step.publish(self, plan, gefen_step.decide(self, plan), stats)
            return loss
        except BaseException:
            forget_scaler_state(self)  # the scaler keeps them past a raise; a retry would unscale twice
            raise

    def traceable(self) -> bool:
        """Whether TorchDynamo traces ``step()``: a steady step (the codebook learned, every
        parameter with a gradient already holding state, no codebook scope) with
        ``capturable=True`` and every group's learning rate a tensor. Then nothing it would
        specialise on changes between steps (counters and step scalars live on the device; a
        schedule updates the rate in place), so a compiled steady step has no graph break and
        does not recompile. With Python-float rates or int counters it would recompile at every
        change of their values, so it runs eagerly; so do learning steps, whose new codebook
        and states are assignments a traced step would not keep (TorchDynamo does not replay
        attribute writes on an optimizer), and a scope's collectives."""
        identity = self._identity
        return (
            self._capturable
            and self._codebook is not None
            and (identity is None or identity.scope is None)
            and all(isinstance(group["lr"], torch.Tensor) for group in self.param_groups)
            and all(p in self.state for group in self.param_groups for p in group["params"] if p.grad is not None)
        )

    _OWN_ATTRIBUTES = (
        "_dispatch",
        "_refresh_every",
        "_stochastic_round",
        "_deterministic",
        "_capturable",
        "_codebook",
        "_codebook_copies",
        "_global_step",
        "_device_global_steps",
        "_version",
        "_memory_layout",
    )


#: ``Gefen.step``'s body under no decorator (what :func:`_step_eagerly` runs).
_STEP_BODY = Gefen.step.__wrapped__  # type: ignore[attr-defined]


@run_eagerly
@torch.no_grad()
def _step_eagerly(optimizer: Gefen, closure: Callable[[], Any] | None) -> Any:
    """``Gefen.step`` outside TorchDynamo (one graph break) when it is not :meth:`Gefen.traceable`;
    a function of its own so that the traced path keeps no extra frame."""
    return _STEP_BODY(optimizer, closure)

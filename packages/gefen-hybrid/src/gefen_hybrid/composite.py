"""``CompositeOptimizer``: one torch optimizer made of two contracted children with roles.

The children (``"muon"`` then ``"backup"``; either may be absent) are reached only through
the gefen-contracts Protocols and ``torch.optim.Optimizer``'s public API. The composite
owns no optimizer state of its own: ``param_groups`` and ``state`` are live views of the
children's, so LR schedulers, GradScaler and user code see and edit the children directly.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_PORTABLE_STATE,
    FEATURE_STAGED_NATIVE_LOAD,
    NotSupportedError,
    OptimizerContract,
)
from gefen_contracts.identity import ShardIdentity
from gefen_contracts.manifest import ShardingManifest
from gefen_contracts.protocols import (
    FEATURE_PROTOCOLS,
    ContractProvider,
    ModeTaggedState,
    PortableAdapter,
    StepPreflight,
)
from gefen_contracts.rebinding import ParameterRebinding
from gefen_contracts.torch_support import (
    export_with_hooks,
    forget_scaler_state,
    run_load_post_hooks,
    run_load_pre_hooks,
    scaler_overflowed,
)
from gefen_contracts.transactions import StagedTransaction, require_transaction
from gefen_contracts.validation import identity_name
from torch import nn

from . import composite_amp as amp
from . import composite_binding as binding
from . import composite_checkpoint as checkpoint
from .composite_binding import ChangeCounter
from .composite_contract import derive_composite_contract
from .composite_format import build_composite_state_dict
from .composite_groups import child_groups_noted, new_group_parts
from .composite_identity import CompositeIdentity
from .composite_state import CompositeState
from .failure_vote import step_vote_groups, vote_failure
from .roles import ROLES, check_role, role_tag
from .routing import (
    FrozenLeftOut,
    NamedParameter,
    RoutedParameters,
    RoutingRules,
    checked_module,
    checked_rules,
    route_model,
    route_named_parameters,
    split_by_role,
)

__all__ = ["DEFAULT_IMPLEMENTATION", "STEP_PHASE", "ChildFactory", "CompositeOptimizer"]

#: The implementation name a composite publishes unless told otherwise.
DEFAULT_IMPLEMENTATION = "gefen.CompositeOptimizer"
#: The phase named by the error every rank raises when a step fails on one of them.
STEP_PHASE = "composite step preflight"

#: ``factory(named_parameters) -> optimizer`` builds one child from its routed parameters.
ChildFactory = Callable[[list[NamedParameter]], torch.optim.Optimizer]


def _named_parameters_of(role: str, child: torch.optim.Optimizer) -> list[NamedParameter]:
    named: list[NamedParameter] = []
    for index, group in enumerate(child.param_groups):
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise TypeError(
                f"child {role!r} param group {index} has no parameter names; build each child from named "
                "parameters (e.g. ContractedAdamW(model.named_parameters())) so the composite can route and "
                "checkpoint by name"
            )
        named.extend(zip(names, group["params"]))
    return named


class CompositeOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over a ``"muon"`` child and a ``"backup"`` child.

    Build it from ready children (``CompositeOptimizer({"muon": a, "backup": b})``, each
    built from named parameters) or let it route and build them
    (:meth:`from_factories`). It implements the ``ContractProvider``, ``StagedNativeLoad``,
    ``CompositeOptimizer``, ``StepPreflight``, ``ModeTaggedState``, ``IdentityBindable``,
    ``CanonicalLocalState`` and ``ParameterShapedState`` Protocols (the last three work when
    every child implements them), and claims ``portable_state`` when every child is a portable
    adapter (served child by child through gefen-portable's composite wrapper).

    Promises:

    * ``step(closure)`` runs the step pre-hooks and the closure once, preflights every
      child, votes the outcome over every process group the children use (see
      :mod:`gefen_hybrid.failure_vote`) and only then steps the children, muon first; a
      failure on any rank makes every rank raise the same ``CollectiveFailureError`` with
      nothing stepped.
    * ``load_state_dict`` is atomic across both children when both implement
      ``StagedNativeLoad``: both halves are validated and staged before either is published.
    * ``param_groups`` is a new list of the children's live group dicts on every access
      (muon groups first), so schedulers keep each child's lr ratio.
    * GradScaler unscales through ``param_groups`` and skips the whole step on overflow; when
      a child takes the scaler's optimizer protocol (Gefen and GefenMuon with fp16 gradients),
      the composite takes it and passes it on (:mod:`gefen_hybrid.composite_amp`).
    * ``post_sharding`` validates one request against both children, partitions it by the
      routing, prepares every child before committing any (a child that refuses leaves both
      untouched) and seals the composite; afterwards routing is by canonical FQN.
    * Canonical local state nests each child's document by role
      (``gefen.composite_bound_state``, see :mod:`gefen_hybrid.composite_bound_state`).
    * Its native state dict is flat in torch's numbering (muon parameters first), so when
      both children keep parameter-shaped state it is parameter-shaped too:
      ``gefen_dcp.GefenDCPState``, torch's DCP recipe and an FQN-keyed ``state_dict()``
      reshard it like any optimizer's. Portable state is exported and imported child by
      child by ``gefen_portable.export_portable_composite_state`` /
      ``import_portable_composite_state`` (and ``gefen_dcp.save_portable_dcp`` /
      ``load_portable_dcp``), which stage every child before one vote.
    """

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # any child that takes the scaler's protocol (fp16 gradients) makes the composite take it
        return amp.supports_amp_scaling(child for _, child in self._children)

    def __init__(
        self,
        children: Mapping[str, torch.optim.Optimizer],
        *,
        implementation: str = DEFAULT_IMPLEMENTATION,
        rules: RoutingRules | None = None,
        model: nn.Module | None = None,
    ) -> None:
        """Compose ``children`` (role -> optimizer built from named parameters).

        ``rules`` (default :class:`RoutingRules`) and ``model`` (held weakly, for embedding
        identities) route the parameters of later ``add_param_group`` calls. Raises
        ``TypeError`` for a child that is not a contracted ``torch.optim.Optimizer`` or has
        unnamed groups, and ``ValueError`` for a tensor or a name in both children.
        """
        # torch.optim.Optimizer.__init__ is not called: param_groups and state are views.
        if not isinstance(children, Mapping) or not children:
            raise TypeError("children must be a non-empty mapping of role -> optimizer, e.g. {'muon': a, 'backup': b}")
        for role, child in children.items():
            check_role(role, "child role")
            if not isinstance(child, torch.optim.Optimizer):
                raise TypeError(f"child {role!r} must be a torch.optim.Optimizer, got {type(child).__name__}")
            if not isinstance(child, ContractProvider):
                raise TypeError(
                    f"child {role!r} ({type(child).__name__}) publishes no optimizer_contract(); the composite "
                    "composes optimizers that keep the convention (for AdamW use gefen_hybrid.ContractedAdamW)"
                )
        if len({id(c) for c in children.values()}) != len(children):
            raise ValueError("the same optimizer object cannot fill two roles")
        checked_rules(rules)
        if model is not None:
            checked_module(model, "CompositeOptimizer(model=...)")
        self._implementation = identity_name(implementation, "implementation")
        self._children: tuple[tuple[str, torch.optim.Optimizer], ...] = tuple(
            (role, children[role]) for role in ROLES if role in children
        )
        self._rules = checked_rules(rules)
        self._model_ref: weakref.ref[nn.Module] | None = None if model is None else weakref.ref(model)
        self._left_out = None if model is None else FrozenLeftOut(model, _optimized_ids(self))
        self._owners: dict[int, tuple[torch.Tensor, torch.optim.Optimizer]] = {}
        self._changes = ChangeCounter()
        self._identity: CompositeIdentity | None = None
        self.defaults = self._children[0][1].defaults
        self._optimizer_step_pre_hooks: Any = OrderedDict()
        self._optimizer_step_post_hooks: Any = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Any = OrderedDict()
        self._optimizer_state_dict_post_hooks: Any = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Any = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Any = OrderedDict()
        self.parameter_routing()  # rejects a tensor or a name used by both children
        self._child_implementations = {
            role: child.optimizer_contract().implementation  # type: ignore[attr-defined]
            for role, child in self._children
        }
        self._watch_children()
        self.optimizer_contract()  # fail fast when the children cannot be described together

    def _watch_children(self) -> None:
        # A child's step (attempted or done) or load outdates a staged composite transaction.
        for _, child in self._children:
            if self._changes.bump not in child._optimizer_step_pre_hooks.values():
                child.register_step_pre_hook(self._changes.bump)
            if self._changes.bump not in child._optimizer_step_post_hooks.values():
                child.register_step_post_hook(self._changes.bump)
            if self._changes.bump not in child._optimizer_load_state_dict_post_hooks.values():
                child.register_load_state_dict_post_hook(self._changes.bump)

    @classmethod
    def from_factories(
        cls,
        params: nn.Module | Iterable[NamedParameter] | Mapping[str, Iterable[NamedParameter]],
        factories: Mapping[str, ChildFactory],
        *,
        rules: RoutingRules | None = None,
        implementation: str = DEFAULT_IMPLEMENTATION,
    ) -> CompositeOptimizer:
        """Route ``params`` and build each present role's child with ``factories[role]``.

        ``params`` is an ``nn.Module`` (routed by module type and name), an iterable of
        ``(name, parameter)`` pairs (routed by name and shape) or an explicit
        ``{"muon": [...], "backup": [...]}`` split (``rules`` must then be ``None``). A
        role that receives no parameter gets no child. Unnamed parameters raise
        ``TypeError`` explaining how to pass names.
        """
        for role in factories:
            check_role(role, "factories key")
        model: nn.Module | None = None
        routed: RoutedParameters
        if isinstance(params, nn.Module):
            routed, model = route_model(params, rules), params
        elif isinstance(params, Mapping):
            if rules is not None:
                raise TypeError("rules apply to a model or a list of named parameters, not to an explicit split")
            routed = split_by_role(params)
        else:
            routed = route_named_parameters(params, rules)
        if not routed.present_roles:
            raise ValueError("the composite got no trainable parameters")
        children: dict[str, torch.optim.Optimizer] = {}
        for role in routed.present_roles:
            named = routed.for_role(role)
            factory = factories.get(role)
            if factory is None:
                sample = [name for name, _ in named[:3]]
                raise ValueError(f"{len(named)} parameters route to {role!r} (e.g. {sample}) but no factory was given")
            child = factory(named)
            built = {id(p) for group in getattr(child, "param_groups", ()) for p in group["params"]}
            if built != {id(p) for _, p in named}:
                raise ValueError(f"the {role!r} factory built an optimizer over other parameters than it was given")
            children[role] = child
        return cls(children, implementation=implementation, rules=rules, model=model)

    # -- views ----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The children's live param-group dicts (muon groups first); a new list each time."""
        return [group for _, child in self._children for group in child.param_groups]

    @param_groups.setter
    def param_groups(self, value: object) -> None:
        raise TypeError(
            "CompositeOptimizer.param_groups is a view of the children's groups and cannot be replaced; edit the "
            "group dicts in place (group['lr'] = ...) or use add_param_group"
        )

    @property  # type: ignore[override]
    def state(self) -> CompositeState:
        """A routed view of the children's per-parameter state (see :class:`CompositeState`)."""
        return CompositeState([child for _, child in self._children], self._owner_of)

    @state.setter
    def state(self, value: object) -> None:
        raise TypeError("CompositeOptimizer.state is a view of the children's state and cannot be replaced")

    def _owner_map(self) -> dict[int, tuple[torch.Tensor, torch.optim.Optimizer]]:
        return {
            id(p): (p, child) for _, child in self._children for group in child.param_groups for p in group["params"]
        }

    def _owner_of(self, parameter: torch.Tensor) -> torch.optim.Optimizer | None:
        entry = self._owners.get(id(parameter))
        if entry is None or entry[0] is not parameter:
            self._owners = self._owner_map()
            entry = self._owners.get(id(parameter))
        return entry[1] if entry is not None and entry[0] is parameter else None

    # -- Composite Protocol (gefen_contracts.protocols) ---------------------------------------

    def child_optimizers(self) -> Mapping[str, torch.optim.Optimizer]:
        """Present role -> child, muon first (read-only)."""
        return MappingProxyType(dict(self._children))

    def parameter_routing(self) -> tuple[tuple[str, str], ...]:
        """Sorted ``(fqn, role)`` pairs of every parameter: read from the children's groups, or
        after ``post_sharding`` the canonical FQNs of the finalized manifest."""
        if self._identity is not None:
            return self._identity.routing
        roles: dict[str, str] = {}
        owners: dict[int, str] = {}
        for role, child in self._children:
            for name, parameter in _named_parameters_of(role, child):
                if id(parameter) in owners:
                    raise ValueError(f"parameter {name!r} is optimized by both {owners[id(parameter)]!r} and {role!r}")
                if name in roles:
                    raise ValueError(f"the name {name!r} is used by both {roles[name]!r} and {role!r}")
                owners[id(parameter)], roles[name] = role, role
        return tuple(sorted(roles.items()))

    def state_mode_tags(self, parameter: Any) -> frozenset[str]:
        """The owning child's mode tags for ``parameter`` plus ``"gefen.role=<role>"``."""
        owner = self._owner_of(parameter) if isinstance(parameter, torch.Tensor) else None
        for role, child in self._children:
            if owner is child:
                own = child.state_mode_tags(parameter) if isinstance(child, ModeTaggedState) else frozenset()
                return frozenset(own) | {role_tag(role)}
        raise KeyError("not a parameter of this composite optimizer")

    # -- ContractProvider ---------------------------------------------------------------------

    def optimizer_contract(self) -> OptimizerContract:
        """Derived from the children's contracts (see :mod:`gefen_hybrid.composite_contract`)."""
        implemented = frozenset(f for f, protocol in FEATURE_PROTOCOLS.items() if isinstance(self, protocol))
        if all(isinstance(child, PortableAdapter) for _, child in self._children):
            implemented |= {FEATURE_PORTABLE_STATE}  # served through its children (composite wrapper)
        return derive_composite_contract(
            self._implementation, self._children, implemented, own_blockers=binding.identity_blockers(self)
        )

    # -- IdentityBindable and CanonicalLocalState (gefen_hybrid.composite_binding) ----------------

    def prepare_post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> StagedTransaction:
        """Validate once, partition by the routing, prepare every child; nothing is mutated."""
        return binding.prepare_post_sharding(self, rebindings, manifest=manifest, scope=scope)

    def commit_post_sharding(self, staged: StagedTransaction) -> None:
        """Re-prepare and commit both children, then publish the composite's record."""
        binding.commit_post_sharding(self, staged)

    def post_sharding(
        self, rebindings: Sequence[ParameterRebinding], *, manifest: ShardingManifest, scope: object | None = None
    ) -> None:
        """``prepare_post_sharding`` then ``commit_post_sharding``."""
        self.commit_post_sharding(self.prepare_post_sharding(rebindings, manifest=manifest, scope=scope))

    def sharding_manifest(self) -> ShardingManifest | None:
        """The full finalized manifest (``None`` before ``post_sharding``)."""
        return binding.sharding_manifest(self)

    def shard_bindings(self) -> tuple[tuple[Any | None, ShardIdentity], ...]:
        """Both children's bindings, sorted by ``sort_key``."""
        return binding.shard_bindings(self)

    def shard_identity(self, parameter: Any) -> ShardIdentity:
        """The shard the owning child bound to ``parameter`` (``KeyError`` otherwise)."""
        return binding.shard_identity(self, parameter)

    def export_local_state(self) -> dict[str, Any]:
        """The ``gefen.composite_bound_state`` document (no collectives)."""
        return binding.export_local_state(self)

    def prepare_local_import(self, document: Mapping[str, Any]) -> StagedTransaction:
        """Validate the envelope and prepare every child's import; nothing is mutated."""
        return binding.prepare_local_import(self, document)

    def commit_local_import(self, staged: StagedTransaction) -> None:
        """Publish every child's prepared import (single use)."""
        binding.commit_local_import(self, staged)

    # -- stepping -------------------------------------------------------------------------------

    def preflight_step(self) -> None:
        """Every child's ``preflight_step()`` (children without one are skipped); no closure, no
        vote. A child's error names its own group indices; a note maps them to this composite's.
        After an overflow the scaler reported, no child steps, so none checks its gradients (a
        first step's are not finite, and the scaler must skip it, not fail)."""
        checks = not scaler_overflowed(self)
        for role, child in self._children:
            if checks and isinstance(child, StepPreflight):
                with child_groups_noted(self._children, role):
                    child.preflight_step()
        amp.check_scalable(self, self._children)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Pre-hooks, closure (once, under ``enable_grad``), preflight, vote, then each child's step.

        Returns the closure's loss. A step pre-hook may return ``(new_args, new_kwargs)`` to
        rewrite the call (``new_args[0]`` is the optimizer), as with torch optimizers.
        Instance hooks fire once per composite step; global optimizer hooks fire for each
        child that steps, as torch fires them for every optimizer.
        """
        args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
        kwargs: dict[str, Any] = {}
        if self._left_out:
            self._left_out.check(functools.partial(_optimized_ids, self))
        try:
            with torch.autograd.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
                groups = step_vote_groups([child for _, child in self._children])
                loss = None
                error: Exception | None = None
                try:
                    args, kwargs = self._run_step_pre_hooks(args, kwargs)
                    step_closure = _closure_of(args, kwargs)
                    if step_closure is not None:
                        with torch.enable_grad():
                            loss = step_closure()
                    self.preflight_step()
                except Exception as exc:
                    error = exc
                vote_failure(groups, STEP_PHASE, error)
                for _, child in self._children:
                    amp.step_child(self, child)
                for post_hook in list(self._optimizer_step_post_hooks.values()):
                    post_hook(self, args, kwargs)
        except BaseException:
            forget_scaler_state(self)  # else a retry is unscaled by the product of two scales
            raise
        return loss

    def _run_step_pre_hooks(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for pre_hook in list(self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is None:
                continue
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"a step pre-hook must return None or a tuple of (new_args, new_kwargs), but got {result!r}"
                )
            args, kwargs = tuple(result[0]), dict(result[1])
        return args, kwargs

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Each child's ``zero_grad``."""
        for _, child in self._children:
            child.zero_grad(set_to_none=set_to_none)

    def add_param_group(
        self, param_group: dict[str, Any], *, role_options: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        """Route a new group's named parameters by the composite's rules and add each role's part
        to its child, with the group's options (plus ``role_options[role]``).

        Parameters must be named (``{"params": [(name, p), ...], "lr": ...}``). Nothing is added
        if a parameter is already optimized, a name is taken, or a parameter routes to an
        absent role; if the second child refuses its part, the first child's new group is
        removed again.
        """
        if self._identity is not None:
            raise RuntimeError(
                "add_param_group: the composite's layout was sealed by post_sharding; add every parameter group "
                "before calling post_sharding"
            )
        parts = new_group_parts(self, param_group, role_options)
        added: list[torch.optim.Optimizer] = []
        for role, child in self._children:
            if role not in parts:
                continue
            try:
                child.add_param_group(parts[role])
            except BaseException as exc:
                for done in added:
                    done.param_groups.pop()
                # the child's message numbers its own groups, not the composite's
                exc.add_note(
                    f"refused by the composite's {role!r} child, for which this group's {role} part would be its "
                    f"param_groups[{len(child.param_groups)}]"
                )
                raise
            added.append(child)
        self._changes.bump()

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The flat ``gefen.composite_native_state`` v2 dict (see :mod:`gefen_hybrid.composite_format`)."""
        binding.verify_identity(self, "state_dict")

        def build() -> dict[str, Any]:
            children = {role: child.state_dict() for role, child in self._children}
            return build_composite_state_dict(children, self._child_implementations, self.parameter_routing())

        return export_with_hooks(self, build)

    def stage_state_dict(self, state_dict: Mapping[str, Any]) -> StagedTransaction:
        """Validate the envelope and stage every child (no hooks, no mutation).

        Raises ``NotSupportedError`` when a child cannot stage its load (the composite's load
        is then not atomic; ``load_state_dict`` still works).
        """
        if not all(checkpoint.staged_capable(child) for _, child in self._children):
            status = self.optimizer_contract().capabilities.feature(FEATURE_STAGED_NATIVE_LOAD)
            raise NotSupportedError(FEATURE_STAGED_NATIVE_LOAD, status.reasons)
        return checkpoint.stage(self, state_dict, run_child_hooks=False)

    def commit_staged_state_dict(self, staged: StagedTransaction) -> None:
        """Publish every child's staged load; refuses (``StaleTransactionError``, no change) a
        foreign or consumed transaction, or one staged before the composite or a child stepped,
        loaded or gained a group."""
        token = checkpoint.load_token(self)
        payload = require_transaction(staged).claim(self, kind=checkpoint.LOAD_KIND, current_token=token)
        checkpoint.commit(self, payload)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load pre-hooks; validate the envelope; each child's load pre-hooks and stage; publish
        every child; each child's load post-hooks; load post-hooks.

        With every child staged-capable, a rejected checkpoint (either half, or the envelope)
        leaves both children unchanged. A child without staged load is loaded with its own
        ``load_state_dict`` after the others are staged and before they are published, so its
        failure leaves them unchanged but may leave it partially loaded.
        """
        current = run_load_pre_hooks(self, state_dict)
        if all(checkpoint.staged_capable(child) for _, child in self._children):
            self.commit_staged_state_dict(checkpoint.stage(self, current, run_child_hooks=True))
            staged_children = [child for _, child in self._children]
        else:
            staged_children = checkpoint.load_partially_staged(self, current)
        for child in staged_children:
            run_load_post_hooks(child)
        run_load_post_hooks(self)

    # -- Python protocol ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # The model is held weakly and not copied along: a copy routes add_param_group by
        # names and shapes only. As torch's optimizers, a copy leaves behind the hooks and an
        # instance-patched step (an LR scheduler's wrapper, bound to the original); torch drops
        # the children's hooks on copy too, and the watch hooks are re-added.
        state = {key: value for key, value in self.__dict__.items() if key not in _INSTANCE_ONLY}
        state["_model_ref"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name in _HOOK_DICTS:
            self.__dict__.setdefault(name, OrderedDict())
        self._watch_children()

    def __repr__(self) -> str:
        parts = [f"implementation={self._implementation!r}"]
        for role, child in self._children:
            count = sum(len(g["params"]) for g in child.param_groups)
            parts.append(f"{role}={type(child).__name__}({count} parameters)")
        return f"{type(self).__name__}({', '.join(parts)})"


#: The hooks torch's optimizers keep per instance (a copy starts without them, as torch's).
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
_INSTANCE_ONLY = frozenset({*_HOOK_DICTS, "step"})


def _optimized_ids(composite: CompositeOptimizer) -> set[int]:
    return {id(parameter) for group in composite.param_groups for parameter in group["params"]}


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    if "closure" in kwargs:
        if len(args) > 1:
            raise TypeError("step() got the closure both positionally and by keyword")
        extra = set(kwargs) - {"closure"}
        if extra:
            raise TypeError(f"step() got unexpected keyword arguments {sorted(extra)}")
        return kwargs["closure"]  # type: ignore[no-any-return]
    if kwargs:
        raise TypeError(f"step() got unexpected keyword arguments {sorted(kwargs)}")
    if len(args) > 2:
        raise TypeError(f"step() takes at most one argument (the closure), got {len(args) - 1}")
    return args[1] if len(args) == 2 else None

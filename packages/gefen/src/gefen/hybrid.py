"""``GefenMuonHybrid``: GefenMuon for the hidden matrices, a Gefen or AdamW backup for the rest.

The hybrid is gefen-hybrid's :class:`~gefen_hybrid.CompositeOptimizer` with two children
built here: a ``GefenMuon`` (role ``"muon"``) over the 2-D hidden matrices and a backup
(role ``"backup"``): ``Gefen`` (``backup_optimizer="gefen"``, the default) or
``ContractedAdamW`` (``"adamw"``) over embeddings, heads, norms, biases and every tensor that
is not 2-D. Everything the composite promises (one closure and one failure vote per step,
atomic load of both halves, live ``param_groups`` for LR schedulers and GradScaler, hooks
that fire once, the contract derived from the children's) holds unchanged; this module only
decides which child gets which parameter and with which options.

Defaults follow the reference implementation's hybrid, except three: ``fused=None`` (a
registered kernel when it supports the tensors) instead of ``True``, since a missing kernel is
not an error unless asked for; a Gefen-only option given with an AdamW backup is an error
instead of being ignored; and the Muon half runs torch Muon's update (5 standard
Newton-Schulz steps, no NorMuon) instead of ``tuned3`` with NorMuon, which cost 1.0-1.3 % of
held-out loss (``docs/benchmarks.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NoReturn

import torch
from gefen_core import Gefen, GefenMuon
from gefen_hybrid import (
    ROLE_BACKUP,
    ROLE_MUON,
    CompositeOptimizer,
    ContractedAdamW,
    NamedParameter,
    RoutedParameters,
    RoutingRules,
    route_model,
    route_named_parameters,
    split_by_role,
)
from torch import nn

__all__ = ["BACKUP_OPTIMIZERS", "IMPLEMENTATION", "GefenMuonHybrid"]

#: The implementation name the hybrid publishes in its contract and checkpoints.
IMPLEMENTATION = "gefen.GefenMuonHybrid"
#: Accepted values of ``backup_optimizer``.
BACKUP_OPTIMIZERS = ("gefen", "adamw")
_DEFAULT_WORKSPACE_BYTES = 256 << 20

_CALL_FORMS = (
    "pass the model (GefenMuonHybrid(model, lr=...)), its named parameters "
    "(GefenMuonHybrid(model.named_parameters(), lr=...)), or two lists of (name, parameter) pairs "
    "(GefenMuonHybrid(matrix_named, backup_named, lr=...))"
)

#: Backup-constructor keywords the hybrid sets from its own arguments (keyword -> hybrid argument).
_BACKUP_OWNED: dict[str, dict[str, str]] = {
    "gefen": {
        "params": "params/backup_params",
        "lr": "backup_lr",
        "betas": "betas",
        "eps": "eps",
        "weight_decay": "backup_weight_decay",
        "fused": "fused",
        "force_1d_period_one": "backup_1d_period_one",
        "force_2d_period_one": "backup_2d_period_one",
        "stochastic_round": "stochastic_round",
        "deterministic": "deterministic",
        "capturable": "capturable",
    },
    "adamw": {
        "params": "params/backup_params",
        "lr": "backup_lr",
        "betas": "betas",
        "eps": "eps",
        "weight_decay": "backup_weight_decay",
        "capturable": "capturable",
    },
}
#: GefenMuon keywords the hybrid sets from its own arguments (keyword -> hybrid argument).
_MUON_OWNED: dict[str, str] = {
    "params": "params",
    "lr": "muon_lr",
    "weight_decay": "muon_weight_decay",
    **{
        name: name
        for name in (
            "momentum",
            "nesterov",
            "ns_steps",
            "ns_schedule",
            "adjust_lr_fn",
            "fused",
            "sharded_mode",
            "fp8_ns",
            "fp8_ns_compile",
            "batched_ns",
            "batched_ns_workspace_bytes",
            "stochastic_round",
            "deterministic",
            "normuon",
            "normuon_beta2",
            "normuon_eps",
            "cautious",
            "capturable",
            "verbose",
        )
    },
}


class GefenMuonHybrid(CompositeOptimizer):
    """GefenMuon for the hidden 2-D matrices plus a ``Gefen`` or ``ContractedAdamW`` backup.

    Call forms (parameters must be named; a bare tensor raises ``TypeError`` saying how to
    pass names):

    * ``GefenMuonHybrid(model, lr=...)``: routed by module type and name (embedding weights,
      tied heads that share them, and the weight of an ``nn.Linear`` registered as ``lm_head``,
      ``output`` or ``head`` at any depth go to the backup by tensor identity);
    * ``GefenMuonHybrid(model.named_parameters(), lr=...)``: routed by name and shape;
    * ``GefenMuonHybrid(matrix_named, backup_named, lr=...)``: the reference's two lists,
      used as given (either may be empty; ``backup_substrings``/``rules`` are refused).

    Routing (gefen-hybrid's :class:`~gefen_hybrid.RoutingRules`): 2-D parameters go to
    GefenMuon unless they are an embedding's or output head's weight (the model form) or their
    name contains one of
    ``backup_substrings`` (default ``embed``, ``wte``, ``wpe``, ``lm_head``, ``classifier``,
    ``score``); every other parameter goes to the backup. Frozen parameters are skipped.

    ``lr`` is required and is the default of both halves (``muon_lr``, ``backup_lr``);
    ``weight_decay`` likewise (``muon_weight_decay``, ``backup_weight_decay``).
    ``no_decay_substrings`` splits the backup into a decayed group and a group with weight
    decay 0 for the parameters whose name contains one of them (case-insensitive).
    ``betas`` and ``eps`` are the backup's; the Muon half keeps GefenMuon's own ``eps`` and
    coefficients unless ``muon_kwargs`` sets them. ``fused`` goes to the Gefen-family
    children (``None``: a registered kernel when it supports the tensors, ``True``: require
    one, ``False``: the reference path); AdamW's own ``foreach``/``fused`` flags go through
    ``backup_kwargs``. ``stochastic_round``, ``deterministic`` and ``capturable`` go to every
    Gefen-family child (``capturable`` also to AdamW; GefenMuon refuses it). The Gefen backup
    keeps Gefen's defaults: a factored second moment for matrices (embeddings, heads);
    ``backup_1d_period_one`` / ``backup_2d_period_one`` (default ``None``: Gefen's default)
    force per-element state for 1-D / 2-D parameters. The reference built it with block-shared second moments, which
    ``gefen bench quality`` measured 7.8 % worse on matrices; ``backup_kwargs={"factored_v_2d":
    False}`` restores that.

    ``muon_kwargs`` / ``backup_kwargs`` pass further constructor keywords to one child; a
    keyword this constructor already sets from one of its own arguments raises
    ``TypeError`` naming that argument.

    Raises ``ValueError`` for an unknown ``backup_optimizer``, no trainable parameters,
    only zero-element parameters (ZeRO-3 placeholders cannot be routed by shape), or a
    Gefen-only option (``backup_1d_period_one``, ``backup_2d_period_one``) with an AdamW
    backup; warns (``UserWarning``) when ``adjust_lr_fn`` is ``None`` or ``"original"``
    (Muon-native scaling mis-scales an AdamW-scale learning rate). The children validate
    their own options and raise their own errors.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[NamedParameter],
        backup_params: Iterable[NamedParameter] | None = None,
        *,
        lr: float,
        backup_optimizer: str = "gefen",
        muon_lr: float | None = None,
        backup_lr: float | None = None,
        weight_decay: float = 0.0,
        muon_weight_decay: float | None = None,
        backup_weight_decay: float | None = None,
        no_decay_substrings: Sequence[str] = (),
        backup_substrings: Sequence[str] | None = None,
        rules: RoutingRules | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        fused: bool | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_schedule: Any = None,
        adjust_lr_fn: str | None = "match_rms_adamw",
        sharded_mode: str = "exact",
        fp8_ns: bool = False,
        fp8_ns_compile: bool = True,
        batched_ns: bool = False,
        batched_ns_workspace_bytes: int = _DEFAULT_WORKSPACE_BYTES,
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        cautious: bool = False,
        backup_1d_period_one: bool | None = None,
        backup_2d_period_one: bool | None = None,
        stochastic_round: bool = False,
        deterministic: bool = False,
        capturable: bool = False,
        verbose: bool = False,
        muon_kwargs: Mapping[str, Any] | None = None,
        backup_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if type(backup_optimizer) is not str or backup_optimizer not in BACKUP_OPTIMIZERS:
            raise ValueError(f"backup_optimizer must be one of {BACKUP_OPTIMIZERS}, got {backup_optimizer!r}")
        if backup_optimizer == "adamw":
            for name, value in (
                ("backup_1d_period_one", backup_1d_period_one),
                ("backup_2d_period_one", backup_2d_period_one),
            ):
                if value is not None:
                    raise ValueError(
                        f"{name} applies to the Gefen backup only; AdamW already keeps per-element state "
                        "(use backup_optimizer='gefen' or drop the option)"
                    )
        extra_muon = _extra_kwargs(muon_kwargs, "muon_kwargs", _MUON_OWNED)
        extra_backup = _extra_kwargs(backup_kwargs, "backup_kwargs", _BACKUP_OWNED[backup_optimizer])
        routing_rules = _routing_rules(backup_substrings, rules)
        routed, model = _route(params, backup_params, routing_rules)

        muon_named = routed.for_role(ROLE_MUON)
        backup_named = routed.for_role(ROLE_BACKUP)
        if muon_named and adjust_lr_fn in (None, "original", "spectral_unclamped"):
            warnings.warn(
                f"GefenMuonHybrid(adjust_lr_fn={adjust_lr_fn!r}) uses Muon-native update scaling, which mis-scales an "
                "AdamW-scale learning rate shared with the backup; use adjust_lr_fn='match_rms_adamw' (the default) "
                "or give the Muon half its own muon_lr",
                UserWarning,
                stacklevel=2,
            )
        fragments = _no_decay_fragments(no_decay_substrings)  # checked also when nothing goes to the backup
        children: dict[str, torch.optim.Optimizer] = {}
        if muon_named:
            children[ROLE_MUON] = GefenMuon(
                # the group's rate and the default (for groups added later) are copies of their own
                [{"params": muon_named, "lr": _own_copy(lr if muon_lr is None else muon_lr)}],
                lr=_own_copy(lr if muon_lr is None else muon_lr),
                weight_decay=weight_decay if muon_weight_decay is None else muon_weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                ns_schedule=ns_schedule,
                adjust_lr_fn=adjust_lr_fn,
                fused=fused,
                sharded_mode=sharded_mode,
                fp8_ns=fp8_ns,
                fp8_ns_compile=fp8_ns_compile,
                batched_ns=batched_ns,
                batched_ns_workspace_bytes=batched_ns_workspace_bytes,
                stochastic_round=stochastic_round,
                deterministic=deterministic,
                normuon=normuon,
                normuon_beta2=normuon_beta2,
                normuon_eps=normuon_eps,
                cautious=cautious,
                capturable=capturable,
                verbose=verbose,
                **extra_muon,
            )
        if backup_named:
            groups = _backup_groups(backup_named, fragments)
            for group in groups:
                group["lr"] = _own_copy(lr if backup_lr is None else backup_lr)
            common: dict[str, Any] = {
                "lr": _own_copy(lr if backup_lr is None else backup_lr),
                "betas": betas,
                "eps": eps,
                "weight_decay": weight_decay if backup_weight_decay is None else backup_weight_decay,
                "capturable": capturable,
            }
            if backup_optimizer == "gefen":
                overrides = {
                    key: value
                    for key, value in (
                        ("force_1d_period_one", backup_1d_period_one),
                        ("force_2d_period_one", backup_2d_period_one),
                    )
                    if value is not None
                }
                children[ROLE_BACKUP] = Gefen(
                    groups,
                    fused=fused,
                    stochastic_round=stochastic_round,
                    deterministic=deterministic,
                    **{**common, **overrides, **extra_backup},
                )
            else:
                children[ROLE_BACKUP] = ContractedAdamW(groups, **common, **extra_backup)
        self._backup_optimizer = backup_optimizer
        super().__init__(children, implementation=IMPLEMENTATION, rules=routing_rules, model=model)

    def add_param_group(
        self, param_group: dict[str, Any], *, role_options: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        """The composite's ``add_param_group``; a group without its own ``lr`` gets a copy of
        each child's tensor default rate (as the constructor's groups do), not the one tensor
        the child's other groups could share."""
        if "lr" not in param_group:
            extra = {role: dict(options) for role, options in (role_options or {}).items()}
            for role, child in self.child_optimizers().items():
                default = child.defaults.get("lr")
                if isinstance(default, torch.Tensor) and "lr" not in extra.get(role, {}):
                    extra.setdefault(role, {})["lr"] = _own_copy(default)
            role_options = extra
        super().add_param_group(param_group, role_options=role_options)

    @classmethod
    def from_model(cls, model: nn.Module, **options: Any) -> GefenMuonHybrid:
        """``GefenMuonHybrid(model, **options)``: route ``model`` by module type and name."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"from_model needs an nn.Module, got {type(model).__name__}")
        return cls(model, **options)

    @classmethod
    def from_factories(cls, *args: Any, **kwargs: Any) -> NoReturn:
        """Not available: the hybrid builds its own children (use ``CompositeOptimizer.from_factories``)."""
        raise TypeError(
            "GefenMuonHybrid builds its own GefenMuon and backup children; to compose other optimizers use "
            "gefen_hybrid.CompositeOptimizer.from_factories"
        )

    @property
    def backup_optimizer(self) -> str:
        """``"gefen"`` or ``"adamw"``: which optimizer the backup half is (or would be)."""
        return self._backup_optimizer

    @property
    def muon(self) -> GefenMuon | None:
        """The GefenMuon child, or ``None`` when no parameter routed to it."""
        child = self.child_optimizers().get(ROLE_MUON)
        return child if isinstance(child, GefenMuon) else None

    @property
    def backup(self) -> torch.optim.Optimizer | None:
        """The backup child (``Gefen`` or ``ContractedAdamW``), or ``None`` when nothing routed to it."""
        return self.child_optimizers().get(ROLE_BACKUP)

    def __repr__(self) -> str:
        counts = {
            role: sum(len(group["params"]) for group in child.param_groups)
            for role, child in self.child_optimizers().items()
        }
        return (
            f"GefenMuonHybrid(muon_params={counts.get(ROLE_MUON, 0)}, backup_params={counts.get(ROLE_BACKUP, 0)}, "
            f"backup_optimizer={self._backup_optimizer!r})"
        )


def _extra_kwargs(given: Mapping[str, Any] | None, what: str, owned: Mapping[str, str]) -> dict[str, Any]:
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise TypeError(f"{what} must be a mapping of constructor keyword -> value, got {type(given).__name__}")
    extra = dict(given)
    for key in extra:
        if type(key) is not str:
            raise TypeError(f"{what} keys must be keyword names (str), got {key!r}")
        if key in owned:
            raise TypeError(
                f"{what}[{key!r}] is set by GefenMuonHybrid's own argument {owned[key]!r}; pass it there instead"
            )
    return extra


def _routing_rules(backup_substrings: Sequence[str] | None, rules: RoutingRules | None) -> RoutingRules | None:
    if rules is not None and not isinstance(rules, RoutingRules):
        raise TypeError(f"rules must be a gefen_hybrid.RoutingRules, got {type(rules).__name__}")
    if backup_substrings is None:
        return rules
    if rules is not None:
        raise TypeError("give backup_substrings or rules, not both (RoutingRules has a backup_substrings field)")
    # RoutingRules checks the value itself (a single str would otherwise split into letters here)
    return RoutingRules(backup_substrings=backup_substrings)  # type: ignore[arg-type]


def _unnamed(index: int, item: object, where: str) -> NoReturn:
    kind = "a bare tensor" if isinstance(item, torch.Tensor) else f"a {type(item).__name__}"
    hint = (
        " (param-group dicts are not accepted: use muon_lr/backup_lr and add_param_group)"
        if isinstance(item, Mapping)
        else ""
    )
    raise TypeError(
        f"GefenMuonHybrid routes parameters by name and shape, but {where}[{index}] is {kind}{hint}; {_CALL_FORMS}"
    )


def _named_list(params: object, where: str) -> list[NamedParameter]:
    if isinstance(params, (torch.Tensor, str, bytes, Mapping)) or not isinstance(params, Iterable):
        raise TypeError(f"GefenMuonHybrid: {where} must be an iterable of (name, parameter) pairs; {_CALL_FORMS}")
    items = list(params)
    for index, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and type(item[0]) is str):
            _unnamed(index, item, where)
    return items


def _route(
    params: object, backup_params: object, rules: RoutingRules | None
) -> tuple[RoutedParameters, nn.Module | None]:
    if backup_params is not None:
        if rules is not None:
            raise TypeError(
                "backup_substrings/rules route a model or a list of named parameters; with two explicit lists "
                "(matrix parameters, backup parameters) nothing is routed"
            )
        routed = split_by_role(
            {ROLE_MUON: _named_list(params, "params"), ROLE_BACKUP: _named_list(backup_params, "backup_params")}
        )
        _check_materialized(routed)
        return routed, None
    if isinstance(params, nn.Module):
        routed = route_model(params, rules)
        model: nn.Module | None = params
    else:
        routed, model = route_named_parameters(_named_list(params, "params"), rules), None
    _check_materialized(routed)
    return routed, model


def _check_materialized(routed: RoutedParameters) -> None:
    named = [item for role in (ROLE_MUON, ROLE_BACKUP) for item in routed.by_role[role]]
    if not named:
        raise ValueError(
            f"GefenMuonHybrid got no trainable parameters (requires_grad=False ones are skipped); {_CALL_FORMS}"
        )
    if all(parameter.numel() == 0 for _, parameter in named):
        raise ValueError(
            "GefenMuonHybrid: every parameter has zero elements (ZeRO-3 style partitioned placeholders?); the "
            "hybrid needs materialized parameters (GefenMuon does not run under DeepSpeed ZeRO; use FSDP2)"
        )


def _no_decay_fragments(no_decay_substrings: Sequence[str]) -> tuple[str, ...]:
    if isinstance(no_decay_substrings, str) or not isinstance(no_decay_substrings, Iterable):
        raise TypeError("no_decay_substrings must be a sequence of str (e.g. ('bias', 'norm')), not a single str")
    fragments = tuple(no_decay_substrings)
    for index, fragment in enumerate(fragments):
        if type(fragment) is not str or not fragment:
            raise TypeError(f"no_decay_substrings[{index}] must be a non-empty str, got {fragment!r}")
    return fragments


def _own_copy(lr: Any) -> Any:
    """A tensor ``lr`` copied for one group the hybrid builds: torch's schedulers rescale each
    group's tensor ``lr`` in place (``ReduceLROnPlateau`` one group after another), so one tensor held
    by every group was rescaled once per group, two or three times per step of the schedule."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _backup_groups(named: list[NamedParameter], fragments: tuple[str, ...]) -> list[dict[str, Any]]:
    lowered = tuple(fragment.lower() for fragment in fragments)
    exempt = [(n, p) for n, p in named if any(fragment in n.lower() for fragment in lowered)]
    decayed = [(n, p) for n, p in named if not any(fragment in n.lower() for fragment in lowered)]
    groups: list[dict[str, Any]] = []
    if decayed:
        groups.append({"params": decayed})
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups

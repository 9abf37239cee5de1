"""Which role each parameter goes to: the routing rules and the routed parameter lists.

Routing is decided once per parameter, when it is added, and never changes. The default
rules send hidden 2-D matrices to ``"muon"`` and everything else to ``"backup"``:

1. an explicit override (``RoutingRules.overrides``, FQN -> role) wins;
2. then a predicate (``RoutingRules.predicate(name, parameter)``), if it returns a role;
3. when a model is routed, by module type and matched by tensor identity: the ``weight``
   of any ``nn.Embedding`` / ``nn.EmbeddingBag`` (or subclass), so a tied LM head follows
   its embedding whatever it is named, and the weight of an output head, an ``nn.Linear``
   registered under one of :data:`OUTPUT_HEAD_NAMES` (torchtitan's ``output``, HF's
   ``lm_head``, timm's ``head``), go to the backup;
4. a parameter that is not 2-D (norms, biases, convolutions) goes to the backup;
5. a name containing one of ``backup_substrings`` (case-insensitive; by default
   ``embed``, ``wte``, ``wpe``, ``lm_head``, ``classifier``, ``score``) goes to the backup;
6. everything else goes to muon.

Without a model (named parameters only) module types are unknown: rule 3 cannot apply, and
a 2-D parameter routed to muon whose name says nothing of its module (``nn.Sequential``'s
``"0.weight"``) or that names an output head is reported in one :class:`RoutingWarning`.

Parameters are always named: the routing report, the checkpoint and the overrides use the
names. Frozen parameters (``requires_grad=False``) are skipped, and a tensor that appears
twice (tied weights) is routed once, under its first name.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from gefen_contracts.frozen import FrozenMap
from torch import nn

from .roles import ROLE_BACKUP, ROLE_MUON, ROLES, check_role

__all__ = [
    "DEFAULT_BACKUP_SUBSTRINGS",
    "FrozenLeftOut",
    "OUTPUT_HEAD_NAMES",
    "NamedParameter",
    "RoutePredicate",
    "RoutedParameters",
    "RoutingDecision",
    "RoutingRules",
    "RoutingWarning",
    "backup_module_weight_ids",
    "named_parameter_list",
    "route_model",
    "route_named_parameters",
    "routing_report",
    "split_by_role",
]

#: Name fragments that send a 2-D parameter to the backup. Broad tokens such as ``head`` and
#: ``output`` are deliberately absent: they would catch hidden matrices in many models.
DEFAULT_BACKUP_SUBSTRINGS: tuple[str, ...] = ("embed", "wte", "wpe", "lm_head", "classifier", "score")
#: Module names (the last component) of the ``nn.Linear`` output heads a routed model sends to
#: the backup. Matched on modules, not parameter-name substrings, so ``attn.heads`` is not one.
OUTPUT_HEAD_NAMES: tuple[str, ...] = ("lm_head", "output", "head")


class RoutingWarning(UserWarning):
    """Named parameters were routed whose names cannot tell an embedding or a head from a hidden
    matrix, or a model's parameter left out because it was frozen has a gradient."""


class FrozenLeftOut:
    """A routed model's parameters that were frozen, so left out, when the composite was built
    (held weakly). :meth:`check` warns once if one of them has a gradient and is still not
    optimized: it was unfrozen (as a gradual-unfreezing fine-tune does) and is not trained,
    where torch's optimizers, which keep frozen parameters, would train it."""

    def __init__(self, model: nn.Module, optimized: set[int]) -> None:
        self._left: list[tuple[str, weakref.ref[torch.Tensor]]] = [
            (name, weakref.ref(parameter))
            for name, parameter in model.named_parameters()
            if not parameter.requires_grad and id(parameter) not in optimized
        ]

    def check(self, optimized: Callable[[], set[int]]) -> None:
        """Called by every step while something is left; ``optimized`` gives the ids of the
        parameters optimized now (a frozen one may have been added by ``add_param_group``)."""
        if not any((p := ref()) is not None and p.grad is not None for _, ref in self._left):
            return  # the common case: one attribute read per left-out parameter
        ids = optimized()
        unfrozen = [
            name for name, ref in self._left if (p := ref()) is not None and p.grad is not None and id(p) not in ids
        ]
        self._left = [(name, ref) for name, ref in self._left if (p := ref()) is not None and id(p) not in ids]
        if unfrozen:
            self._left = []  # warn once
            warnings.warn(
                f"{len(unfrozen)} parameter(s) of the model were frozen when this optimizer was built, so it left "
                f"them out, and now have gradients: {unfrozen[:3]} are not trained; build the optimizer after "
                "unfreezing them, or add them with add_param_group (a composite can add them only to a role it has a "
                "child for); to unfreeze in stages, build the optimizer with every layer trainable and freeze after",
                RoutingWarning,
                stacklevel=3,
            )

    def __bool__(self) -> bool:
        return bool(self._left)

    def __getstate__(self) -> dict[str, object]:
        return {"_left": []}  # weak references neither pickle nor belong to a copy


NamedParameter = tuple[str, torch.Tensor]
#: ``predicate(name, parameter)`` returns a role to force, or ``None`` to let the next rule decide.
RoutePredicate = Callable[[str, torch.Tensor], str | None]

_UNNAMED_HINT = (
    "the composite routes parameters by name: pass model.named_parameters() or a list of (name, parameter) pairs"
)


@dataclass(frozen=True, slots=True)
class RoutingRules:
    """The rules that assign a role to a parameter (see the module docstring for the order)."""

    backup_substrings: tuple[str, ...] = DEFAULT_BACKUP_SUBSTRINGS
    overrides: Mapping[str, str] = field(default_factory=FrozenMap)
    predicate: RoutePredicate | None = None
    embedding_types: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)

    def __post_init__(self) -> None:
        if isinstance(self.backup_substrings, str) or not isinstance(self.backup_substrings, Iterable):
            raise TypeError("RoutingRules.backup_substrings must be a sequence of str, not a single str")
        substrings = tuple(self.backup_substrings)
        for index, item in enumerate(substrings):
            if type(item) is not str or not item:
                raise TypeError(f"RoutingRules.backup_substrings[{index}] must be a non-empty str, got {item!r}")
        object.__setattr__(self, "backup_substrings", tuple(s.lower() for s in substrings))
        if not isinstance(self.overrides, Mapping):
            raise TypeError("RoutingRules.overrides must be a mapping of parameter name -> role")
        for name, role in self.overrides.items():
            if type(name) is not str or not name:
                raise TypeError(f"RoutingRules.overrides keys must be parameter names (str), got {name!r}")
            check_role(role, f"RoutingRules.overrides[{name!r}]")
        object.__setattr__(self, "overrides", FrozenMap(dict(self.overrides)))
        if self.predicate is not None and not callable(self.predicate):
            raise TypeError("RoutingRules.predicate must be callable(name, parameter) -> role or None")
        if isinstance(self.embedding_types, type) or not isinstance(self.embedding_types, Iterable):
            raise TypeError(
                f"RoutingRules.embedding_types must be a tuple of nn.Module subclasses, got {self.embedding_types!r}"
            )
        embedding_types = tuple(self.embedding_types)
        for kind in embedding_types:
            if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
                raise TypeError(f"RoutingRules.embedding_types must hold nn.Module subclasses, got {kind!r}")
        object.__setattr__(self, "embedding_types", embedding_types)

    def role_for(self, name: str, parameter: torch.Tensor, *, is_embedding: bool = False) -> str:
        """The role of one parameter; ``is_embedding`` says it is an embedding module's weight."""
        return self.decide(name, parameter, is_embedding=is_embedding)[0]

    def decide(self, name: str, parameter: torch.Tensor, *, is_embedding: bool = False) -> tuple[str, str]:
        """``(role, reason)`` of one parameter: which rule of the module docstring decided."""
        override = self.overrides.get(name)
        if override is not None:
            return override, "override"
        if self.predicate is not None:
            chosen = self.predicate(name, parameter)
            if chosen is not None:
                return check_role(chosen, f"RoutingRules.predicate({name!r}, ...)"), "predicate"
        if is_embedding:
            return ROLE_BACKUP, "embedding or output-head module"
        if parameter.dim() != 2:
            return ROLE_BACKUP, f"{parameter.dim()}-D, not a matrix"
        lowered = name.lower()
        for fragment in self.backup_substrings:
            if fragment in lowered:
                return ROLE_BACKUP, f"name contains {fragment!r}"
        return ROLE_MUON, "hidden 2-D matrix"


@dataclass(frozen=True, slots=True, eq=False)
class RoutedParameters:
    """Named parameters per role, each list in the order the parameters were given."""

    by_role: Mapping[str, Sequence[NamedParameter]]

    def __post_init__(self) -> None:
        frozen = {role: tuple(self.by_role.get(role, ())) for role in ROLES}
        object.__setattr__(self, "by_role", MappingProxyType(frozen))

    def for_role(self, role: str) -> list[NamedParameter]:
        return list(self.by_role[role])

    @property
    def present_roles(self) -> tuple[str, ...]:
        """Roles that received at least one parameter, in :data:`ROLES` order."""
        return tuple(role for role in ROLES if self.by_role[role])

    def routing(self) -> tuple[tuple[str, str], ...]:
        """Sorted ``(name, role)`` pairs."""
        return tuple(sorted((name, role) for role in ROLES for name, _ in self.by_role[role]))


def named_parameter_list(params: object, what: str = "params", *, keep_frozen: bool = False) -> list[NamedParameter]:
    """Validate ``(name, tensor)`` pairs: trainable only (frozen ones too with ``keep_frozen``),
    tied tensors once, names unique.

    Raises ``TypeError`` for unnamed parameters (with how to pass names) and ``ValueError``
    for one name given to two different tensors.
    """
    if isinstance(params, (torch.Tensor, str, bytes, Mapping)):
        raise TypeError(f"{what}: {_UNNAMED_HINT}; got a {type(params).__name__}")
    if not isinstance(params, Iterable):
        raise TypeError(f"{what}: {_UNNAMED_HINT}; got a {type(params).__name__}")
    named: list[NamedParameter] = []
    seen_tensors: set[int] = set()
    seen_names: dict[str, torch.Tensor] = {}
    for index, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            raise TypeError(f"{what}[{index}] is a bare tensor: {_UNNAMED_HINT}")
        if isinstance(item, Mapping):
            raise TypeError(
                f"{what}[{index}] is a param-group dict: {_UNNAMED_HINT}, then use add_param_group "
                "or build the children yourself for per-group options"
            )
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(f"{what}[{index}] must be a (name, parameter) pair: {_UNNAMED_HINT}")
        name, tensor = item
        if type(name) is not str:
            raise TypeError(f"{what}[{index}] has a {type(name).__name__} name: {_UNNAMED_HINT}")
        if not name or name != name.strip():
            raise ValueError(f"{what}[{index}] has name {name!r}; names must be non-empty, without outer spaces")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}[{index}] ({name!r}) holds a {type(tensor).__name__}, not a tensor")
        if not (tensor.requires_grad or keep_frozen):
            continue
        if id(tensor) in seen_tensors:
            continue  # a tied weight: routed once, under its first name
        previous = seen_names.get(name)
        if previous is not None:
            raise ValueError(f"{what}: the name {name!r} is given to two different tensors")
        seen_tensors.add(id(tensor))
        seen_names[name] = tensor
        named.append((name, tensor))
    return named


def backup_module_weight_ids(model: nn.Module, types: tuple[type[nn.Module], ...]) -> frozenset[int]:
    """Identities of the ``weight`` tensors rule 3 sends to the backup: every embedding module's
    (``types``) and every output head's (an ``nn.Linear`` named in :data:`OUTPUT_HEAD_NAMES`)."""
    ids = set()
    for name, module in model.named_modules():
        head = isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in OUTPUT_HEAD_NAMES
        if isinstance(module, types) or head:
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                ids.add(id(weight))
    return frozenset(ids)


def _unclassified(by_role: Mapping[str, Sequence[NamedParameter]]) -> list[str]:
    """Muon-routed names that say nothing of their module, or that name an output head."""
    found = []
    for name, _ in by_role[ROLE_MUON]:
        modules = name.split(".")[:-1]
        if not any(not part.isdigit() for part in modules) or modules[-1] in OUTPUT_HEAD_NAMES:
            found.append(name)
    return found


def _assign(
    named: list[NamedParameter], rules: RoutingRules, embedding_ids: frozenset[int]
) -> dict[str, list[NamedParameter]]:
    by_role: dict[str, list[NamedParameter]] = {role: [] for role in ROLES}
    for name, tensor in named:
        by_role[rules.role_for(name, tensor, is_embedding=id(tensor) in embedding_ids)].append((name, tensor))
    return by_role


def _check_overrides_known(named: list[NamedParameter], rules: RoutingRules) -> None:
    unknown = sorted(set(rules.overrides) - {name for name, _ in named})
    if unknown:
        raise ValueError(f"RoutingRules.overrides name parameters that are not trainable parameters here: {unknown}")


def _reject_placeholders(named: list[NamedParameter]) -> None:
    if named and all(tensor.numel() == 0 for _, tensor in named):
        raise ValueError(
            "every parameter has zero elements (ZeRO-3 style partitioned placeholders?): routing by shape needs "
            "materialized parameters; pass an explicit {'muon': [...], 'backup': [...]} split instead"
        )


def checked_rules(rules: RoutingRules | None) -> RoutingRules:
    """``rules`` (``None``: the defaults), refused with ``TypeError`` unless a :class:`RoutingRules`."""
    if rules is None:
        return RoutingRules()
    if not isinstance(rules, RoutingRules):
        raise TypeError(f"rules must be a gefen_hybrid.RoutingRules, got {type(rules).__name__}")
    return rules


def checked_module(model: nn.Module, where: str) -> nn.Module:
    """``model``, refused with ``TypeError`` (naming ``where``) unless an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where} needs an nn.Module, got {type(model).__name__}")
    return model


def route_model(model: nn.Module, rules: RoutingRules | None = None) -> RoutedParameters:
    """Route ``model``'s trainable parameters by module type and name (rules 1-6)."""
    model, rules = checked_module(model, "route_model"), checked_rules(rules)
    named = named_parameter_list(list(model.named_parameters()), "model.named_parameters()")
    _check_overrides_known(named, rules)
    _reject_placeholders(named)
    by_role = _assign(named, rules, backup_module_weight_ids(model, rules.embedding_types))
    muon = dict(by_role[ROLE_MUON])
    loose = [name for name in _loose_matrices(model) if name in muon and name not in rules.overrides]
    if loose:
        warnings.warn(
            f"{len(loose)} 2-D parameter(s) go to muon by shape although a model module holds them bare, beside its "
            f"layers, so no module type tells an embedding (a learned position table, say) from a hidden matrix: "
            f"{loose[:5]}; name each one in RoutingRules.overrides",
            RoutingWarning,
            stacklevel=3,
        )
    return RoutedParameters(by_role)


def _loose_matrices(model: nn.Module) -> list[str]:
    """Names of 2-D parameters registered directly on a module of the model's own (not torch's)
    that also has submodules: a container holding a bare matrix, as a learned position table or
    query bank is held. A leaf layer's own matrix (transformers' ``Conv1D``) is its weight."""
    found = []
    for prefix, module in model.named_modules():
        if type(module).__module__.startswith("torch.") or not any(True for _ in module.children()):
            continue
        for name, parameter in module.named_parameters(recurse=False):
            if parameter.dim() == 2:
                found.append(f"{prefix}.{name}" if prefix else name)
    return found


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """One row of :func:`routing_report`."""

    name: str
    shape: tuple[int, ...]
    role: str
    reason: str


def routing_report(model: nn.Module, rules: RoutingRules | None = None) -> tuple[RoutingDecision, ...]:
    """Every trainable parameter of ``model`` (tied tensors once) with the role :func:`route_model`
    gives it and the rule that decided, in ``named_parameters()`` order; a matrix that
    :func:`route_model` warns about (held bare beside a module's layers) says so in its reason."""
    model, rules = checked_module(model, "routing_report"), checked_rules(rules)
    named = named_parameter_list(list(model.named_parameters()), "model.named_parameters()")
    heads = backup_module_weight_ids(model, rules.embedding_types)
    loose = set(_loose_matrices(model)) - set(rules.overrides)
    rows = []
    for name, tensor in named:
        role, reason = rules.decide(name, tensor, is_embedding=id(tensor) in heads)
        if role == ROLE_MUON and name in loose:
            reason = "2-D, held bare beside layers: hidden or an embedding? (warned; name it in RoutingRules.overrides)"
        rows.append(RoutingDecision(name, tuple(tensor.shape), role, reason))
    return tuple(rows)


def route_named_parameters(
    params: Iterable[NamedParameter],
    rules: RoutingRules | None = None,
    *,
    embedding_ids: frozenset[int] = frozenset(),
    check_overrides: bool = True,
    keep_frozen: bool = False,
) -> RoutedParameters:
    """Route ``(name, parameter)`` pairs by name and shape. No module types are known, so only
    ``embedding_ids`` (:func:`backup_module_weight_ids` of the model, when the caller has it)
    identifies embeddings and heads; without them, unclassifiable muon names are reported in
    a :class:`RoutingWarning` (module docstring). Frozen parameters are skipped unless
    ``keep_frozen`` (a group added explicitly keeps them, as torch's ``add_param_group`` does)."""
    rules = checked_rules(rules)
    named = named_parameter_list(params, keep_frozen=keep_frozen)
    if check_overrides:
        _check_overrides_known(named, rules)
        _reject_placeholders(named)
    by_role = _assign(named, rules, embedding_ids)
    unclassified = [] if embedding_ids else [n for n in _unclassified(by_role) if n not in rules.overrides]
    if unclassified:
        warnings.warn(
            f"{len(unclassified)} 2-D parameter(s) go to muon by shape although their names cannot tell an "
            f"embedding or output head from a hidden matrix: {unclassified[:5]}; pass the model itself to route "
            "by module type, or name each one in RoutingRules.overrides",
            RoutingWarning,
            stacklevel=3,
        )
    return RoutedParameters(by_role)


def split_by_role(split: Mapping[str, Iterable[NamedParameter]]) -> RoutedParameters:
    """Validate an explicit ``{role: [(name, parameter), ...]}`` split.

    Roles must be known; a tensor or a name may appear in only one role (a tensor in two
    roles would be stepped twice).
    """
    by_role: dict[str, list[NamedParameter]] = {}
    owner: dict[int, str] = {}
    names: dict[str, str] = {}
    for role, params in split.items():
        check_role(role, "split role")
        named = named_parameter_list(params, f"split[{role!r}]")
        for name, tensor in named:
            if id(tensor) in owner:
                raise ValueError(
                    f"parameter {name!r} is listed under both {owner[id(tensor)]!r} and {role!r}; "
                    "it would be stepped twice"
                )
            if name in names:
                raise ValueError(f"the name {name!r} is used under both {names[name]!r} and {role!r}")
            owner[id(tensor)] = role
            names[name] = role
        by_role[role] = named
    return RoutedParameters(by_role)

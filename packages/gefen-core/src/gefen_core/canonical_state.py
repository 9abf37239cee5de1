"""Canonical local state of ``Gefen`` and ``GefenMuon``: their part of a ``gefen.bound_state`` document.

The envelope is gefen-contracts' (``build_bound_state`` / ``parse_bound_state``, format
version 1, committed golden vectors in the tests). :class:`CanonicalRole` (one per optimizer
class; the optimizer's three methods delegate to it) supplies:

* ``policy``: what the state means and the options that change it: ``state_format`` (the
  native format version whose entries the document carries), ``momentum`` and
  ``codebook_refresh_every`` (Gefen), ``stochastic_round`` and ``deterministic``; equal on
  import (a difference is named with both values);
* ``common``: ``global_step`` (int), ``codebook`` (fp32 ``[256]`` or ``None``) and
  ``codebook_scope`` (the scope's rank-neutral record, or ``None``; equal to the live one);
* per parameter, keyed by exact FQN: its compatibility name, its shard, its group options
  (every group key but ``params``, ``param_names`` and the native mirror; tuples become
  lists), its declared state variant (``gefen_contracts.state_layout.match_variants``; ``"uninitialized"``
  before its first step) and its authoritative state with int counters.

``prepare_local_import`` validates the envelope, the scope, the local FQN set and every
entry's shard (another member's slice is refused) and variant, regroups the entries by the
target's own groups (each group takes its options from the document, which must agree for
every parameter of the group) and rebuilds a positional native state dict that the
optimizer's native staging validates completely (shapes, dtypes, finiteness, counters,
codebook). So an import routes by FQN across regrouped or reordered targets, never mutates
the optimizer or the document, and bypasses hooks. The prepared import is single use; its
freshness token is the optimizer's mutation counter plus the version counters of every
parameter, option and state value (``gefen_contracts.torch_support.state_version_token``),
not a hash of the state.

Not supported (the contract says why): stochastic rounding (its random stream follows slot
positions, so a reordered target would continue differently), ``capturable=True`` (device
counters), layouts other than the optimizer's canonical ones (whole-parameter owners: the
state lives on one member; use portable state), and group options that are not
primitives or plain tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gefen_contracts import (
    FEATURE_CANONICAL_LOCAL_STATE,
    FeatureStatus,
    NotSupportedError,
    OptimizerStateLayout,
    StateValidationError,
)
from gefen_contracts.digest import canonical_digest
from gefen_contracts.enums import ParameterLayout
from gefen_contracts.state_layout import match_variants
from gefen_contracts.torch_support import BoundParameter, build_bound_state, parse_bound_state, state_version_token
from gefen_contracts.torch_support.option_records import option_blockers, options_equal, recorded_options
from gefen_contracts.transactions import StagedTransaction, require_transaction

from .identity import IdentityRecord, identity_readiness, verify_layout
from .native_records import GROUP_MIRROR, NativeFormat, with_state_digest

__all__ = ["NO_STATE_VARIANT", "CanonicalRole"]

#: The ``variant`` of a parameter without state (it has not stepped yet).
NO_STATE_VARIANT = "uninitialized"
_IMPORT_KIND = "gefen.local_import"
_NOT_EXPORTED = frozenset({"params", "param_names", GROUP_MIRROR})
_COMMON_KEYS = frozenset({"global_step", "codebook", "codebook_scope"})


def _fail(message: str) -> StateValidationError:
    return StateValidationError(f"canonical local state: {message}")


def _int_counter(value: object, where: str) -> int:
    number = float(value.item()) if isinstance(value, torch.Tensor) else value
    if type(number) is float and number.is_integer():
        number = int(number)
    if type(number) is not int or number < 0:
        raise _fail(f"{where} must be a whole number >= 0, got {value!r}")
    return number


@dataclass(frozen=True, slots=True)
class CanonicalRole:
    """``CanonicalLocalState`` for a Gefen-family optimizer class (see the module docstring).

    Each optimizer class owns one (``Gefen``'s :data:`gefen_core.gefen_binding.CANONICAL`,
    ``GefenMuon``'s :data:`gefen_core.muon_binding.CANONICAL`) and its three methods delegate
    to it; the role holds no state of its own, every method takes the optimizer, which
    provides ``_identity``, ``_version``, ``global_step``, ``_codebook``,
    ``_identity_implementation``, ``_identity_readiness()``, ``_verify_layout(where)`` and
    ``_native`` (its :class:`~gefen_core.optimizer_support.NativeCheckpoint`, which stages and
    publishes).
    """

    #: The declared state variants (``gefen_contracts.state_layout.match_variants``).
    layout: OptimizerStateLayout
    #: The shard layouts a document covers.
    layouts: frozenset[ParameterLayout]
    #: The per-parameter counters (ints in a document).
    counters: tuple[str, ...]
    #: The native format whose entries the document carries.
    native_format: NativeFormat
    #: ``optimizer -> policy record`` (the options that change what the state means).
    policy: Callable[[Any], dict[str, Any]]
    #: ``(optimizer, document common) -> the native format's optimizer-wide records``.
    record: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    #: ``optimizer -> reasons`` its options keep it out of canonical documents.
    blockers: Callable[[Any], tuple[str, ...]]
    #: ``(parameter, state entry) -> its tensors as the native state dict holds them``, or
    #: ``None`` when the live tensors already are.
    tensors: Callable[[torch.Tensor, Mapping[str, Any]], dict[str, torch.Tensor]] | None = None

    # -- readiness -----------------------------------------------------------------------------

    def status(self, optimizer: Any, identity_ready: FeatureStatus) -> FeatureStatus:
        """Whether canonical local state is supported now (cheap: types and structure only)."""
        if not identity_ready.supported:
            return FeatureStatus.no(*identity_ready.reasons)
        reasons = []
        if optimizer._stochastic_round:
            reasons.append(
                "stochastic_round=True: the rounding stream follows slot positions, so a regrouped or reordered "
                "target would not continue bit-exactly"
            )
        reasons.extend(self.blockers(optimizer))
        identity = optimizer._identity
        if identity is not None:
            other = sorted(layout.value for layout in identity.layouts - self.layouts)
            if other:
                allowed = sorted(layout.value for layout in self.layouts)
                reasons.append(
                    f"canonical local documents cover {allowed} shards; this member also holds {other} shards (their "
                    "state is not local to one member: use portable state)"
                )
        reasons.extend(option_blockers(optimizer.param_groups, "canonical", excluded=_NOT_EXPORTED, tensors=True))
        return FeatureStatus.no(*reasons) if reasons else FeatureStatus.yes()

    def _require(self, optimizer: Any, where: str) -> IdentityRecord:
        verify_layout(optimizer, where)
        status = self.status(optimizer, identity_readiness(optimizer).identity)
        if not status.supported or optimizer._identity is None:
            raise NotSupportedError(FEATURE_CANONICAL_LOCAL_STATE, status.reasons)
        return optimizer._identity  # type: ignore[no-any-return]

    @staticmethod
    def _freshness(optimizer: Any) -> Hashable:
        return (
            optimizer._version,
            optimizer.global_step,
            id(optimizer._codebook),
            id(optimizer.state),
            state_version_token(optimizer.param_groups, optimizer.state),
        )

    @staticmethod
    def _common(optimizer: Any) -> dict[str, Any]:
        identity = optimizer._identity
        scope = None if identity is None or identity.scope is None else identity.scope.scope_record()
        return {"global_step": optimizer.global_step, "codebook": optimizer._codebook, "codebook_scope": scope}

    # -- export ---------------------------------------------------------------------------------

    def _variant_of(self, keys: Sequence[str], layout: Any, rank: int, where: str) -> str:
        if not keys:
            return NO_STATE_VARIANT
        matches = match_variants(self.layout, keys, parameter_layout=layout, parameter_rank=rank)
        if len(matches) != 1:
            raise _fail(f"{where}: state keys {sorted(keys)} match {len(matches)} declared variants (one required)")
        return matches[0].name

    def _export_state(self, param: torch.Tensor, entry: Mapping[str, Any], where: str) -> dict[str, Any]:
        """One parameter's state as its document holds it (what its native state dict holds)."""
        exported = {
            key: _int_counter(value, f"{where} {key!r}") if key in self.counters else value
            for key, value in entry.items()
        }
        if exported and self.tensors is not None:
            exported.update(self.tensors(param, entry))
        return exported

    def export(self, optimizer: Any) -> dict[str, Any]:
        """This member's ``gefen.bound_state`` document (owned, tight, finite CPU copies; no collectives).

        ``NotSupportedError`` (with the contract's reasons) when canonical state is not
        supported now; ``StateValidationError`` for state that cannot be exported.
        """
        identity = self._require(optimizer, "export_local_state")
        sealed = identity.sealed
        parameters: dict[str, BoundParameter] = {}
        for index, group in enumerate(optimizer.param_groups):
            options = recorded_options(group, _NOT_EXPORTED)
            names = sealed.compatibility_names(index)
            for position, tensor in enumerate(group["params"]):
                shard = sealed.shard_identity(tensor)
                where = f"parameter {shard.fqn!r}"
                entry = optimizer.state.get(tensor) or {}
                variant = self._variant_of(list(entry), shard.layout, len(shard.parameter.global_shape), where)
                state = self._export_state(tensor, entry, where)
                parameters[shard.fqn] = BoundParameter(names[position], shard, options, variant, state)
        return build_bound_state(
            implementation=optimizer._identity_implementation,
            policy=self.policy(optimizer),
            common=self._common(optimizer),
            manifest=sealed.manifest,
            parameters=parameters,
        )

    # -- import ---------------------------------------------------------------------------------

    def _check_common(self, optimizer: Any, common: Mapping[str, Any]) -> None:
        if set(common) != _COMMON_KEYS:
            raise _fail(f"'common' keys must be {sorted(_COMMON_KEYS)}, got {sorted(map(str, common))}")
        if type(common["global_step"]) is not int or common["global_step"] < 0:
            raise _fail("'common.global_step' must be an int >= 0")
        live = self._common(optimizer)["codebook_scope"]
        try:
            same = canonical_digest(common["codebook_scope"]) == canonical_digest(live)
        except Exception:
            same = False
        if not same:
            raise _fail(
                f"the document's codebook scope {common['codebook_scope']!r} does not match this optimizer's {live!r}"
            )

    def _native_from_document(
        self, optimizer: Any, identity: IdentityRecord, document: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Validate ``document`` for this optimizer and rebuild it as a positional native state dict."""
        sealed = identity.sealed
        parsed = parse_bound_state(
            document,
            implementation=optimizer._identity_implementation,
            policy=self.policy(optimizer),
            manifest=sealed.manifest,
            local_shards=[shard for tensor, shard in sealed.bindings if tensor is not None],
        )
        self._check_common(optimizer, parsed.common)
        groups: list[dict[str, Any]] = []
        state: dict[int, dict[str, Any]] = {}
        pid = 0
        for index, group in enumerate(optimizer.param_groups):
            ids: list[int] = []
            options: tuple[str, dict[str, Any]] | None = None
            for tensor in group["params"]:
                shard = sealed.shard_identity(tensor)
                entry = parsed.parameters[shard.fqn]
                where = f"parameter {shard.fqn!r}"
                keys = list(entry.state)
                variant = self._variant_of(keys, shard.layout, len(shard.parameter.global_shape), where)
                if entry.variant != variant:
                    raise _fail(f"{where} declares variant {entry.variant!r} but its state keys make it {variant!r}")
                for key in self.counters:
                    if key in entry.state and type(entry.state[key]) is not int:
                        raise _fail(f"{where} counter {key!r} must be an int, got {type(entry.state[key]).__name__}")
                group_options = dict(entry.group_options)
                if options is None:
                    options = (shard.fqn, group_options)
                elif not options_equal(options[1], group_options):
                    raise _fail(
                        f"param group {index} holds {options[0]!r} and {shard.fqn!r}, whose document group options "
                        "differ; regroup the target so that each group's parameters share their options"
                    )
                if entry.state:
                    state[pid] = dict(entry.state)
                ids.append(pid)
                pid += 1
            saved: dict[str, Any] = (
                {k: v for k, v in group.items() if k not in _NOT_EXPORTED} if options is None else dict(options[1])
            )
            saved["params"] = ids
            if "param_names" in group:
                saved["param_names"] = list(group["param_names"])
            groups.append(saved)
        native = {"state": state, "param_groups": groups, **self.record(optimizer, parsed.common)}
        return with_state_digest(self.native_format, native)

    def prepare_import(self, optimizer: Any, document: Mapping[str, Any]) -> StagedTransaction:
        """Validate ``document`` completely and stage it, routed by FQN into the optimizer's own
        groups; never mutates the optimizer or the document, runs no hooks
        (``StateValidationError`` names the first problem)."""
        identity = self._require(optimizer, "prepare_local_import")
        native = self._native_from_document(optimizer, identity, document)
        payload = optimizer._native.stage(optimizer, native)
        return StagedTransaction(optimizer, kind=_IMPORT_KIND, token=self._freshness(optimizer), payload=payload)

    def commit_import(self, optimizer: Any, staged: StagedTransaction) -> None:
        """Publish a prepared import (single use; ``StaleTransactionError`` and no change for a
        foreign, consumed or stale one). Hooks are bypassed."""
        verify_layout(optimizer, "commit_local_import")
        payload = require_transaction(staged).claim(
            optimizer, kind=_IMPORT_KIND, current_token=self._freshness(optimizer)
        )
        optimizer._native.publish(optimizer, payload)

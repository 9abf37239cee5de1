"""``OptimizerContract``: the immutable, versioned declaration an optimizer publishes."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .capabilities import OptimizerCapabilities
from .errors import ContractError, ContractTypeError, NotSupportedError
from .frozen import FrozenMap, freeze_primitive
from .state_layout import OptimizerStateLayout
from .validation import exact_str, identity_name

__all__ = [
    "CONTRACT_SCHEMA_VERSION",
    "OptimizerChildContract",
    "OptimizerContract",
    "schema_compatible",
]

#: ``"MAJOR.MINOR"``: readers accept any minor of their major (unknown extensions are ignored).
CONTRACT_SCHEMA_VERSION = "3.0"
_SCHEMA_RE = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
_EXTENSION_RE = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")


def schema_compatible(version: str, reader: str = CONTRACT_SCHEMA_VERSION) -> bool:
    """True when a contract of ``version`` can be read by a reader of ``reader`` (same major)."""
    match, mine = _SCHEMA_RE.match(version), _SCHEMA_RE.match(reader)
    return bool(match and mine and match.group(1) == mine.group(1))


@dataclass(frozen=True, slots=True)
class OptimizerChildContract:
    """A composite's child: its role, its implementation name and its own contract
    (``None`` when the child publishes none)."""

    role: str
    implementation: str
    contract: OptimizerContract | None

    def __post_init__(self) -> None:
        identity_name(self.role, "OptimizerChildContract.role")
        identity_name(self.implementation, "OptimizerChildContract.implementation")
        if self.contract is not None and type(self.contract) is not OptimizerContract:
            raise ContractTypeError("OptimizerChildContract.contract must be an OptimizerContract or None")
        if self.contract is not None and self.contract.implementation != self.implementation:
            raise ContractError(
                f"child {self.role!r} implementation {self.implementation!r} differs from its contract's "
                f"{self.contract.implementation!r}"
            )


@dataclass(frozen=True, slots=True)
class OptimizerContract:
    """What one optimizer instance is, holds and supports, right now.

    ``implementation`` is a stable name (``"gefen.Gefen"``) that never changes when modules
    move. ``extensions`` holds namespaced, primitive-valued algorithm facts (for example
    ``"gefen.codebook"``) that generic consumers may ignore. A composite lists its
    ``children`` and its state layout's ``composite_namespaces`` equal their roles.
    """

    implementation: str
    state_layout: OptimizerStateLayout
    capabilities: OptimizerCapabilities
    children: tuple[OptimizerChildContract, ...] = ()
    extensions: Mapping[str, object] = field(default_factory=FrozenMap)
    schema_version: str = CONTRACT_SCHEMA_VERSION

    def __post_init__(self) -> None:
        identity_name(self.implementation, "OptimizerContract.implementation")
        if type(self.state_layout) is not OptimizerStateLayout:
            raise ContractTypeError("OptimizerContract.state_layout must be an OptimizerStateLayout")
        if type(self.capabilities) is not OptimizerCapabilities:
            raise ContractTypeError("OptimizerContract.capabilities must be an OptimizerCapabilities")
        if isinstance(self.children, (str, bytes, dict)) or not isinstance(self.children, Iterable):
            raise ContractTypeError("OptimizerContract.children must be a sequence of OptimizerChildContract")
        children = tuple(self.children)
        for index, child in enumerate(children):
            if type(child) is not OptimizerChildContract:
                raise ContractTypeError(f"OptimizerContract.children[{index}] must be an OptimizerChildContract")
        roles = tuple(c.role for c in children)
        if len(set(roles)) != len(roles):
            raise ContractError("OptimizerContract.children must have unique roles")
        if roles != self.state_layout.composite_namespaces:
            raise ContractError(
                f"a composite's state_layout.composite_namespaces {self.state_layout.composite_namespaces} must equal "
                f"its child roles {roles}"
            )
        object.__setattr__(self, "children", children)
        if not isinstance(self.extensions, Mapping):
            raise ContractTypeError("OptimizerContract.extensions must be a mapping")
        for key in self.extensions:
            exact_str(key, "OptimizerContract.extensions key")
            if not _EXTENSION_RE.match(key):
                raise ContractError(
                    f"extension key {key!r} must be namespaced lowercase like 'vendor.topic' (dots, a-z, 0-9, _)"
                )
        frozen = freeze_primitive(dict(self.extensions), "OptimizerContract.extensions")
        object.__setattr__(self, "extensions", frozen)
        exact_str(self.schema_version, "OptimizerContract.schema_version")
        if not schema_compatible(self.schema_version):
            raise ContractError(
                f"OptimizerContract.schema_version {self.schema_version!r} is not readable by schema "
                f"{CONTRACT_SCHEMA_VERSION!r} (same major required)"
            )

    def child(self, role: str) -> OptimizerChildContract:
        for candidate in self.children:
            if candidate.role == role:
                return candidate
        raise KeyError(role)

    def require(self, feature: str) -> None:
        """Raise :class:`NotSupportedError` (with the contract's reasons) unless ``feature`` is supported."""
        status = self.capabilities.feature(feature)
        if not status.supported:
            raise NotSupportedError(feature, status.reasons)

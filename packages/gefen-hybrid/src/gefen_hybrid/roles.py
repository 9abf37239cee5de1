"""The two roles of a composite optimizer and the mode tag that names a role."""

from __future__ import annotations

from typing import Final

__all__ = ["ROLES", "ROLE_BACKUP", "ROLE_MUON", "ROLE_TAG_PREFIX", "check_role", "role_tag"]

#: The role for hidden 2-D matrices (a Muon-family child, or any optimizer you put there).
ROLE_MUON: Final = "muon"
#: The role for everything else: embeddings, heads, norms, biases, non-2-D tensors.
ROLE_BACKUP: Final = "backup"
#: Every role, in the fixed order children are listed, stepped, saved and loaded.
ROLES: Final = (ROLE_MUON, ROLE_BACKUP)
#: Prefix of the mode tag that marks which role a composite claim or state variant belongs to.
ROLE_TAG_PREFIX: Final = "gefen.role="


def role_tag(role: str) -> str:
    """The mode tag ``"gefen.role=<role>"`` that the composite adds to each child's claims."""
    return ROLE_TAG_PREFIX + check_role(role, "role")


def check_role(value: object, what: str) -> str:
    """Return ``value`` if it is one of :data:`ROLES` (``ValueError`` naming ``what`` otherwise)."""
    if type(value) is not str or value not in ROLES:
        raise ValueError(f"{what} must be one of {ROLES}, got {value!r}")
    return value

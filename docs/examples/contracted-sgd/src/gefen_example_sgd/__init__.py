"""An optimizer that is not Gefen, adopting the convention with gefen-contracts alone."""

from __future__ import annotations

from .contract import CONTRACT
from .optimizer import ContractedSGD, conformance_factory

__all__ = ["CONTRACT", "ContractedSGD", "conformance_factory"]

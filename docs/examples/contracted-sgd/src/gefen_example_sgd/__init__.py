"""An optimizer that is not Gefen, adopting the convention with gefen-contracts alone."""

from __future__ import annotations

from .optimizer import ContractedSGD, conformance_factory

__all__ = ["ContractedSGD", "conformance_factory"]

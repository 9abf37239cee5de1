"""Results of a conformance run."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["CheckResult", "CheckStatus", "ConformanceReport", "assert_conformant"]


class CheckStatus(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    UNVERIFIED = "unverified"
    WAIVED = "waived"
    NOT_APPLICABLE = "not_applicable"


@dataclass(frozen=True)
class CheckResult:
    """One executed check (or one claim no check could verify)."""

    name: str
    status: CheckStatus
    claims: tuple[str, ...] = ()
    detail: str = ""


@dataclass
class ConformanceReport:
    """Every check result for one target; :attr:`ok` says whether the run passes."""

    target: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def executed(self) -> int:
        return sum(r.status in (CheckStatus.PASSED, CheckStatus.FAILED) for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is CheckStatus.FAILED]

    @property
    def unverified(self) -> list[CheckResult]:
        return [r for r in self.results if r.status is CheckStatus.UNVERIFIED]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.unverified and self.executed > 0

    def format(self) -> str:
        """A readable table of every result, then a verdict line."""
        width = max([len(r.name) for r in self.results] + [5])
        lines = [f"conformance report for {self.target}", f"{'check':<{width}}  status          detail"]
        for r in self.results:
            detail = r.detail.replace("\n", " ")
            if len(detail) > 300:
                detail = detail[:297] + "..."
            lines.append(f"{r.name:<{width}}  {r.status.value:<14}  {detail}")
        if self.executed == 0:
            verdict = "FAIL: no check was executed"
        elif self.ok:
            verdict = f"PASS: {self.executed} checks executed"
        else:
            verdict = (
                f"FAIL: {len(self.failures)} failed, {len(self.unverified)} unverified (of {self.executed} executed)"
            )
        lines.append(verdict)
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "target": self.target,
            "ok": self.ok,
            "executed": self.executed,
            "results": [
                {"name": r.name, "status": r.status.value, "claims": list(r.claims), "detail": r.detail}
                for r in self.results
            ],
        }


def assert_conformant(report: ConformanceReport) -> None:
    """Raise ``AssertionError`` carrying the formatted report unless it passes."""
    if not report.ok:
        raise AssertionError(report.format())

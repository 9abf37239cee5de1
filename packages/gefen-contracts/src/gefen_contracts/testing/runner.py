"""Run every check against a target and account for every claim."""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Sequence

from ..protocols import ContractProvider
from .checks import builtin_checks
from .checks.discovery import bound_claims
from .claims import CONTRACT_CLAIM, enumerate_claims
from .context import CheckContext, ConformanceCheck, Unverifiable
from .report import CheckResult, CheckStatus, ConformanceReport
from .target import ConformanceTarget, load_target

__all__ = ["CONFORMANCE_ENTRY_POINT_GROUP", "contributed_checks", "run_conformance"]

CONFORMANCE_ENTRY_POINT_GROUP = "gefen.conformance"


def contributed_checks() -> tuple[list[ConformanceCheck], list[CheckResult]]:
    """Checks from the ``gefen.conformance`` entry points (each names a zero-argument
    callable returning an iterable of checks); a broken entry point becomes a failed result."""
    from importlib.metadata import entry_points

    checks: list[ConformanceCheck] = []
    broken: list[CheckResult] = []
    taken = {check.name for check in builtin_checks()}
    for entry in sorted(entry_points(group=CONFORMANCE_ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            provided = list(entry.load()())
            for check in provided:
                if not isinstance(check, ConformanceCheck):
                    raise TypeError(f"{check!r} does not implement ConformanceCheck")
            names = [check.name for check in provided]
            # results are found by name: a second check of one name would report the first's result
            clashes = sorted({name for name in names if name in taken or names.count(name) > 1})
            if clashes:
                raise ValueError(f"check names {clashes} are already taken (built-in or another entry point's)")
            taken.update(names)
            checks.extend(provided)
        except Exception as exc:
            broken.append(
                CheckResult(f"entry_point:{entry.name}", CheckStatus.FAILED, (), f"{type(exc).__name__}: {exc}")
            )
    return checks, broken


def _claims_of(target: ConformanceTarget) -> tuple[CheckContext | None, CheckResult | None]:
    """Every claim of a fresh, a trained and (when it supports post_sharding) a kit-finalized optimizer."""
    try:
        _, optimizer = target.build(0)
        if not isinstance(optimizer, ContractProvider):
            return None, CheckResult(
                "contract.provider", CheckStatus.FAILED, (CONTRACT_CLAIM,), "the optimizer has no optimizer_contract()"
            )
        fresh_contract = optimizer.optimizer_contract()
        claims = set(enumerate_claims(fresh_contract))
        context = CheckContext(target, fresh_contract, frozenset(claims))
        _model, optimizer = context.trained()
        claims |= enumerate_claims(optimizer.optimizer_contract())  # type: ignore[attr-defined]
        claims |= bound_claims(context)
        return CheckContext(target, fresh_contract, frozenset(claims)), None
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        return None, CheckResult("contract.provider", CheckStatus.FAILED, (CONTRACT_CLAIM,), detail)


def run_conformance(
    target: ConformanceTarget | str,
    *,
    waive: Iterable[str] | dict[str, str] = (),
    checks: Sequence[ConformanceCheck] | None = None,
    include_contributed: bool = True,
) -> ConformanceReport:
    """Run the kit against ``target`` (a :class:`ConformanceTarget` or ``"MODULE:FACTORY"``).

    Every check that covers at least one claim runs; every claim no executed check covered
    is reported ``UNVERIFIED`` unless waived by name (a waiver names a claim or a check).
    """
    if isinstance(target, str):
        target = load_target(target)
    target = target.with_waivers(waive)
    report = ConformanceReport(target.name)
    context, failure = _claims_of(target)
    if context is None:
        assert failure is not None
        report.results.append(failure)
        return report
    selected = list(builtin_checks()) if checks is None else list(checks)
    if include_contributed and checks is None:
        extra, broken = contributed_checks()
        selected.extend(extra)
        report.results.extend(broken)
    covered: set[str] = set()
    for check in selected:
        try:
            claims = check.covers(context.claims)
        except Exception as exc:  # a broken contributed check fails itself, not every adopter's run
            report.results.append(CheckResult(check.name, CheckStatus.FAILED, (), f"covers() raised {exc!r}"))
            continue
        if not claims:
            report.results.append(CheckResult(check.name, CheckStatus.NOT_APPLICABLE))
            continue
        if check.name in target.waive:
            report.results.append(
                CheckResult(check.name, CheckStatus.WAIVED, tuple(sorted(claims)), target.waive[check.name])
            )
            covered |= claims
            continue
        context.notes.clear()
        try:
            check.run(context)
        except Unverifiable as exc:
            if claims <= set(target.waive):
                reasons = "; ".join(sorted({target.waive[c] for c in claims}))
                report.results.append(
                    CheckResult(check.name, CheckStatus.WAIVED, tuple(sorted(claims)), f"{exc} (waived: {reasons})")
                )
                covered |= claims
            else:
                report.results.append(CheckResult(check.name, CheckStatus.UNVERIFIED, tuple(sorted(claims)), str(exc)))
            continue
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # a failing check is a finding (DCP's CheckpointException is a BaseException)
            detail = f"{type(exc).__name__}: {exc}"
            report.results.append(CheckResult(check.name, CheckStatus.FAILED, tuple(sorted(claims)), detail))
            covered |= claims
            continue
        report.results.append(
            CheckResult(check.name, CheckStatus.PASSED, tuple(sorted(claims)), "; ".join(context.notes))
        )
        covered |= claims
    for claim in sorted(context.claims - covered):
        if claim in target.waive:
            report.results.append(CheckResult(f"claim {claim}", CheckStatus.WAIVED, (claim,), target.waive[claim]))
        else:
            report.results.append(
                CheckResult(f"claim {claim}", CheckStatus.UNVERIFIED, (claim,), "no check could execute this claim")
            )
    return report

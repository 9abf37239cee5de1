"""pytest plugin (entry point ``pytest11``): inert unless asked for, imports no torch at start-up.

Two ways to use it:

* command line: ``pytest --gefen-conformance MODULE:FACTORY [--gefen-conformance-waive NAME]``
  runs one test item per check and a ``verdict`` item for each target (the verdict fails on
  any claim left unverified, naming it), and nothing else: the paths pytest would collect
  (a repository's own suite) are not collected;
* fixtures: define a ``gefen_conformance_target`` fixture returning a ``ConformanceTarget``
  (or ``"MODULE:FACTORY"``) and request ``gefen_conformance_report``; call
  ``assert_conformant(report)`` to fail with the readable report.
"""

from __future__ import annotations

from typing import Any

import pytest

_CACHE_KEY = "_gefen_conformance_reports"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gefen-conformance", "Gefen optimizer convention conformance kit")
    group.addoption(
        "--gefen-conformance",
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="run the conformance kit against this optimizer factory (repeatable)",
    )
    group.addoption(
        "--gefen-conformance-waive",
        action="append",
        default=[],
        metavar="NAME",
        help="accept this claim or check as unverified (repeatable)",
    )


class ConformanceItem(pytest.Item):
    """One check result of one target, reported as a test."""

    def __init__(self, *, spec: str, check: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.check = check

    def runtest(self) -> None:
        from .report import CheckStatus

        report = _report_for(self.config, self.spec)
        if self.check == "<verdict>":
            if not report.ok:
                raise AssertionError(report.format())
            return
        for result in report.results:
            if result.name == self.check:
                if result.status is CheckStatus.FAILED:
                    raise AssertionError(result.detail)
                if result.status is CheckStatus.UNVERIFIED:
                    raise AssertionError(f"UNVERIFIED: {result.detail}")
                if result.status in (CheckStatus.NOT_APPLICABLE, CheckStatus.WAIVED):
                    pytest.skip(f"{result.status.value}: {result.detail}")
                return
        pytest.skip("check did not run for this target")

    def reportinfo(self) -> tuple[str, int, str]:
        return self.spec, 0, f"conformance[{self.spec}]::{self.check}"


def _report_for(config: pytest.Config, spec: str) -> Any:
    cache = getattr(config, _CACHE_KEY, None)
    if cache is None:
        cache = {}
        setattr(config, _CACHE_KEY, cache)
    if spec not in cache:
        from .runner import run_conformance

        cache[spec] = run_conformance(spec, waive=config.getoption("--gefen-conformance-waive"))
    return cache[spec]


def pytest_ignore_collect(collection_path: Any, config: pytest.Config) -> bool | None:
    """A conformance run collects only the kit's items (``None``: pytest decides as usual)."""
    return True if config.getoption("--gefen-conformance") else None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    specs = config.getoption("--gefen-conformance")
    if not specs:
        return
    items.clear()
    from .checks import builtin_checks
    from .runner import contributed_checks

    names = [c.name for c in builtin_checks()] + [c.name for c in contributed_checks()[0]]
    for spec in specs:
        for name in names:
            items.append(
                ConformanceItem.from_parent(session, name=f"conformance[{spec}]::{name}", spec=spec, check=name)
            )
        items.append(
            ConformanceItem.from_parent(session, name=f"conformance[{spec}]::verdict", spec=spec, check="<verdict>")
        )


@pytest.fixture
def gefen_conformance_report(request: pytest.FixtureRequest) -> Any:
    """Run the kit against the ``gefen_conformance_target`` fixture and return the report."""
    from .runner import run_conformance

    target = request.getfixturevalue("gefen_conformance_target")
    return run_conformance(target, waive=request.config.getoption("--gefen-conformance-waive"))

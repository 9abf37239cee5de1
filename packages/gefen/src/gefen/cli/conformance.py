"""``gefen conformance MODULE:FACTORY``: run the conformance kit against any optimizer."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "conformance",
        help="run the convention's conformance kit against an optimizer factory",
        description=(
            "Run every conformance check against MODULE:FACTORY, where FACTORY(named_parameters) returns a "
            "torch optimizer (or is a gefen_contracts.testing.ConformanceTarget). Exits non-zero when any "
            "claim fails or stays unverified."
        ),
    )
    parser.add_argument("target", metavar="MODULE:FACTORY")
    parser.add_argument(
        "--waive", action="append", default=[], metavar="NAME", help="accept a claim or check as unverified"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gefen_contracts.testing import load_target, run_conformance

    if ":" not in args.target:
        raise UsageError(f"the target must be MODULE:FACTORY, got {args.target!r}")
    try:  # loading alone: an error the optimizer raises while checked is the report's, not a usage error
        target = load_target(args.target)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        raise UsageError(f"cannot load {args.target}: {type(exc).__name__}: {exc}") from None
    report = run_conformance(target, waive=args.waive)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.format())
    # a waiver that names no check or claim of this run waived nothing (a typo, or a claim the
    # optimizer no longer makes): said on stderr, the status is the report's
    known = {result.name.removeprefix("claim ") for result in report.results}
    known.update(claim for result in report.results for claim in result.claims)
    for name in sorted(set(args.waive) - known):
        print(f"gefen conformance: warning: --waive {name!r} names no check or claim of this run", file=sys.stderr)
    return 0 if report.ok else 1

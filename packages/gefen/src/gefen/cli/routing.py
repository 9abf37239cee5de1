"""``gefen routing MODULE:FUNCTION``: where GefenMuonHybrid sends each parameter of a model."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from .errors import UsageError

__all__ = ["register"]


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "routing",
        help="print where GefenMuonHybrid routes each parameter of a model",
        description=(
            "Build the model FUNCTION() returns (an nn.Module, or a tuple whose first item is one) and print, for "
            "every trainable parameter, the role GefenMuonHybrid(model) gives it (muon or backup) and the rule "
            "that decided: embedding and output-head modules, non-matrices and backup name fragments go to the "
            "backup, hidden 2-D matrices to muon. Nothing is trained."
        ),
    )
    parser.add_argument("target", metavar="MODULE:FUNCTION")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.set_defaults(handler=run)


def _model(spec: str) -> Any:
    from gefen_contracts.testing import import_attribute
    from torch import nn

    try:
        function = import_attribute(spec)
    except ValueError:
        raise UsageError(f"the target must be MODULE:FUNCTION, got {spec!r}") from None
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load {spec}: {type(exc).__name__}: {exc}") from None
    if not callable(function):
        raise UsageError(f"{spec} is not callable")
    built = function()
    model = built[0] if isinstance(built, tuple) and built else built
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec}() returned a {type(model).__name__}; expected an nn.Module or (model, ...)")
    return model


def run(args: argparse.Namespace) -> int:
    from gefen_hybrid import routing_report

    from ..text_table import text_table

    rows = routing_report(_model(args.target))
    if args.json:
        print(json.dumps([{"name": r.name, "shape": list(r.shape), "role": r.role, "reason": r.reason} for r in rows]))
        return 0
    header = ("parameter", "shape", "role", "why")
    for line in text_table(header, [(r.name, str(list(r.shape)), r.role, r.reason) for r in rows]):
        print(line)
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.role] = totals.get(row.role, 0) + math.prod(row.shape)
    print("; ".join(f"{role}: {count:,} parameters" for role, count in sorted(totals.items())))
    return 0

"""``gefen bench SUBCOMMAND``: benchmarks that print a table and write JSON (one shared schema) and a PNG.

Each benchmark is a module of this package with a ``register(subparsers)`` function; add a
new one to ``_BENCHMARKS``. A benchmark whose options need torch registers them with
:meth:`~gefen.cli.lazy_parsers.LazySubParsers.add_lazy_parser`, so ``gefen bench --help``
stays fast. Its handler builds a report with
:class:`gefen.bench.schema.ReportBuilder` and hands it to :func:`gefen.bench.output.emit`.
"""

from __future__ import annotations

from typing import Any

from . import bench_dcp, bench_dp, bench_guard, bench_memory, bench_muon, bench_portable, bench_quality, bench_step
from .lazy_parsers import LazySubParsers

__all__ = ["register"]

_BENCHMARKS = (bench_memory, bench_quality, bench_step, bench_muon, bench_portable, bench_dcp, bench_guard, bench_dp)


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "bench",
        help="run a benchmark (table, JSON in the shared schema, PNG plot)",
        description=(
            "Benchmarks of the gefen optimizers against baselines measured in the same run. Every sub-command prints "
            "a table, writes <out>/<name>.json in the shared gefen.bench schema, <out>/<name>.txt and a <out>/<name>.png plot."
        ),
    )
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK", action=LazySubParsers)
    for module in _BENCHMARKS:
        module.register(benchmarks)

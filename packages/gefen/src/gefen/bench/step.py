"""``gefen bench step``: the whole optimizer ``step()`` of Gefen against torch's AdamW.

Every arm gets its own copy of the same fp32 parameters and gradients, shaped like a
decoder (an embedding, attention and MLP matrices, 1-D norm weights; at least 16M
parameters by default). Arms are stepped round-robin, one step each per round, so slow
drifts of a shared machine hit them alike; after ``warmup`` rounds (Gefen's first step also
learns its codebook and periods) the median of ``repeats`` timed rounds is reported, with
the minimum in the detail. Ratios are against ``torch.optim.AdamW(fused=True)`` measured in
the same run.

Two more figures per arm: the operator calls one step dispatches (``ops_per_step``: every
call that reaches torch's dispatcher, counted by a ``TorchDispatchMode`` on one extra step;
``gefen_ops`` of them Gefen's own kernels), and the host time per tensor
(``host_time_per_tensor``: the step's median on :data:`HOST_SHAPES`, 64 tensors so small
that the arithmetic is negligible, divided by 64: what a step costs per tensor in Python and
dispatch; the whole-optimizer arms stepped round-robin too, :data:`HOST_ROUNDS_PER_REPEAT`
rounds per timed round, with ratios to fused AdamW's).

The first step is reported too (``first_step_time``, with its multiple of the arm's steady
median in the detail): Gefen's creates its state, chooses its periods and solves its
codebook there. Loading gefen-kernels' CPU library happens once per process before the
rounds and is reported on its own (``kernel_library_load_time``). ``codebook_solve`` times that solve alone (the exact DP on a 4096-bin
histogram of the same gradients, each tensor normalised by its max ``|g|``), so a Gefen
arm's ``x_steady_without_codebook_solve`` is the rest of its first step in steady steps.

Arms: AdamW fused and default (torch's for-each path), a copy of the bytes Gefen's step
moves at least (14 B/param for fp32: read parameter, gradient, indices, write parameter and
indices; the bandwidth bound), Gefen on its reference path and with kernels (factored and
block v), GefenMuon's quantised-momentum update alone on the 2-D matrices (the op its step
dispatches), and torchao's and bitsandbytes' 8-bit/4-bit AdamW when installed. An arm that
cannot run here (no registered kernel, a peer that fails on this device) becomes a note.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from gefen_contracts.testing import import_attribute
from torch.utils._python_dispatch import TorchDispatchMode

from .plot import Panel, Series
from .schema import BenchmarkReport, ReportBuilder, require_distinct

__all__ = ["BASELINE", "StepOptions", "decoder_shapes", "model_shapes", "run_step", "step_panels", "step_table"]

BASELINE = "adamw-fused"
#: Bytes per parameter the cheapest Gefen step must move (fp32 parameter and gradient read,
#: uint8 index read, parameter and index written), the copy arm's size.
MOVED_BYTES_PER_PARAM = 14
#: Timed rounds of the host-time model per timed round of the model (one is about a millisecond).
HOST_ROUNDS_PER_REPEAT = 5
#: The host-time model: 32 matrices and 32 vectors of 128 and 16 elements.
HOST_SHAPES: tuple[tuple[str, Shape], ...] = tuple(
    (f"{kind}{index}", shape) for index in range(32) for kind, shape in (("w", (8, 16)), ("b", (16,)))
)

Shape = tuple[int, ...]
NamedParameters = list[tuple[str, torch.nn.Parameter]]
StepFactory = Callable[[NamedParameters], Callable[[], object]]


@dataclass(frozen=True, slots=True)
class StepOptions:
    """Model shape, threads, device and timing rounds (defaults: 23.6M parameters)."""

    d_model: int = 512
    layers: int = 4
    vocab: int = 16384
    threads: int = 2
    warmup: int = 3
    repeats: int = 21
    device: str = "cpu"
    seed: int = 0
    #: arm names to run (the fused AdamW baseline always runs); empty: every arm
    arms: tuple[str, ...] = ()
    #: ``"demo"``: the parameters of ``gefen demo``'s model (its shapes; d_model, layers and vocab
    #: are then unused); empty: the decoder of d_model, layers and vocab
    model: str = ""

    def __post_init__(self) -> None:
        for name in ("d_model", "layers", "vocab", "threads", "repeats"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"StepOptions.{name} must be a positive int, got {value!r}")
        if type(self.warmup) is not int or self.warmup < 1:
            raise ValueError(f"StepOptions.warmup must be an int >= 1 (Gefen learns its codebook), got {self.warmup!r}")
        if self.d_model % 4:
            raise ValueError(f"StepOptions.d_model must be divisible by 4 (grouped k/v), got {self.d_model}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"StepOptions.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("StepOptions.device is 'cuda' but torch sees no CUDA device here")
        if type(self.arms) is not tuple or any(type(a) is not str or not a for a in self.arms):
            raise ValueError(f"StepOptions.arms must be a tuple of non-empty arm names, got {self.arms!r}")
        require_distinct(self.arms, "StepOptions.arms")
        if self.model not in ("", "demo"):
            raise ValueError(
                f"StepOptions.model must be '' (the decoder of d_model/layers/vocab) or 'demo', got {self.model!r}"
            )


def model_shapes(options: StepOptions) -> list[tuple[str, Shape]]:
    """The stepped parameters' ``(name, shape)``: ``gefen demo``'s model (its default size, on the
    demo's character vocabulary) for ``model="demo"``, else :func:`decoder_shapes`."""
    if options.model == "demo":
        from ..demo.data import load_tinylang
        from ..demo.model import TinyDecoder, preset
        from ..demo.run import DemoOptions

        config = preset(DemoOptions().model_size).with_vocab(load_tinylang().tokenizer.vocab_size)
        return [(name, tuple(p.shape)) for name, p in TinyDecoder(config).named_parameters()]
    return decoder_shapes(options.d_model, options.layers, options.vocab)


def decoder_shapes(d_model: int, layers: int, vocab: int) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of a decoder: embedding, grouped-query attention, SwiGLU MLP, norms."""
    shapes: list[tuple[str, Shape]] = [("embed", (vocab, d_model))]
    for layer in range(layers):
        prefix = f"layers.{layer}"
        shapes += [
            (f"{prefix}.attn_norm", (d_model,)),
            (f"{prefix}.q", (d_model, d_model)),
            (f"{prefix}.k", (d_model // 4, d_model)),
            (f"{prefix}.v", (d_model // 4, d_model)),
            (f"{prefix}.o", (d_model, d_model)),
            (f"{prefix}.mlp_norm", (d_model,)),
            (f"{prefix}.gate", (4 * d_model, d_model)),
            (f"{prefix}.up", (4 * d_model, d_model)),
            (f"{prefix}.down", (d_model, 4 * d_model)),
        ]
    shapes.append(("final_norm", (d_model,)))
    return shapes


def _parameters(shapes: list[tuple[str, Shape]], device: str, seed: int) -> NamedParameters:
    generator = torch.Generator().manual_seed(seed)
    named = []
    for name, shape in shapes:
        parameter = torch.nn.Parameter(torch.randn(shape, generator=generator).mul_(0.02).to(device))
        parameter.grad = torch.randn(shape, generator=generator).to(device)
        named.append((name, parameter))
    return named


def _adamw(fused: bool | None) -> StepFactory:
    def build(named: NamedParameters) -> Callable[[], object]:
        return torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.01, fused=fused).step

    return build


def _gefen(fused: bool, **options: Any) -> StepFactory:
    def build(named: NamedParameters) -> Callable[[], object]:
        from gefen_core import Gefen

        return Gefen(named, lr=1e-3, weight_decay=0.01, fused=fused, **options).step

    return build


def _copy_bound(numel: int, device: str) -> StepFactory:
    def build(named: NamedParameters) -> Callable[[], object]:
        del named
        half = (MOVED_BYTES_PER_PARAM * numel) // 2  # read half, write half
        source = torch.ones(half, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        return lambda: target.copy_(source)

    return build


def _muon_momentum(named: NamedParameters) -> Callable[[], object]:
    """GefenMuon's quantised-momentum op alone (``gefen::muon_momentum.v3``) on the 2-D matrices,
    one call for all of them, through a registered kernel
    (:class:`~gefen_contracts.KernelUnavailableError` without one)."""
    from gefen_core.ops import MUON_MOMENTUM, Kernels
    from gefen_core.step_scalars import muon_scalars

    device = named[0][1].device
    kernels = Kernels(True)
    kernels.require(MUON_MOMENTUM, device)
    run = kernels.op(MUON_MOMENTUM)
    grads, codes, scales, outs = [], [], [], []
    codebook = torch.linspace(-1.0, 1.0, 256, device=device)
    for _, parameter in named:
        if parameter.dim() != 2:
            continue
        grad = parameter.grad
        assert grad is not None
        period = parameter.shape[1]
        blocks = parameter.numel() // period
        grads.append(grad)
        codes.append(torch.zeros(blocks, period, dtype=torch.uint8, device=device))
        scales.append(torch.zeros(blocks, 1, device=device))
        outs.append(torch.empty(parameter.shape, dtype=torch.bfloat16, device=device))
    scalars = muon_scalars(device, 0.95)

    def step() -> None:
        run(grads, codes, scales, codebook, scalars, None, outs, nesterov=True, deterministic=False)

    return step


def _peer(module: str, attribute: str) -> StepFactory:
    def build(named: NamedParameters) -> Callable[[], object]:
        target: Any = import_attribute(f"{module}:{attribute}")
        optimizer: torch.optim.Optimizer = target([p for _, p in named], lr=1e-3)
        return optimizer.step

    return build


#: Arms that are whole optimizers (their host time per tensor is measured).
_HOST_ARMS = frozenset({BASELINE, "adamw-default", "gefen-reference", "gefen-fused", "gefen-block-fused"})


def _arms(numel: int, device: str) -> tuple[dict[str, StepFactory], list[str]]:
    arms: dict[str, StepFactory] = {
        BASELINE: _adamw(True),
        "adamw-default": _adamw(None),
        f"copy-{MOVED_BYTES_PER_PARAM}B": _copy_bound(numel, device),
        "gefen-reference": _gefen(False),
        "gefen-fused": _gefen(True),
        "gefen-block-fused": _gefen(True, factored_v_2d=False),
        "gefenmuon-momentum-fused": _muon_momentum,
    }
    notes = []
    peers = {
        "torchao-adamw8bit": ("torchao", "torchao.optim", "AdamW8bit"),
        "torchao-adamw4bit": ("torchao", "torchao.optim", "AdamW4bit"),
        "bnb-adamw8bit": ("bitsandbytes", "bitsandbytes", "optim.AdamW8bit"),
    }
    for name, (distribution, module, attribute) in peers.items():
        if importlib.util.find_spec(distribution) is None:
            notes.append(f"{name}: not measured ({distribution} is not installed)")
        else:
            arms[name] = _peer(module, attribute)
    return arms, notes


def _load_kernel_library_seconds() -> float | None:
    """Seconds to load gefen-kernels' CPU library (prebuilt, cached or compiled), or ``None``
    when gefen-kernels is not installed; later loads in this process are free."""
    if importlib.util.find_spec("gefen_kernels") is None:
        return None
    from gefen_kernels.cpu_build import load_cpu_library

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_cpu_library()
    return time.perf_counter() - started


def _codebook_solve_seconds(named: NamedParameters) -> float:
    """Seconds of one exact-DP codebook solve on a 4096-bin histogram of ``named``'s gradients."""
    from gefen_core.codebook import codebook_from_counts
    from gefen_core.ops import CODEBOOK_SOLVE, Kernels
    from gefen_core.reference_ops import HISTOGRAM_BINS

    counts = torch.zeros(HISTOGRAM_BINS, dtype=torch.int64)
    for _, parameter in named:
        gradient = parameter.grad
        if gradient is None or gradient.numel() == 0:
            continue
        scale = gradient.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        counts += torch.histc((gradient / scale).float().cpu(), bins=HISTOGRAM_BINS, min=-1.0, max=1.0).to(torch.int64)
    started = time.perf_counter()
    codebook_from_counts(counts, Kernels(None).op(CODEBOOK_SOLVE))  # as a first step solves
    return time.perf_counter() - started


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the operator calls that reach the dispatcher (nested calls excluded)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[func.namespace] += 1
        return func(*args, **(kwargs or {}))


def _count_ops(step: Callable[[], object]) -> Counter[str]:
    counter = _OpCounter()
    with warnings.catch_warnings(), counter:
        warnings.simplefilter("ignore")
        step()
    return counter.calls


def _host_seconds_per_tensor(factories: dict[str, StepFactory], options: StepOptions) -> dict[str, float]:
    """Each arm's median step on :data:`HOST_SHAPES` over its tensor count, the arms stepped
    round-robin (a noisy neighbour's burst then reaches every arm, not one arm's block)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps = {
            name: factory(_parameters(list(HOST_SHAPES), options.device, options.seed))
            for name, factory in factories.items()
        }
        timings: dict[str, list[float]] = {name: [] for name in steps}
        for round_index in range(options.warmup + HOST_ROUNDS_PER_REPEAT * options.repeats):
            for name, step in steps.items():
                _sync(options.device)
                started = time.perf_counter()
                step()
                _sync(options.device)
                if round_index >= options.warmup:
                    timings[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) / len(HOST_SHAPES) for name, values in timings.items()}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _kernel_config() -> dict[str, Any]:
    try:
        from gefen_kernels import cpu_kernel_status
    except ImportError:  # pragma: no cover - gefen-kernels is a dependency of the meta-package
        return {"cpu_available": False, "reason": "gefen-kernels is not installed"}
    status = cpu_kernel_status()
    return {"cpu_available": status.available, "flags": " ".join(status.flags), "reason": status.reason}


def run_step(options: StepOptions, *, progress: Callable[[str], None] | None = None) -> BenchmarkReport:
    """Build every arm, time interleaved rounds, and return the report (module docstring)."""
    tick = progress or (lambda _label: None)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        shapes = model_shapes(options)
        numel = sum(int(torch.Size(shape).numel()) for _, shape in shapes)
        factories, notes = _arms(numel, options.device)
        if options.arms:
            unknown = sorted(set(options.arms) - set(factories))
            if unknown:
                raise ValueError(f"StepOptions.arms: unknown arm(s) {unknown}; known here: {sorted(factories)}")
            factories = {n: f for n, f in factories.items() if n in options.arms or n == BASELINE}
        builder = ReportBuilder(
            "step",
            config={
                **asdict(options),
                "parameters": numel,
                "tensors": len(shapes),
                "dtype": "float32",
                "kernels": _kernel_config(),
            },
        )
        library = _load_kernel_library_seconds()
        if library is not None:  # once per process, not part of any arm's first step
            builder.add("kernel_library", "kernel_library_load_time", library * 1e3, "ms")
        steps: dict[str, Callable[[], object]] = {}
        for name, factory in factories.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    steps[name] = factory(_parameters(shapes, options.device, options.seed))
            except Exception as exc:  # an arm that cannot run here is reported, not fatal
                notes.append(f"{name}: not measured ({type(exc).__name__}: {exc})")
        samples: dict[str, list[float]] = {name: [] for name in steps}
        first: dict[str, float] = {}
        failed: set[str] = set()
        for round_index in range(options.warmup + options.repeats):
            for name, step in steps.items():
                if name in failed:
                    continue
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        _sync(options.device)
                        started = time.perf_counter()
                        step()
                        _sync(options.device)
                except Exception as exc:  # e.g. a peer whose compiled step fails on this machine
                    failed.add(name)
                    notes.append(f"{name}: not measured ({type(exc).__name__}: {exc})")
                    continue
                elapsed = time.perf_counter() - started
                if round_index == 0:
                    first[name] = elapsed
                if round_index >= options.warmup:
                    samples[name].append(elapsed)
            tick("warm-up" if round_index < options.warmup else f"round {round_index - options.warmup + 1}")
        measured = {name: values for name, values in samples.items() if name not in failed and values}
        baseline = BASELINE if BASELINE in measured else None
        if baseline is None:
            notes.append(f"{BASELINE} was not measured: no ratios")
        for name in sorted(measured, key=lambda n: n != BASELINE):
            median = statistics.median(measured[name])
            builder.add(
                name,
                "step_time",
                median * 1e3,
                "ms",
                baseline=None if name == BASELINE else baseline,
                detail={"ns_per_param": median / numel * 1e9, "min_ms": min(measured[name]) * 1e3},
            )
        solve = _codebook_solve_seconds(_parameters(shapes, options.device, options.seed))
        builder.add("codebook_solve", "codebook_solve_time", solve * 1e3, "ms")
        for name in sorted(measured, key=lambda n: n != BASELINE):
            steady = statistics.median(measured[name])
            detail = {"x_steady": first[name] / steady}
            if name.startswith("gefen-"):
                detail["x_steady_without_codebook_solve"] = (first[name] - solve) / steady
            builder.add(name, "first_step_time", first[name] * 1e3, "ms", detail=detail)
        ordered = sorted(measured, key=lambda n: n != BASELINE)
        for name in ordered:  # before the host model steps: its steps would fill the step-scalar cache
            calls = _count_ops(steps[name])
            builder.add(name, "ops_per_step", float(sum(calls.values())), "calls", detail={"gefen_ops": calls["gefen"]})
        hosts = _host_seconds_per_tensor({name: factories[name] for name in ordered if name in _HOST_ARMS}, options)
        for name, host in hosts.items():  # (the baseline first, as the ratios need)
            host_baseline = None if name == BASELINE or BASELINE not in hosts else BASELINE
            detail = {"tensors": len(HOST_SHAPES)}
            builder.add(name, "host_time_per_tensor", host * 1e6, "us", baseline=host_baseline, detail=detail)
        for note in notes:
            builder.note(note)
        builder.note(
            "first step: round 0 of each arm (state creation; for Gefen also the period choice and the codebook "
            "solve, timed alone as codebook_solve); Gefen's first-step budget is 3x a steady step plus the solve"
        )
        builder.note(
            f"median of {options.repeats} interleaved rounds after {options.warmup} warm-up rounds, "
            f"{options.threads} thread(s); timings on a shared machine are noisy, ratios less so"
        )
        if hasattr(os, "getloadavg"):
            load = os.getloadavg()
            builder.note(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
        return builder.build()
    finally:
        torch.set_num_threads(previous_threads)


def step_table(report: BenchmarkReport) -> str:
    """The model size, then per arm: median and minimum ms, ns per parameter, ratio to fused AdamW; notes."""
    config = report.config
    lines = [
        f"step benchmark: {config['parameters']:,} {config['dtype']} parameters in {config['tensors']} tensors "
        f"on {config['device']}, {config['threads']} thread(s)",
        f"{'name':28s} {'median ms':>10s} {'min ms':>10s} {'ns/param':>9s} {'vs ' + BASELINE:>15s}",
    ]
    for row in report.rows:
        if row.metric != "step_time":
            continue
        ratio = "" if row.ratio is None else f"{row.ratio:.3f}x"
        minimum, per_param = row.detail.get("min_ms"), row.detail.get("ns_per_param")
        assert isinstance(minimum, float) and isinstance(per_param, float)  # run_step writes both
        lines.append(f"{row.name:28s} {row.value:10.3f} {minimum:10.3f} {per_param:9.3f} {ratio:>15s}")
    firsts = [row for row in report.rows if row.metric == "first_step_time"]
    if firsts:
        solve = next((row.value for row in report.rows if row.metric == "codebook_solve_time"), float("nan"))
        library = next((row.value for row in report.rows if row.metric == "kernel_library_load_time"), None)
        loaded = "" if library is None else f"; kernel library loaded once before the rounds: {library:.3f} ms"
        lines.append(f"first step (codebook solve alone: {solve:.3f} ms{loaded})")
        lines.append(f"{'name':28s} {'first ms':>10s} {'x steady':>10s} {'x steady w/o solve':>19s}")
        for row in firsts:
            rest = row.detail.get("x_steady_without_codebook_solve")
            rest_text = f"{rest:.2f}x" if isinstance(rest, float) else ""
            lines.append(f"{row.name:28s} {row.value:10.3f} {row.detail['x_steady']:9.2f}x {rest_text:>19s}")
    counts = {row.name: row for row in report.rows if row.metric == "ops_per_step"}
    hosts = {row.name: row for row in report.rows if row.metric == "host_time_per_tensor"}
    if counts:
        lines.append(f"dispatch ({len(HOST_SHAPES)} small tensors for the host time)")
        lines.append(
            f"{'name':28s} {'ops/step':>10s} {'gefen ops':>10s} {'host us/tensor':>15s} {'vs ' + BASELINE:>15s}"
        )
        for name, row in counts.items():
            gefen_ops = row.detail.get("gefen_ops")
            host = hosts.get(name)
            value = "" if host is None else f"{host.value:.1f}"
            ratio = "" if host is None or host.ratio is None else f"{host.ratio:.2f}x"
            lines.append(f"{name:28s} {row.value:10.0f} {gefen_ops!s:>10s} {value:>15s} {ratio:>15s}")
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(lines)


def step_panels(report: BenchmarkReport) -> list[Panel]:
    """Step time per arm (bars, log scale) and its ratio to fused AdamW."""
    rows = [row for row in report.rows if row.metric == "step_time"]
    times = Panel(
        "optimizer step (median)",
        "",
        "ms",
        tuple(Series(row.name, (0.0,), (row.value,)) for row in rows),
        kind="bar",
        log_y=True,
    )
    ratios = [row for row in rows if row.ratio is not None]
    panels = [times]
    if ratios:
        panels.append(
            Panel(
                f"ratio to {BASELINE}",
                "",
                "x",
                tuple(Series(row.name, (0.0,), (row.ratio or 0.0,)) for row in ratios),
                kind="bar",
                log_y=True,
            )
        )
    return panels

"""The resident-memory peak and wall time of one operation, on every platform.

:func:`measure_operation` collects garbage, optionally meets the other ranks at a barrier,
resets the kernel's high-water mark where Linux allows it, samples the resident size every
millisecond from a thread while the operation runs, and reports the larger of the sampled
and the kernel's peak above the resident size just before the operation. Sampling alone
can miss a spike shorter than a millisecond; the high-water mark cannot, where it exists.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .rss import ResidentMemory

__all__ = ["OperationCost", "ResidentSampler", "measure_operation"]


@dataclass(frozen=True, slots=True)
class OperationCost:
    """Seconds, peak resident growth and what stayed resident afterwards (bytes)."""

    seconds: float
    peak_extra_bytes: int
    retained_bytes: int
    exact_peak: bool

    def to_json(self) -> dict[str, float | int | bool]:
        return asdict(self)


class ResidentSampler:
    """Samples the resident size every ``interval_s`` while active (a context manager)."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = ResidentMemory.current() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, ResidentMemory.current() or 0)
            time.sleep(self.interval_s)

    def __enter__(self) -> ResidentSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, ResidentMemory.current() or 0)


def measure_operation(operation: Callable[[], object], *, barrier: Callable[[], object] | None = None) -> OperationCost:
    """Run ``operation`` once and return its cost (module docstring)."""
    gc.collect()
    if barrier is not None:
        barrier()
    exact = ResidentMemory.reset_peak()
    before = ResidentMemory.current() or 0
    started = time.perf_counter()
    with ResidentSampler() as sampler:
        operation()
    seconds = time.perf_counter() - started
    peak = max(sampler.peak, ResidentMemory.peak() if exact else 0)
    gc.collect()
    after = ResidentMemory.current() or 0
    if barrier is not None:
        barrier()
    return OperationCost(seconds, peak - before, after - before, exact)

"""Resident memory of this process: current, peak, and a resettable peak on Linux.

On Linux ``/proc/self/status`` gives ``VmRSS`` (now) and ``VmHWM`` (peak), and writing
``5`` to ``/proc/self/clear_refs`` resets the peak to the current size, so the peak of one
region of code can be measured. Elsewhere only ``resource.getrusage``'s lifetime peak is
available and :meth:`ResidentMemory.reset_peak` returns ``False``; callers then report the
transient as unavailable instead of guessing.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["ResidentMemory"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_field(name: str) -> int | None:
    try:
        text = _STATUS.read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + ":"):
            parts = line.split()
            return int(parts[1]) * 1024  # reported in kB
    return None


class ResidentMemory:
    """Reads of this process's resident set size, in bytes."""

    @staticmethod
    def current() -> int | None:
        """Resident bytes now (``None`` where the platform does not tell)."""
        return _status_field("VmRSS")

    @staticmethod
    def peak() -> int:
        """Peak resident bytes since start or since the last successful :meth:`reset_peak`."""
        peak = _status_field("VmHWM")
        if peak is not None:
            return peak
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(maxrss if sys.platform == "darwin" else maxrss * 1024)

    @staticmethod
    def reset_peak() -> bool:
        """Reset the peak to the current size; ``False`` where that is impossible."""
        try:
            _CLEAR_REFS.write_text("5", encoding="ascii")
        except OSError:
            return False
        return _status_field("VmHWM") is not None

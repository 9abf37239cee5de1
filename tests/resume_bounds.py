"""The issue's resume bound, shared by the top-level resharding tests.

A run resumed from a checkpoint must stay within ``BOUND`` (relative loss difference at every
step against the uninterrupted run) and well below a run that dropped the optimizer state.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BOUND", "assert_members_resume", "assert_resumes", "relative"]

#: The issue's bound on a resumed run's relative loss difference from the uninterrupted run.
BOUND = 5e-3


def relative(values: list[float], reference: list[float]) -> float:
    """Largest relative difference of ``values`` from ``reference``, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference, strict=True))


def assert_resumes(
    resumed: list[float], dropped: list[float], uninterrupted: list[float], *, exact: bool = False
) -> tuple[float, float]:
    """``resumed`` within :data:`BOUND` of ``uninterrupted`` (equal to it when ``exact``) and
    ``dropped`` clearly worse; returns ``(kept, lost)``, the two relative differences."""
    kept, lost = relative(resumed, uninterrupted), relative(dropped, uninterrupted)
    print(f"kept {kept:.3e}, dropped {lost:.3e}")
    if exact:
        assert resumed == uninterrupted, f"resumed run differs by {kept:.2e}"
    assert kept <= BOUND, f"resumed run differs by {kept:.2e} (bound {BOUND})"
    assert lost > 10 * max(kept, 1e-4) and lost > BOUND, f"dropping the state differs by only {lost:.2e}"
    return kept, lost


def assert_members_resume(outcomes: list[dict[str, Any]], *, exact: bool) -> tuple[float, float]:
    """Every member's outcome of one resharding run: all members agree, a twin of the source
    layout (when run) continues bit-exactly, and the resumed run meets :func:`assert_resumes`."""
    first = outcomes[0]
    for other in outcomes[1:]:  # every member of a run sees the same driver loss
        for key in set(first) & set(other):
            if key != "twin_bit_exact":
                assert other[key] == first[key], key
    assert all(o["twin_bit_exact"] for o in outcomes if "twin" in o), "the twin must continue bit-exactly"
    assert all(o["twin"] == o["uninterrupted"] for o in outcomes if "twin" in o)
    return assert_resumes(first["resumed"], first["dropped"], first["uninterrupted"], exact=exact)

"""The codebook solve: optimal 1-D weighted k-means with three centres pinned, at -1, 0 and +1.

Problem. Given sorted, distinct points ``x_1 < ... < x_N`` with positive integer weights,
choose ``K`` codewords: ``-1``, ``0``, ``+1`` and ``K - 3`` free ones, minimising
``sum_j w_j min_k (x_j - C_k)^2``. Assigned to their nearest codeword, the points below zero
split into a possibly empty prefix at -1, ``a`` non-empty segments at their weighted means and
a possibly empty run at 0; the points above zero into a run at 0, ``b`` segments and a suffix
at +1, with ``a + b = K - 3`` (a free codeword below zero is nearer to no positive point than 0
is). So each side is a pinned program of its own, solved for every count of codewords, and the
split of the free codewords between the sides is the best sum.

Why zero is pinned. The reference pinned only -1 and +1, so zero was no codeword: a momentum
of exactly zero decoded to the smallest codeword (an element whose gradient was zero while its
block trained moved from the first step), and a tiny momentum could round to the smallest
codeword of the other sign and move its parameter uphill at every step. With zero a codeword,
a momentum rounds to zero or to a codeword of its own sign, under either rounding.

* No more nonzero points than free codewords: every point gets its own codeword (cost 0); the
  codewords left over are spread evenly over the odd positions (the histogram's bin centres)
  that no point holds, then ``+1`` ends it. The reference padded with its smallest centre
  overwritten by -1; padding with ``+1`` (this package's first rule) kept every centre but left
  a codebook learned from a few values (one scalar's first gradient, a one-hot one) with three
  to five codewords for every later momentum. Any codebook holding every point is optimal
  here; this one also serves the denser histograms that follow.
* Otherwise a dynamic program per side, over the points ``lo+1..hi`` between the pins ``L``
  and ``R``: ``F_0(e) = cost(points lo+1..e -> L)``,
  ``F_k(e) = min_{lo+k-1 <= j < e} F_{k-1}(j) + SSE(points j+1..e)``, the side's cost with
  ``k`` codewords ``min_e F_k(e) + cost(points e+1..hi -> R)``. Ties take the smallest split
  point, the smallest final ``e`` and the fewest codewords below zero, so identical histograms
  give byte-identical codebooks everywhere.

The reference forced both end clusters to be non-empty; allowing them to be empty is the
exact optimum of the stated problem, never costs more, and needs no special case when
fewer bins are occupied than there are codewords.

Speed. The segment cost satisfies the quadrangle inequality, so the smallest optimal split
point is monotone in ``e`` and each layer is solved by divide and conquer. All nodes of one
recursion depth have disjoint candidate ranges, so a depth is one vectorised numpy pass:
about ``(K - 3) * log2(N)`` passes of ``O(N)`` work per side (a full 4096-bin, 256-codeword
solve takes a fraction of a second on one CPU core; ``gefen bench dp`` measures it).

Exactness. Points are handled in integer coordinates (bin centre ``x = y / 4096`` with odd
``y``), segment sums are exact int64 prefix differences, and every candidate value is
computed by one shared elementwise expression, so :func:`solve_pinned_codebook` and the
``O(K N^2)`` oracle :func:`solve_pinned_codebook_bruteforce` see bit-identical values and
return the same codebook (tested, ties included).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "CodebookSolution",
    "codebook_solve_reference",
    "histogram_points",
    "solve_pinned_codebook",
    "solve_pinned_codebook_bruteforce",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class CodebookSolution:
    """The optimal codebook (float64, ascending, ``[-1, ..., 0, ..., +1]``), its cost in the
    input's integer units, and the number of points assigned to -1 (``prefix``), to 0
    (``zero``) and to +1 (``suffix``)."""

    codebook: FloatArray
    cost: float
    prefix: int
    zero: int
    suffix: int


def histogram_points(counts: npt.ArrayLike) -> tuple[IntArray, IntArray, int]:
    """Occupied bins of a histogram on ``[-1, 1]`` as integer positions and weights.

    Bin ``k`` of ``H`` has centre ``-1 + (k + 0.5) * 2 / H = y / H`` with ``y = 2k + 1 - H``.
    Returns ``(y, weights, H)`` for the bins with a positive count. Raises ``ValueError`` on a
    negative count or an empty histogram.
    """
    array = np.asarray(counts)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("histogram_points: counts must be a non-empty 1-D array")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"histogram_points: counts must be integers, got {array.dtype}")
    if (array < 0).any():
        raise ValueError("histogram_points: counts must be non-negative")
    bins = array.size
    occupied = np.flatnonzero(array > 0)
    if occupied.size == 0:
        raise ValueError("histogram_points: the histogram is empty")
    positions = (2 * occupied + 1 - bins).astype(np.int64)
    return positions, array[occupied].astype(np.int64), bins


class _Sums:
    """Exact prefix sums of w, w*y, w*y^2 and the shared candidate-value expression."""

    def __init__(self, positions: IntArray, weights: IntArray, scale: int) -> None:
        self.n = int(positions.size)
        self.scale = scale
        zero = np.zeros(1, dtype=np.int64)
        total = sum(weights.tolist())  # Python ints: an int64 sum wraps past 2^63
        largest = max(abs(int(positions[0])), abs(int(positions[-1])), scale)
        if total * largest * largest >= 2**62:
            raise ValueError("solve_pinned_codebook: total weight is too large for exact int64 sums")
        self.w = np.concatenate([zero, np.cumsum(weights, dtype=np.int64)])
        self.x = np.concatenate([zero, np.cumsum(weights * positions, dtype=np.int64)])
        self.q = np.concatenate([zero, np.cumsum(weights * positions * positions, dtype=np.int64)])
        # Below 2**53 every prefix sum and every difference is exact in float64 too, so the
        # float arrays give the same values as int64 differences converted afterwards.
        self.exact_float = int(self.q[-1]) < 2**53
        if self.exact_float:
            self.wf, self.xf, self.qf = (a.astype(np.float64) for a in (self.w, self.x, self.q))

    def _segment(self, j: IntArray, e: IntArray) -> tuple[FloatArray, FloatArray, FloatArray]:
        if self.exact_float:
            return self.wf[e] - self.wf[j], self.xf[e] - self.xf[j], self.qf[e] - self.qf[j]
        dw = (self.w[e] - self.w[j]).astype(np.float64)
        dx = (self.x[e] - self.x[j]).astype(np.float64)
        dq = (self.q[e] - self.q[j]).astype(np.float64)
        return dw, dx, dq

    def interior(self, previous: FloatArray, j: IntArray, e: IntArray) -> FloatArray:
        """``previous[j] + SSE(points j+1..e)`` elementwise (the only candidate expression)."""
        dw, dx, dq = self._segment(j, e)
        return previous[j] + (dq - dx * dx / dw)

    def pinned(self, j: IntArray, e: IntArray, centre: int) -> FloatArray:
        """Cost of assigning points ``j+1..e`` to the pinned ``centre`` (integer units)."""
        dw, dx, dq = self._segment(j, e)
        c = float(centre)
        return dq - 2.0 * c * dx + c * c * dw

    def mean(self, j: int, e: int) -> float:
        return float(self.x[e] - self.x[j]) / float(self.w[e] - self.w[j])


def _validate(positions: IntArray, weights: IntArray, clusters: int, scale: int) -> None:
    if type(clusters) is not int or clusters < 3:
        raise ValueError(f"solve_pinned_codebook: clusters must be an int >= 3 (-1, 0 and +1), got {clusters!r}")
    if type(scale) is not int or scale < 1:
        raise ValueError(f"solve_pinned_codebook: scale must be a positive int, got {scale!r}")
    if positions.ndim != 1 or positions.shape != weights.shape:
        raise ValueError("solve_pinned_codebook: positions and weights must be 1-D arrays of equal length")
    if positions.size == 0:
        raise ValueError("solve_pinned_codebook: there are no points (empty histogram)")
    if (weights <= 0).any():
        raise ValueError("solve_pinned_codebook: every weight must be positive")
    if positions.size > 1 and (np.diff(positions) <= 0).any():
        raise ValueError("solve_pinned_codebook: positions must be strictly increasing")
    if positions[0] <= -scale or positions[-1] >= scale:
        raise ValueError("solve_pinned_codebook: positions must lie strictly inside (-scale, scale)")


def _as_int_arrays(positions: npt.ArrayLike, weights: npt.ArrayLike) -> tuple[IntArray, IntArray]:
    p = np.asarray(positions)
    w = np.asarray(weights)
    for name, array in (("positions", p), ("weights", w)):
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"solve_pinned_codebook: {name} must be integers, got {array.dtype}")
    return p.astype(np.int64), w.astype(np.int64)


def _few_points(positions: IntArray, clusters: int, scale: int) -> CodebookSolution:
    # Every point keeps its own codeword (cost 0, optimal whatever the others are). The others
    # are spread evenly over the grid of positions (a histogram's bin centres) no point or pin
    # holds: padded at +1 they represented nothing, and a codebook learned from one scalar's
    # or a one-hot first gradient (three codewords) quantised every later momentum into them.
    held = positions[positions != 0]
    free = np.setdiff1d(np.arange(1 - scale, scale, 2, dtype=np.int64), np.concatenate([held, [0]]))
    spread = min(clusters - 3 - held.size, free.size)
    picked = free[((2 * np.arange(spread, dtype=np.int64) + 1) * free.size) // (2 * max(spread, 1))]  # segment middles
    inner = np.sort(np.concatenate([held, picked, [0]])).astype(np.float64) / scale
    pad = np.ones(clusters - 1 - inner.size, dtype=np.float64)  # only on a grid smaller than the codebook
    zero = int(positions.size - held.size)
    return CodebookSolution(np.concatenate([[-1.0], inner, pad]), 0.0, 0, zero, 0)


def _layer(
    sums: _Sums, previous: FloatArray, k: int, lo: int, hi: int, *, bruteforce: bool
) -> tuple[FloatArray, IntArray]:
    """Layer ``k`` of one side's program over the points ``lo+1..hi`` (prefix indices):
    ``F_k(e) = min_{lo+k-1 <= j < e} F_{k-1}(j) + SSE(points j+1..e)`` for ``e`` in
    ``[lo+k, hi]``, and the smallest minimising ``j`` (by divide and conquer, or every
    candidate scanned by the oracle)."""
    current = np.full(sums.n + 1, np.inf, dtype=np.float64)
    argmin = np.zeros(sums.n + 1, dtype=np.int64)
    if bruteforce:
        for end in range(lo + k, hi + 1):
            j = np.arange(lo + k - 1, end, dtype=np.int64)
            values = sums.interior(previous, j, np.full_like(j, end))
            best = int(np.argmin(values))
            current[end] = values[best]
            argmin[end] = j[best]
        return current, argmin
    # the smallest optimal split is monotone in e (quadrangle inequality), and every node of
    # one recursion depth has its own candidate range: a depth is one vectorised pass
    e_lo, e_hi = np.array([lo + k], dtype=np.int64), np.array([hi], dtype=np.int64)
    o_lo, o_hi = np.array([lo + k - 1], dtype=np.int64), np.array([hi - 1], dtype=np.int64)
    while e_lo.size:
        mid = (e_lo + e_hi) // 2
        top = np.minimum(mid - 1, o_hi)
        counts = top - o_lo + 1
        ends = np.cumsum(counts)
        starts = ends - counts
        j = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(o_lo - starts, counts)
        values = sums.interior(previous, j, np.repeat(mid, counts))
        minima = np.minimum.reduceat(values, starts)
        hits = np.flatnonzero(values == np.repeat(minima, counts))
        chosen = j[hits[np.searchsorted(hits, starts)]]
        current[mid] = minima
        argmin[mid] = chosen
        left = e_lo <= mid - 1
        right = mid + 1 <= e_hi
        e_lo, e_hi, o_lo, o_hi = (
            np.concatenate([e_lo[left], mid[right] + 1]),
            np.concatenate([mid[left] - 1, e_hi[right]]),
            np.concatenate([o_lo[left], chosen[right]]),
            np.concatenate([chosen[left], o_hi[right]]),
        )
    return current, argmin


@dataclass(slots=True)
class _Side:
    """One side of zero: its best cost with ``k`` interior codewords (``costs[k]``), where
    that optimum's last segment ends (``ends[k]``) and every layer's split points."""

    costs: list[float]
    ends: list[int]
    layers: list[IntArray]

    def centres(self, sums: _Sums, k: int) -> tuple[list[float], int]:
        """The ``k`` interior centres of the side's optimum (ascending) and where its
        left-pinned prefix ends."""
        end, centres = self.ends[k], []
        for layer in range(k, 0, -1):
            start = int(self.layers[layer - 1][end])
            centres.append(sums.mean(start, end) / sums.scale)
            end = start
        return centres[::-1], end


def _side(sums: _Sums, lo: int, hi: int, left: int, right: int, most: int, *, bruteforce: bool) -> _Side:
    """The program of the points ``lo+1..hi`` between the pins ``left`` and ``right``, for
    0 to ``most`` interior codewords (at most one per point)."""
    all_ends = np.arange(lo, hi + 1, dtype=np.int64)
    previous = np.full(sums.n + 1, np.inf, dtype=np.float64)
    previous[lo : hi + 1] = sums.pinned(np.full_like(all_ends, lo), all_ends, left)
    side = _Side([], [], [])
    for k in range(min(most, hi - lo) + 1):
        if k:
            previous, argmin = _layer(sums, previous, k, lo, hi, bruteforce=bruteforce)
            side.layers.append(argmin)
        ends = all_ends[k:]
        totals = previous[ends] + sums.pinned(ends, np.full_like(ends, hi), right)
        best = int(np.argmin(totals))  # first minimum: the smallest end
        side.costs.append(float(totals[best]))
        side.ends.append(int(ends[best]))
    return side


def _solve(
    positions: npt.ArrayLike, weights: npt.ArrayLike, clusters: int, scale: int, *, bruteforce: bool
) -> CodebookSolution:
    p, w = _as_int_arrays(positions, weights)
    _validate(p, w, clusters, scale)
    free = clusters - 3
    if int(np.count_nonzero(p)) <= free:
        return _few_points(p, clusters, scale)
    sums = _Sums(p, w, scale)
    negative, nonpositive = int(np.count_nonzero(p < 0)), int(np.count_nonzero(p <= 0))
    below = _side(sums, 0, negative, -scale, 0, free, bruteforce=bruteforce)
    above = _side(sums, nonpositive, sums.n, 0, scale, free, bruteforce=bruteforce)
    # split the free codewords between the sides: the first minimum, the fewest below zero
    splits = range(max(0, free - (len(above.costs) - 1)), min(free, len(below.costs) - 1) + 1)
    totals = [below.costs[k] + above.costs[free - k] for k in splits]
    k = splits[int(np.argmin(totals))]
    low, prefix = below.centres(sums, k)
    high, zero_end = above.centres(sums, free - k)
    codebook = np.array([-1.0, *low, 0.0, *high, 1.0], dtype=np.float64)
    zero = (negative - below.ends[k]) + (nonpositive - negative) + (zero_end - nonpositive)
    return CodebookSolution(codebook, min(totals), prefix, zero, sums.n - above.ends[free - k])


def solve_pinned_codebook(
    positions: npt.ArrayLike, weights: npt.ArrayLike, clusters: int, *, scale: int
) -> CodebookSolution:
    """Solve the pinned k-means exactly, each layer by divide and conquer (see the module
    docstring).

    ``positions`` are strictly increasing integers strictly inside ``(-scale, scale)`` (the
    point ``y`` stands for ``y / scale``; the pins are ``-scale``, 0 and ``+scale``), ``weights``
    positive integers, ``clusters`` the codebook size (>= 3). Raises ``ValueError`` naming
    the bad input.
    """
    return _solve(positions, weights, clusters, scale, bruteforce=False)


def solve_pinned_codebook_bruteforce(
    positions: npt.ArrayLike, weights: npt.ArrayLike, clusters: int, *, scale: int
) -> CodebookSolution:
    """The ``O(K N^2)`` oracle: same problem, same tie rule, every candidate scanned."""
    return _solve(positions, weights, clusters, scale, bruteforce=True)


def codebook_solve_reference(counts: torch.Tensor) -> torch.Tensor:
    """The reference of the op ``gefen::codebook_solve.v2``: the float64 256-entry codebook of
    :func:`solve_pinned_codebook` for a CPU int64 histogram (:func:`histogram_points`)."""
    positions, weights, bins = histogram_points(counts.numpy())
    return torch.from_numpy(solve_pinned_codebook(positions, weights, 256, scale=bins).codebook)

"""The codebook solve: exact, deterministic, equal to the O(K N^2) oracle, ties included."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from gefen_core.codebook import codebook_from_counts
from gefen_core.exact_dp import (
    histogram_points,
    solve_pinned_codebook,
    solve_pinned_codebook_bruteforce,
)
from gefen_core_test_support import single_threaded_torch  # noqa: F401  (autouse fixture)


def _random_case(rng: np.random.Generator, index: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    scale = int(rng.choice([16, 32, 64]))
    count = int(rng.integers(1, scale))
    bins = np.sort(rng.choice(scale, size=count, replace=False))
    positions = 2 * bins + 1 - scale
    kind = index % 4
    if kind == 0:
        weights = rng.integers(1, 4, size=count)  # many exact ties
    elif kind == 1:
        weights = np.ones(count, dtype=np.int64)
    elif kind == 2:
        weights = rng.integers(1, 10**6, size=count)
    else:
        weights = np.full(count, 7, dtype=np.int64)
        positions = (2 * np.arange(count) + 1 - count) * (scale // count if scale // count else 1)
        positions = np.clip(positions, -scale + 1, scale - 1)
        positions = np.unique(positions)
        weights = weights[: positions.size]
    return positions, weights, int(rng.integers(3, 10)), scale


def test_divide_and_conquer_equals_bruteforce_on_random_inputs() -> None:
    rng = np.random.default_rng(20260611)
    for index in range(400):
        positions, weights, clusters, scale = _random_case(rng, index)
        fast = solve_pinned_codebook(positions, weights, clusters, scale=scale)
        slow = solve_pinned_codebook_bruteforce(positions, weights, clusters, scale=scale)
        assert np.array_equal(fast.codebook, slow.codebook), (positions, weights, clusters)
        assert fast.cost == slow.cost and (fast.prefix, fast.zero, fast.suffix) == (slow.prefix, slow.zero, slow.suffix)
        assert fast.codebook.size == clusters and int((fast.codebook == 0.0).sum()) >= 1


def test_equal_to_bruteforce_with_large_counts_and_256_codewords() -> None:
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 3, size=4096) * rng.integers(1, 2**28, size=4096)
    counts[rng.choice(4096, size=3700, replace=False)] = 0  # about 300 occupied bins
    positions, weights, scale = histogram_points(counts)
    assert int((weights.astype(object) * 4095**2).sum()) >= 2**53  # exercises the int64 path
    fast = solve_pinned_codebook(positions, weights, 256, scale=scale)
    slow = solve_pinned_codebook_bruteforce(positions, weights, 256, scale=scale)
    assert np.array_equal(fast.codebook, slow.codebook)


def _exact_optimum(positions: list[int], weights: list[int], clusters: int, scale: int) -> Fraction:
    """Enumerate every contiguous split: a prefix to -1, ``a`` non-empty segments at their
    means, a run to 0, ``b`` non-empty segments, a suffix to +1 (``a + b = K - 3``; the pinned
    runs may be empty), whatever the signs of the points in each piece."""
    n = len(positions)

    def piece(a: int, b: int, centre: Fraction | None) -> Fraction:
        if a == b:
            return Fraction(0)
        w = sum(weights[a:b])
        mean = Fraction(sum(wi * p for wi, p in zip(weights[a:b], positions[a:b])), w) if centre is None else centre
        return sum((wi * (p - mean) ** 2 for wi, p in zip(weights[a:b], positions[a:b])), Fraction(0))

    best: Fraction | None = None
    for below in range(clusters - 2):
        for cuts in itertools.combinations_with_replacement(range(n + 1), clusters - 1):
            # cuts[0] ends the prefix, cuts[below] and cuts[below + 1] bound the run at 0, cuts[-1]
            # starts the suffix; the free segments between the others are non-empty
            free = [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1) if i != below]
            if any(b <= a for a, b in free):
                continue
            cost = piece(0, cuts[0], Fraction(-scale)) + piece(cuts[-1], n, Fraction(scale))
            cost += piece(cuts[below], cuts[below + 1], Fraction(0)) + sum(piece(a, b, None) for a, b in free)
            best = cost if best is None or cost < best else best
    assert best is not None
    return best


def test_dp_optimum_matches_exhaustive_rational_search() -> None:
    rng = np.random.default_rng(3)
    for _ in range(40):
        scale = 16
        n = int(rng.integers(3, 8))
        bins = np.sort(rng.choice(scale, size=n, replace=False))
        positions = [int(2 * b + 1 - scale) for b in bins]
        weights = [int(w) for w in rng.integers(1, 6, size=n)]
        clusters = int(rng.integers(3, min(n + 3, 6)))
        if n <= clusters - 3:
            continue
        solution = solve_pinned_codebook(positions, weights, clusters, scale=scale)
        assert solution.cost == pytest.approx(float(_exact_optimum(positions, weights, clusters, scale)), rel=1e-12)


def test_fewer_points_than_codewords_keep_every_centre() -> None:
    centres = [-0.7, -0.2, 0.1, 0.4, 0.9]
    scale = 4096
    positions = [round(c * scale) | 1 for c in centres]
    solution = solve_pinned_codebook(positions, [3, 1, 4, 1, 5], 9, scale=scale)
    codebook = solution.codebook.tolist()
    assert solution.cost == 0.0
    assert codebook[0] == -1.0 and codebook[-1] == 1.0 and codebook == sorted(set(codebook)) and 0.0 in codebook
    spare = sorted(set(codebook) - {p / scale for p in positions} - {-1.0, 0.0, 1.0})
    # the codeword left over is not another +1: it takes the middle of the free grid
    assert len(spare) == 1 and abs(spare[0]) < 4 / scale


def test_a_codebook_learned_from_a_few_values_spreads_its_other_codewords() -> None:
    """One scalar's first gradient, or a one-hot one, fills three to five bins: the codebook
    was those values and +1 repeated, and every later momentum was rounded into them."""
    counts = torch.zeros(4096, dtype=torch.int64)
    counts[[0, 2048, 4095]] = torch.tensor([5, 900, 7])
    codebook = codebook_from_counts(counts)
    assert codebook is not None and codebook.unique().numel() == 256
    assert float(codebook.diff().max()) < 40 / 4096  # evenly spread: about 2 * 4096 / 254 apart


def test_codebook_from_counts_is_sorted_pinned_and_deterministic() -> None:
    rng = np.random.default_rng(11)
    counts = torch.from_numpy(rng.integers(0, 50, size=4096))
    first = codebook_from_counts(counts)
    second = codebook_from_counts(counts.clone())
    assert first is not None and second is not None
    assert first.dtype is torch.float32 and first.shape == (256,)
    assert first[0].item() == -1.0 and first[-1].item() == 1.0
    assert bool((first[1:] >= first[:-1]).all())
    assert first.numpy().tobytes() == second.numpy().tobytes()
    assert codebook_from_counts(torch.zeros(4096, dtype=torch.int64)) is None


def test_full_solve_uses_all_256_codewords_on_a_busy_histogram() -> None:
    counts = np.random.default_rng(5).integers(1, 1000, size=4096)
    positions, weights, scale = histogram_points(counts)
    solution = solve_pinned_codebook(positions, weights, 256, scale=scale)
    assert len(np.unique(solution.codebook)) == 256


@pytest.mark.parametrize(
    ("positions", "weights", "clusters", "message"),
    [
        ([], [], 4, "no points"),
        ([1, 3], [1, 0], 4, "positive"),
        ([3, 1], [1, 1], 4, "strictly increasing"),
        ([1, 3], [1, 1], 1, "clusters"),
        ([1, 3], [1, 1], 2, "clusters"),
        ([1, 17], [1, 1], 4, "strictly inside"),
        ([1.5, 3.0], [1, 1], 4, "integers"),
    ],
)
def test_bad_inputs_raise(positions: list[float], weights: list[int], clusters: int, message: str) -> None:
    array = np.asarray(positions, dtype=np.int64 if all(type(p) is int for p in positions) else np.float64)
    with pytest.raises(ValueError, match=message):
        solve_pinned_codebook(array, np.asarray(weights, dtype=np.int64), clusters, scale=16)


def test_histogram_points_validation() -> None:
    with pytest.raises(ValueError, match="empty"):
        histogram_points(np.zeros(8, dtype=np.int64))
    with pytest.raises(ValueError, match="non-negative"):
        histogram_points(np.array([1, -1, 0, 0]))
    positions, weights, bins = histogram_points(np.array([2, 0, 0, 5]))
    assert positions.tolist() == [-3, 3] and weights.tolist() == [2, 5] and bins == 4


def test_a_histogram_beyond_the_exact_int64_range_still_solves() -> None:
    """A histogram summed over a mesh or scope counts the whole model: above about 2.7e11
    elements the exact sums would overflow int64. The counts are halved (every occupied bin
    kept) until they fit; a histogram twice as heavy everywhere gives the same codebook."""
    counts = torch.zeros(4096, dtype=torch.int64)
    counts[::8] = 3
    counts[2048] += 2**38
    counts[1000:1100] += 2**30
    huge = codebook_from_counts(counts)
    assert huge is not None and huge.shape == (256,)
    assert float(huge[0]) == -1.0 and float(huge[-1]) == 1.0 and bool((huge[1:] >= huge[:-1]).all())
    assert torch.equal(codebook_from_counts(counts * 2), huge)  # a second halving of the doubled counts


def test_counts_whose_total_passes_int64_are_halved_not_wrapped() -> None:
    """Two bins of 2^62 sum past 2^63, which an int64 sum wraps to a negative total: the counts
    were not halved and the exact sums overflowed into a meaningless codebook. The total is
    taken exactly, so they are halved as any heavy histogram's are: the two heavy bins keep a
    codeword at their centres."""
    counts = torch.full((4096,), 3, dtype=torch.int64)
    counts[[10, 4000]] = 2**62
    codebook = codebook_from_counts(counts)
    assert codebook is not None and bool((codebook[1:] >= codebook[:-1]).all())
    for heavy in (10, 4000):
        assert float((codebook.double() - (2 * heavy + 1 - 4096) / 4096).abs().min()) < 1e-7
    with pytest.raises(ValueError, match="too large"):
        solve_pinned_codebook([-1, 1], [2**62, 2**62], 3, scale=2)

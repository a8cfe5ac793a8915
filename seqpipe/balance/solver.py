"""Optimal split of per-layer costs into contiguous partitions (the linear partition problem).

A pipeline runs as fast as its slowest stage and fits only if its fullest device fits, so a
good ``balance`` minimises the largest partition's summed cost. This module solves that
exactly for any non-negative costs, whatever they measure (parameters, seconds, bytes).

Many splits often share the optimal largest cost (identical blocks, cost-free activations),
so the choice among them is fixed, in this order:

1. Each partition is scored by the pair ``(summed cost, layer count)`` and the largest pair
   is minimised, so the costliest partition gets as few layers as possible: cost-free layers
   (activations, reshapes) are not piled onto the bottleneck, and all-zero costs split evenly.
2. Among those splits, the most even one: least sum of squared partition costs, then least
   sum of squared layer counts (7 equal layers in 3 parts give ``[3, 2, 2]``, not
   ``[3, 3, 1]``).
3. Any tie left gives the later partitions fewer layers.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from itertools import accumulate

from seqpipe.core.arguments import integer

__all__ = ["check_partitions", "solve"]

Score = tuple[float, int]
"""``(summed cost, layer count)`` of one partition; compared lexicographically."""


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Layer counts of ``partitions`` contiguous, non-empty parts minimising the largest cost.

    ``costs`` holds one non-negative number per layer. The counts sum to ``len(costs)`` and
    can be passed to ``Pipe(..., balance=...)`` as they are. Ties are broken as the module
    docstring describes.
    """
    checked = _check_costs(costs)
    partitions = check_partitions(partitions, len(checked))
    prefix = list(accumulate(checked, initial=0))
    return _most_even(prefix, partitions, _bottleneck(prefix, partitions))


def check_partitions(partitions: int, layers: int) -> int:
    """``partitions`` as an int, if ``layers`` layers can be cut into that many non-empty
    partitions; else ``TypeError``/``ValueError``."""
    count = integer(partitions)
    if count is None:
        raise TypeError(f"partitions must be an int, got {type(partitions).__name__}")
    partitions = count
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, got {partitions}")
    if partitions > layers:
        raise ValueError(
            f"cannot split {layers} layers into {partitions} non-empty partitions; use at "
            f"most {layers} partitions, or split the model into more layers")
    return partitions


def _check_costs(costs: Sequence[float]) -> list[float]:
    """The costs as a list; ints stay ints, so integer costs are summed exactly."""
    checked = [c if isinstance(c, int) else float(c) for c in costs]
    for index, cost in enumerate(checked):
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(
                f"costs must be finite and non-negative, but layer {index} has cost {cost}")
    return checked


def _score(prefix: list[float], start: int, stop: int) -> Score:
    """The score of the part holding layers ``start`` to ``stop - 1``."""
    return prefix[stop] - prefix[start], stop - start


def _bottleneck(prefix: list[float], partitions: int) -> Score:
    """The smallest achievable largest score, by dynamic programming over part counts.

    ``best[m]`` (the optimum for the first ``m`` layers in one part fewer) never decreases
    with ``m``, and the last part's score strictly decreases, so the best start of the last
    part is where the two cross, found by bisection: O(partitions · n log n).
    """
    n = len(prefix) - 1
    best: list[Score | None] = [_score(prefix, 0, i) for i in range(n + 1)]
    for parts in range(2, partitions + 1):
        row: list[Score | None] = [None] * (n + 1)
        lo = parts - 1
        for i in range(parts, n + 1):
            cross = lo + bisect.bisect_left(
                range(lo, i), True,
                key=lambda m: best[m] >= _score(prefix, m, i))  # type: ignore[operator]
            candidates = [best[cross]] if cross < i else []
            if cross > lo:
                candidates.append(_score(prefix, cross - 1, i))
            row[i] = min(candidates)  # type: ignore[type-var]
        best = row
    return best[n]  # type: ignore[return-value]


def _most_even(prefix: list[float], partitions: int, bound: Score) -> list[int]:
    """Among splits whose parts all score at most ``bound``, the most even one.

    Minimises the sum of squared part costs, then of squared layer counts. Later starts of a
    part are tried first and only a strict improvement replaces them, so remaining ties give
    the later parts fewer layers.
    """
    n = len(prefix) - 1
    inf = (math.inf, math.inf)
    spread = [(prefix[i] ** 2, i * i) if (prefix[i], i) <= bound else inf for i in range(n + 1)]
    starts: list[list[int]] = []  # starts[j - 2][i]: where part j starts, given i layers
    for parts in range(2, partitions + 1):
        row = [inf] * (n + 1)
        start_row = [0] * (n + 1)
        first, last = (n, n) if parts == partitions else (parts, n - partitions + parts)
        for i in range(first, last + 1):
            m = i - 1
            while m >= parts - 1 and _score(prefix, m, i) <= bound:
                cost, count = _score(prefix, m, i)
                here = (spread[m][0] + cost * cost, spread[m][1] + count * count)
                if here < row[i]:
                    row[i], start_row[i] = here, m
                m -= 1
        spread = row
        starts.append(start_row)
    return _counts(starts, n)


def _counts(starts: list[list[int]], n: int) -> list[int]:
    """Walk the recorded part starts back from the last layer into layer counts."""
    counts, stop = [], n
    for start_row in reversed(starts):
        start = start_row[stop]
        counts.append(stop - start)
        stop = start
    counts.append(stop)
    return counts[::-1]

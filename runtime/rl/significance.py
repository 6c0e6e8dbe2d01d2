"""Is a change real? Intervals and a paired test for before/after evaluations, and for paired speed ratios.

The job evaluates the same held-out samples (same problems, same per-sample seeds) before the first and after
the last step, so the two outcome lists are paired: McNemar's exact test on the discordant pairs and a normal
interval on the mean paired difference use that pairing (far tighter than comparing two independent rates).
Speed comparisons are paired too: `ratio_interval` for the benchmark's few repeats (the geometric mean's t
interval), `median_interval` for the local run's many rollout pairs (order statistics, which outliers cannot stretch).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, TypedDict

Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (sensible near 0 and 1, unlike the Wald interval)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: under no change, each discordant pair goes either way with probability 1/2."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


class PairedComparison(TypedDict):
    """Before/after accuracy on the same samples; the intervals are [low, high] lists so the dict is JSON as is."""
    n: int
    before: float
    before_ci: list[float]
    after: float
    after_ci: list[float]
    difference: float
    difference_ci: list[float]
    gained: int
    lost: int
    p_value: float


def paired_comparison(before: Sequence[bool], after: Sequence[bool], z: float = Z95) -> PairedComparison:
    """Accuracy before and after on the same samples: each with its 95% interval, the paired difference with its
    95% interval, and McNemar's exact p-value."""
    if len(before) != len(after):
        raise ValueError(f"before/after: paired outcomes must have the same length, got {len(before)} and "
                         f"{len(after)}")
    n = len(before)
    if n == 0:
        raise ValueError("before/after: no outcomes to compare")
    b, a = sum(map(bool, before)), sum(map(bool, after))
    gained = sum(1 for x, y in zip(before, after) if y and not x)
    lost = sum(1 for x, y in zip(before, after) if x and not y)
    diff = (gained - lost) / n
    # variance of the mean of per-pair differences d_i in {-1, 0, 1}
    var = ((gained + lost) / n - diff * diff) / n
    half = z * math.sqrt(max(0.0, var))
    lo_b, hi_b = wilson_interval(b, n, z)
    lo_a, hi_a = wilson_interval(a, n, z)
    return {"n": n, "before": b / n, "before_ci": [lo_b, hi_b], "after": a / n, "after_ci": [lo_a, hi_a],
            "difference": diff, "difference_ci": [diff - half, diff + half], "gained": gained, "lost": lost,
            "p_value": mcnemar_exact_p(gained, lost)}


def grouped_comparison(before: Sequence[bool], after: Sequence[bool], groups: Sequence[str | None]
                       ) -> dict[str, dict[str, float]]:
    """Accuracy before and after per group (a problem's difficulty): where on the task a change happened."""
    if not len(before) == len(after) == len(groups):
        raise ValueError(f"before/after/groups: lengths differ ({len(before)}, {len(after)}, {len(groups)})")
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(g for g in groups if g is not None):
        idx = [i for i, g in enumerate(groups) if g == name]
        b = sum(1 for i in idx if before[i]) / len(idx)
        a = sum(1 for i in idx if after[i]) / len(idx)
        out[name] = {"n": len(idx), "before": b, "after": a, "difference": a - b}
    return out


def length_profile(lengths: Sequence[int]) -> dict[str, float]:
    """Median, 95th percentile (nearest rank) and maximum of response lengths, and how long the tail is
    (p95 / median)."""
    if not lengths:
        return {"median": 0.0, "p95": 0.0, "max": 0.0, "tail_ratio": 0.0}
    xs = sorted(lengths)
    n = len(xs)
    median = float(xs[n // 2]) if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0
    p95 = float(xs[min(n - 1, max(0, math.ceil(0.95 * n) - 1))])
    return {"median": median, "p95": p95, "max": float(xs[-1]),
            "tail_ratio": p95 / median if median > 0 else 0.0}


def ratio_interval(ratios: Sequence[float], level: float = 0.9) -> dict[str, Any] | None:
    """The geometric mean of paired per-repeat ratios and its `level` confidence interval (Student's t on the
    logs: a ratio's noise is multiplicative). Why beside the median: on a shared machine one configuration's
    repeats spread by up to 60%, and whether a median below a target is a miss or noise is what the interval says;
    None with fewer than two ratios."""
    logs = [math.log(r) for r in ratios if r > 0]
    if len(logs) < 2:
        return None
    from scipy.stats import t

    mean = statistics.fmean(logs)
    half = t.ppf(0.5 + level / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"geomean": round(math.exp(mean), 3), "low": round(math.exp(mean - half), 3),
            "high": round(math.exp(mean + half), 3), "level": level}


def median_interval(xs: Sequence[float], level: float = 0.9) -> dict[str, Any] | None:
    """The median of `xs` and a distribution-free `level` confidence interval for it: the order statistics
    x_(k) and x_(n+1-k) with the largest k whose binomial tail P(Bin(n, 1/2) < k) is at most (1 - level) / 2
    (`coverage`: the interval's exact level, at least `level`). Why not `ratio_interval` for the local run's
    rollout pairs: one pair of ~0.1 s rollouts that a load spike hits comes out at 0.2x or 4.6x, and two of those
    among 31 widened the t interval of the geometric mean to [0.82, 1.05] around pairs that lay within 0.85-0.98;
    order statistics ignore how far out an outlier lies. None where n is too small for `level` (n < 5 at 90%)."""
    vals = sorted(x for x in xs if not math.isnan(x))
    n = len(vals)
    tail = (1.0 - level) / 2.0
    k, below = 0, 0.0  # below: P(Bin(n, 1/2) < k), the chance that x_(k) lies above the median
    while k < n // 2:
        nxt = below + math.comb(n, k) / 2.0**n
        if nxt > tail:
            break
        k, below = k + 1, nxt
    if k == 0:
        return None
    return {"median": statistics.median(vals), "low": vals[k - 1], "high": vals[n - k], "level": level,
            "coverage": round(1.0 - 2.0 * below, 4)}

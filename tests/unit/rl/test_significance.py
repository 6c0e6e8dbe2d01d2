"""Intervals and the paired test behind the held-out before/after comparison of `specrl run`, and the interval of
its rollout comparison."""

from __future__ import annotations

import random

import pytest
from specrl.runtime.rl.significance import (
    grouped_comparison,
    length_profile,
    mcnemar_exact_p,
    median_interval,
    paired_comparison,
    wilson_interval,
)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo, hi = wilson_interval(0, 20)  # stays inside [0, 1] where the Wald interval collapses to a point
    assert lo == 0.0 and 0.1 < hi < 0.2
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mcnemar_exact_matches_the_binomial_tail():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(5, 5) == 1.0
    assert mcnemar_exact_p(10, 0) == pytest.approx(2 / 1024)
    assert mcnemar_exact_p(3, 12) == mcnemar_exact_p(12, 3) == pytest.approx(0.0352, abs=1e-4)


def test_paired_comparison_counts_and_interval():
    before = [True] * 30 + [False] * 70
    after = [True] * 25 + [False] * 5 + [True] * 20 + [False] * 50  # 5 lost, 20 gained
    c = paired_comparison(before, after)
    assert (c["before"], c["after"], c["gained"], c["lost"]) == (0.30, 0.45, 20, 5)
    assert c["difference"] == pytest.approx(0.15)
    lo, hi = c["difference_ci"]
    assert 0.0 < lo < 0.15 < hi  # a real gain: the interval excludes 0
    assert c["p_value"] < 0.01
    with pytest.raises(ValueError, match="same length"):
        paired_comparison([True], [True, False])


def test_paired_interval_covers_no_change_at_the_nominal_rate():
    """Under no change (both evaluations independent draws of the same accuracy) the 95% interval on the
    difference covers 0 about 95% of the time and McNemar rejects about 5% of the time."""
    rng = random.Random(0)
    covered = rejected = 0
    trials = 400
    for _ in range(trials):
        before = [rng.random() < 0.3 for _ in range(512)]
        after = [rng.random() < 0.3 for _ in range(512)]
        c = paired_comparison(before, after)
        covered += c["difference_ci"][0] <= 0.0 <= c["difference_ci"][1]
        rejected += c["p_value"] < 0.05
    assert 0.91 <= covered / trials <= 0.99
    assert rejected / trials <= 0.09


def test_length_profile():
    p = length_profile([10] * 90 + [50] * 9 + [200])
    assert (p["median"], p["p95"], p["max"]) == (10.0, 50.0, 200.0)
    assert p["tail_ratio"] == 5.0
    assert length_profile([]) == {"median": 0.0, "p95": 0.0, "max": 0.0, "tail_ratio": 0.0}
    assert length_profile([3, 5])["median"] == 4.0


def test_grouped_comparison_splits_by_level_and_skips_unlabelled():
    before = [True, False, False, True, False]
    after = [True, True, False, False, True]
    groups = ["easy", "easy", "hard", "hard", None]
    by = grouped_comparison(before, after, groups)
    assert list(by) == ["easy", "hard"]
    assert by["easy"] == {"n": 2, "before": 0.5, "after": 1.0, "difference": 0.5}
    assert by["hard"] == {"n": 2, "before": 0.5, "after": 0.0, "difference": -0.5}
    with pytest.raises(ValueError, match="lengths differ"):
        grouped_comparison([True], [True], [])


def test_heldout_split_follows_the_jobs_mix_and_never_overlaps_training():
    from specrl.runtime.rl.settings import RunSettings
    from specrl.runtime.rollout_worker import load_problem_split

    settings = RunSettings(dataset="builtin:arithmetic", dataset_size=4000, eval_size=2000,
                           difficulty={"easy": 0.8, "medium": 0.1, "hard": 0.1})
    train, evals = load_problem_split(settings)
    assert len(train) == 4000 and len(evals) == 2000
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    easy = sum(p.difficulty == "easy" for p in evals) / len(evals)
    assert 0.76 < easy < 0.84  # drawn like training problems (distinct prompts skewed this to ~0.65)


def test_median_interval_is_distribution_free_and_ignores_how_far_outliers_lie() -> None:
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # four values cannot hold a median at 90%
    five = median_interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert five is not None and (five["low"], five["median"], five["high"], five["coverage"]) == (1, 3, 5, 0.9375)
    # the local run's 31 rollout pairs, two of them hit by load spikes: the interval stays among the rest
    pairs = [0.922, 0.209, 0.867, 0.892, 0.95, 0.936, 0.964, 0.98, 0.918, 0.947, 0.916, 0.938, 0.978, 0.914, 0.935,
             0.91, 0.927, 0.897, 0.854, 0.911, 0.901, 0.931, 0.912, 0.932, 0.929, 0.908, 0.942, 0.925, 4.631, 0.884,
             0.93]
    ci = median_interval(pairs)
    assert ci is not None and (ci["low"], ci["median"], ci["high"]) == (0.912, 0.925, 0.932)
    assert ci["coverage"] >= 0.9
    # coverage holds whatever the noise: a heavy-tailed one with 10% wild values, 2000 simulated runs
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        xs = [rng.gauss(0.0, 1.0) + (rng.random() < 0.1) * rng.choice((-50.0, 50.0)) for _ in range(31)]
        got = median_interval(xs)
        assert got is not None
        hits += got["low"] <= 0.0 <= got["high"]
    assert 0.9 <= hits / 2000 <= 0.96  # exact coverage at n=31: 0.929

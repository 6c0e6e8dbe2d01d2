"""Adaptive speculation: cost model math, toggle, draft length, acceptance tracking, bucketed bandit."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest
from specrl.runtime.engine.adaptive import (
    AR,
    AcceptanceTracker,
    AdaptiveController,
    AdaptiveSettings,
    BucketedEpsilonGreedy,
    CostModel,
    FixedController,
    alpha_from_mean_accepted,
    bucket_of,
    calibrate_from_timers,
    controller_from_spec,
    expected_tokens_per_round,
    label,
    predicted_speedup,
    settings_from_spec,
    toggle,
)
from specrl.runtime.engine.control import Decision, StepRecord


def memory_bound_model() -> CostModel:
    """A machine like the CPU measured in TESTING.md: verifying is cheap at batch 1, costly at batch 16."""
    target = {1: 7.3e-3, 16: 20.8e-3, 64: 60e-3}
    verify = {1: {1: 7.3e-3, 5: 7.3e-3 * 1.57}, 16: {1: 20.8e-3, 5: 20.8e-3 * 2.17}, 64: {1: 60e-3, 5: 60e-3 * 4.8}}
    draft = {"draft_model": {b: 0.06 * t for b, t in target.items()}, "ngram": {b: 0.0 for b in target}}
    return CostModel(target_step=target, verify_step=verify, draft_step=draft)


def test_expected_tokens_per_round_matches_the_geometric_sum() -> None:
    for alpha in (0.0, 0.3, 0.75, 0.95):
        for gamma in range(7):
            assert expected_tokens_per_round(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)))
    assert expected_tokens_per_round(1.0, 4) == 5.0
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_round(1.5, 2)


def test_predicted_speedup_reproduces_the_testing_note_numbers() -> None:
    # TESTING.md: γ=4, r=0.06, v=1.57 at batch 1 -> 1.6× at α=0.75 and 2.0× at α=0.85
    assert predicted_speedup(0.75, 4, 0.06, 1.57) == pytest.approx(1.68, abs=0.05)
    assert predicted_speedup(0.85, 4, 0.06, 1.57) == pytest.approx(2.0, abs=0.1)
    model = memory_bound_model()
    assert model.v(1, 4) == pytest.approx(1.57)
    assert model.r("draft_model", 1) == pytest.approx(0.06)
    assert model.speedup("draft_model", 4, 1, 0.85) == pytest.approx(predicted_speedup(0.85, 4, 0.06, 1.57))
    # verify cost between calibrated token counts is linear in tokens
    assert model.v(1, 2) == pytest.approx(1 + 0.57 * 2 / 4)


def test_alpha_inversion_roundtrips() -> None:
    for alpha in (0.1, 0.5, 0.8, 0.97):
        for gamma in (1, 3, 6):
            mean = expected_tokens_per_round(alpha, gamma) - 1
            assert alpha_from_mean_accepted(mean, gamma) == pytest.approx(alpha, abs=1e-6)
    assert alpha_from_mean_accepted(0, 4) == 0.0
    assert alpha_from_mean_accepted(4, 4) == 1.0


def test_toggle_speculates_at_small_batch_and_not_at_large() -> None:
    model = memory_bound_model()
    on = toggle(model, 1, {"draft_model": 0.85}, range(1, 9))
    assert on.method == "draft_model" and on.gamma >= 3
    assert toggle(model, 16, {"draft_model": 0.3}, range(1, 9)) == AR
    assert toggle(model, 64, {"draft_model": 0.85}, range(1, 9)) == AR
    # low acceptance: never worth it, even at batch 1
    assert toggle(model, 1, {"draft_model": 0.05}, range(1, 9)) == AR
    # the margin matters: a predicted 1.03× gain is not taken with a 5% margin
    flat = CostModel(target_step={1: 1.0}, verify_step={1: {1: 1.0, 2: 1.0}}, draft_step={"ngram": {1: 0.0}})
    alpha = 0.03  # L(γ=1) = 1.03
    assert toggle(flat, 1, {"ngram": alpha}, [1], margin=0.05) == AR
    assert toggle(flat, 1, {"ngram": alpha}, [1], margin=0.0) == Decision("ngram", 1)
    crossover = model.crossover_batch_size("draft_model", 4, 0.8, margin=0.05)
    assert 1 <= crossover < 64


def test_draft_length_grows_with_acceptance() -> None:
    model = memory_bound_model()
    gammas = range(1, 11)
    chosen = [model.best_gamma("draft_model", 1, a, gammas)[0] for a in (0.5, 0.7, 0.85, 0.95)]
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    _, s = model.best_gamma("draft_model", 1, 0.85, gammas)
    assert all(model.speedup("draft_model", k, 1, 0.85) <= s + 1e-12 for k in gammas)


def test_acceptance_tracker_mle_and_ewma() -> None:
    # γ=4: sequence accepts 4 (tried 4), 1 (tried 2), 0 (tried 1) -> α = 5/7
    assert AcceptanceTracker.round_alpha([4, 1, 0], 4, 3) == pytest.approx(5 / 7)
    tracker = AcceptanceTracker(prior=0.5, decay=0.5)
    assert tracker.alpha("ngram") == 0.5
    tracker.update("ngram", 4, [4, 4], 2)
    assert tracker.alpha("ngram") == 1.0  # first observation replaces the prior
    tracker.update("ngram", 4, [0, 0], 2)
    assert tracker.alpha("ngram") == pytest.approx(0.5)
    # a total count is inverted through E[n]
    rng = random.Random(0)
    alpha, gamma, batch = 0.7, 4, 4000
    counts = []
    for _ in range(batch):
        n = 0
        while n < gamma and rng.random() < alpha:
            n += 1
        counts.append(n)
    assert AcceptanceTracker.round_alpha(counts, gamma, batch) == pytest.approx(alpha, abs=0.02)
    assert AcceptanceTracker.round_alpha(sum(counts), gamma, batch) == pytest.approx(alpha, abs=0.02)


def test_buckets() -> None:
    assert [bucket_of(b, [1, 2, 5, 21]) for b in (1, 2, 3, 4, 5, 20, 21, 500)] == [0, 1, 1, 1, 2, 2, 3, 3]
    bandit = BucketedEpsilonGreedy([AR], thresholds=[1, 2, 5, 21])
    assert [bandit.bucket_label(i) for i in range(4)] == ["1", "2-4", "5-20", "21+"]
    with pytest.raises(ValueError, match="thresholds"):
        BucketedEpsilonGreedy([AR], thresholds=[2, 5])
    with pytest.raises(ValueError, match="batch"):
        bucket_of(0, [1, 2])


def test_bandit_exploits_the_best_arm_and_explores() -> None:
    arms = [AR, Decision("ngram", 2), Decision("draft_model", 4)]
    truth = {AR: 1.0, arms[1]: 1.2, arms[2]: 1.6}
    bandit = BucketedEpsilonGreedy(arms, epsilon=0.1, window=50, seed=1)
    rng = random.Random(2)
    picks: Counter[Decision] = Counter()
    explored = 0
    for _ in range(2000):
        arm, exp = bandit.choose(1)
        picks[arm] += 1
        explored += exp
        bandit.update(1, arm, truth[arm] + rng.gauss(0, 0.1))
    assert picks[arms[2]] / 2000 > 0.85
    assert all(picks[a] > 3 for a in arms)  # every arm keeps being explored (clear losers rarely)
    assert 0.06 < explored / 2000 < 0.14


def test_bandit_learns_per_bucket() -> None:
    arms = [AR, Decision("draft_model", 4)]
    bandit = BucketedEpsilonGreedy(arms, epsilon=0.1, window=30, seed=3)
    truth = {(0, AR): 1.0, (0, arms[1]): 1.8, (3, AR): 1.0, (3, arms[1]): 0.7}
    for _ in range(600):
        for batch in (1, 32):
            arm, _ = bandit.choose(batch)
            bandit.update(batch, arm, truth[(bandit.bucket(batch), arm)])
    greedy = BucketedEpsilonGreedy(arms, epsilon=0.0)
    greedy._rewards, greedy._medians = bandit._rewards, bandit._medians  # same measurements, no exploration
    assert greedy.choose(1)[0] == arms[1]
    assert greedy.choose(32)[0] == AR


def test_median_resists_outliers() -> None:
    bandit = BucketedEpsilonGreedy([AR, Decision("ngram", 2)], epsilon=0.0, window=5)
    for value in (1.0, 1.0, 1.0, 1.0, 50.0):  # one stalled-clock outlier
        bandit.update(1, AR, value)
    for _ in range(5):
        bandit.update(1, Decision("ngram", 2), 1.3)
    assert bandit.choose(1)[0] == Decision("ngram", 2)


def record(d: Decision, batch: int, accepted: int, seconds: float) -> StepRecord:
    drafted = d.gamma * batch if d.method else 0
    return StepRecord(step=0, method=d.method, gamma=d.gamma, batch_size=batch, draft_tokens=drafted,
                      accepted_tokens=accepted, emitted_tokens=batch + accepted, seconds=seconds,
                      draft_seconds=0.0, target_seconds=seconds)


def _simulate(controller: AdaptiveController, truth: dict[tuple[int, Decision], float], batch: int,
              steps: int, t_ar: float) -> float:
    """Drive the controller on a simulated machine; return tokens/s achieved."""
    rng = random.Random(7)
    tokens = 0.0
    seconds = 0.0
    for _ in range(steps):
        d = controller.decide(batch)
        speed = truth.get((batch, d), 0.5)
        # emitted tokens per sequence and step time consistent with `speed` (relative goodput)
        per_seq = 1 + (d.gamma * 0.6 if d.method else 0)
        step = per_seq * t_ar / speed * (1 + rng.gauss(0, 0.03))
        accepted = round((per_seq - 1) * batch)
        controller.observe(d, record(d, batch, accepted, step))
        tokens += per_seq * batch
        seconds += step
    return tokens / seconds


def test_controller_stays_within_five_percent_of_the_best_arm() -> None:
    model = memory_bound_model()
    arms = [AR, Decision("draft_model", 2), Decision("draft_model", 4), Decision("draft_model", 6)]
    # measured truth disagrees with the model at batch 16 (SD still wins a little) and at batch 1 (γ=6 best)
    truth = {(1, AR): 1.0, (1, arms[1]): 1.4, (1, arms[2]): 1.7, (1, arms[3]): 1.9,
             (16, AR): 1.0, (16, arms[1]): 1.1, (16, arms[2]): 0.9, (16, arms[3]): 0.7}
    for batch in (1, 16):
        ctrl = AdaptiveController(["draft_model"], cost_model=model,
                                  settings=AdaptiveSettings(epsilon=0.05, window=50, seed=batch))
        achieved = _simulate(ctrl, truth, batch, 3000, model.t_ar(batch))
        best = max(v for (b, _), v in truth.items() if b == batch) * batch / model.t_ar(batch)
        assert achieved >= 0.95 * best * 0.97, (batch, achieved / best, ctrl.stats())


def test_controller_cold_start_follows_the_cost_model_and_reports_stats() -> None:
    from specrl.runtime.metrics import RuntimeMetrics

    metrics = RuntimeMetrics(job="j", namespace="n", role="rollout", worker="j-rollout-0")
    model = memory_bound_model()
    ctrl = AdaptiveController(["draft_model"], cost_model=model, metrics=metrics,
                              settings=AdaptiveSettings(epsilon=0.0), alpha_priors={"draft_model": 0.85})
    d1 = ctrl.decide(1)
    assert d1.method == "draft_model"
    assert metrics.spec_decode_enabled._value.get() == 1
    assert metrics.spec_decode_draft_length._value.get() == d1.gamma
    d64 = ctrl.decide(64)
    assert d64 == AR
    assert metrics.spec_decode_enabled._value.get() == 0
    stats = ctrl.stats()
    assert stats["decisions_by_bucket"] == {"1": {label(d1): 1}, "21+": {"ar": 1}}
    assert stats["sd_share"] == 0.5 and stats["current_gamma"] == 0
    ctrl.observe(d1, record(d1, 2, 2 * d1.gamma, 0.01))  # everything accepted: α moves up
    assert ctrl.stats()["alpha"]["draft_model"] > 0.85


def test_cost_model_mode_and_per_batch_size_table() -> None:
    model = memory_bound_model()
    ctrl = AdaptiveController(["draft_model"], cost_model=model, settings=AdaptiveSettings(strategy=False),
                              alpha_priors={"draft_model": 0.85})
    assert ctrl.decide(1).method == "draft_model"
    assert ctrl.decide(64) == AR
    table = ctrl.per_batch_size_gamma(max_batch=64)
    assert table[0][0] == 1 and table[-1][1] == 64 and table[-1][2] == 0
    assert table[0][2] > 0
    for (_, e0, _), (s1, _, _) in itertools.pairwise(table):
        assert s1 == e0 + 1


def test_no_methods_means_plain_decoding_and_nothing_adaptive_means_fixed() -> None:
    assert AdaptiveController([], cost_model=memory_bound_model()).decide(1) == AR
    ctrl = AdaptiveController(["ngram"], settings=AdaptiveSettings(toggle=False, draft_length=False, strategy=False,
                                                                   gamma=3))
    assert all(ctrl.decide(b) == Decision("ngram", 3) for b in (1, 2, 30))
    # toggle only: on/off by the cost model, γ stays fixed
    ctrl = AdaptiveController(["draft_model"], cost_model=memory_bound_model(), alpha_priors={"draft_model": 0.85},
                              settings=AdaptiveSettings(draft_length=False, strategy=False, gamma=3))
    assert ctrl.decide(1) == Decision("draft_model", 3) and ctrl.decide(64) == AR
    fixed = FixedController(Decision("ngram", 2))
    fixed.observe(fixed.decide(4), record(Decision("ngram", 2), 4, 3, 0.1))
    assert fixed.stats() == {"adaptive": False, "decision": "ngram:2", "steps": 1}


def test_settings_from_the_rljob_section() -> None:
    spec = {"method": "ngram", "numSpeculativeTokens": 6,
            "adaptive": {"maxDraftTokens": 6, "batchSizeBuckets": [1, 4, 16], "epsilon": 0.2, "strategy": False}}
    s = settings_from_spec(spec, margin=0.1)
    assert (s.margin, s.gamma, s.max_gamma, s.buckets, s.epsilon, s.strategy) == (0.1, 6, 6, (1, 4, 16), 0.2, False)
    assert settings_from_spec(None).gamma == 4
    with pytest.raises(ValueError, match="minDraftTokens"):
        settings_from_spec({"adaptive": {"minDraftTokens": 5, "maxDraftTokens": 2}})
    ctrl = controller_from_spec({"method": "ngram", "adaptive": {"epsilon": 0.0}}, methods=["ngram", "draft_model"])
    assert ctrl.methods == ["ngram", "draft_model"] and ctrl.settings.epsilon == 0.0
    assert controller_from_spec({"method": "ngram"}).methods == ["ngram"]


def test_calibrate_from_timers_builds_a_consistent_model() -> None:
    def target(batch: int, tokens: int) -> float:
        return 1e-3 * (1 + 0.02 * batch * tokens)

    model = calibrate_from_timers(target, {"ngram": lambda b: 1e-5}, batch_sizes=(1, 8), verify_tokens=(1, 3),
                                  repeats=2)
    assert model.t_ar(1) == pytest.approx(1.02e-3)
    assert model.v(8, 2) == pytest.approx(target(8, 3) / target(8, 1))
    assert model.r("ngram", 1) == pytest.approx(1e-5 / 1.02e-3)
    again = CostModel.from_dict(model.to_dict())
    assert again.v(4, 4) == pytest.approx(model.v(4, 4))
    assert math.isfinite(again.speedup("ngram", 3, 3, 0.5))


def test_exploration_concentrates_on_contenders() -> None:
    arms = [AR, Decision("ngram", 2), Decision("draft_model", 4), Decision("quantized_self", 6)]
    truth = {AR: 1.0, arms[1]: 0.5, arms[2]: 1.6, arms[3]: 1.5}
    bandit = BucketedEpsilonGreedy(arms, epsilon=0.2, window=50, seed=5)
    picks: Counter[Decision] = Counter()
    for i in range(3000):
        arm, explored = bandit.choose(1)
        if i > 500 and explored:
            picks[arm] += 1
        bandit.update(1, arm, truth[arm])
    # the clearly worse arms (0.5, 1.0 vs best 1.6) are explored far less than the close contender (1.5)
    assert picks[arms[3]] > 4 * picks[arms[1]] and picks[arms[3]] > 4 * picks[AR]
    assert picks[arms[1]] > 0  # but never forgotten


def test_ar_cost_fit_is_monotone_under_noise() -> None:
    from specrl.runtime.engine.adaptive import ArCostFit

    # calibration noise made b=4 look slower than b=16; the fitted line stays increasing and near the truth
    fit = ArCostFit({1: 1.4e-3, 2: 3.5e-3, 4: 12.8e-3, 8: 16.7e-3, 16: 10.2e-3})
    seconds = [fit.seconds(b) for b in (1, 2, 4, 8, 16)]
    assert seconds == sorted(seconds) and all(s > 0 for s in seconds)
    rng = random.Random(0)
    for _ in range(400):  # measured AR steps (true cost 2 ms + 0.5 ms per sequence, plus contention spikes)
        b = rng.choice([1, 4, 16])
        fit.add(b, (2e-3 + 0.5e-3 * b) * (1 + (5 * rng.random() if rng.random() < 0.3 else 0.05 * rng.random())))
    assert fit.seconds(16) == pytest.approx(10e-3, rel=0.2)
    assert fit.seconds(1) == pytest.approx(2.5e-3, rel=0.3)


def test_exact_batch_size_statistics_refine_the_bucket() -> None:
    # bucket 5-20 holds b=6 (speculation wins) and b=20 (plain decoding wins)
    arms = [AR, Decision("draft_model", 4)]
    truth = {(6, AR): 1.0, (6, arms[1]): 1.5, (20, AR): 1.0, (20, arms[1]): 0.7}
    bandit = BucketedEpsilonGreedy(arms, epsilon=0.2, window=100, seed=4)
    for i in range(1500):
        batch = 6 if i % 4 else 20  # most steps at b=6: the pooled bucket statistic favours speculation
        arm, _ = bandit.choose(batch)
        bandit.update(batch, arm, truth[(batch, arm)])
    bandit.epsilon = 0.0
    assert bandit.choose(6)[0] == arms[1]
    assert bandit.choose(20)[0] == AR


def test_cpu_clock_restamps_step_seconds() -> None:
    from specrl.runtime.engine.adaptive import StepClock

    clock = StepClock("cpu")
    clock.start()
    sum(i * i for i in range(200_000))  # burn some CPU
    rec = clock.restamp(record(Decision("ngram", 2), 4, 2, seconds=100.0))
    assert 0 < rec.seconds < 5.0 and rec.draft_seconds == 0.0
    assert StepClock("wall").restamp(record(AR, 4, 0, 1.5)).seconds == 1.5
    with pytest.raises(ValueError, match="clock"):
        AdaptiveSettings(clock="sundial")


# -- switching costs: a proposer with its own KV cache catches up on the tokens it missed, in its first step


def test_switch_steps_are_not_scored() -> None:
    ctrl = AdaptiveController(["draft_model", "quantized_self"], settings=AdaptiveSettings(epsilon=0.0))
    d, q = Decision("draft_model", 4), Decision("quantized_self", 4)
    ctrl.observe(d, record(d, 1, 3, 0.05))  # AR -> draft_model: the catch-up step
    assert ctrl.bandit.samples(0, d) == 0
    ctrl.observe(d, record(d, 1, 3, 0.01))  # steady state
    ctrl.observe(q, record(q, 1, 3, 0.05))  # draft_model -> quantized_self: catch-up again
    ctrl.observe(d, record(d, 1, 3, 0.05))  # and back
    assert ctrl.bandit.samples(0, d) == 1 and ctrl.bandit.samples(0, q) == 0
    ctrl.observe(AR, record(AR, 1, 0, 0.01))  # plain decoding has nothing to catch up on: always scored
    assert ctrl.bandit.samples(0, AR) == 1


def test_exploration_runs_in_bursts_on_one_arm() -> None:
    ctrl = AdaptiveController(["draft_model", "ngram"], settings=AdaptiveSettings(epsilon=0.6, explore_run=3, seed=3))
    assert ctrl.bandit.epsilon == pytest.approx(0.2)  # as many exploratory steps, a third of the bursts
    starts: list[int] = []
    choose = ctrl.bandit.choose

    def spy(*args, **kwargs):
        arm, explored = choose(*args, **kwargs)
        if explored:
            starts.append(len(picks))
        return arm, explored

    ctrl.bandit.choose = spy
    picks = []
    for _ in range(200):
        picks.append(ctrl.decide(1))
    assert starts
    for i in starts:
        if i + 2 < len(picks):
            assert picks[i] == picks[i + 1] == picks[i + 2], (i, picks[i:i + 3])
        assert i + 1 not in starts and i + 2 not in starts  # the bandit is not asked during a burst


def test_epsilon_decays_per_bucket_to_a_floor() -> None:
    bandit = BucketedEpsilonGreedy([AR, Decision("ngram", 2)], epsilon=0.3, decay_steps=100, seed=1)
    assert bandit.epsilon_at(0) == pytest.approx(0.3)
    for _ in range(300):
        bandit.choose(1)
    assert bandit.epsilon_at(0) == pytest.approx(0.3 * math.sqrt(100 / 400))
    assert bandit.epsilon_at(bandit.bucket(64)) == pytest.approx(0.3)  # another bucket starts afresh
    for _ in range(100_000):
        bandit.choose(1)
    assert bandit.epsilon_at(0) == pytest.approx(0.3 * 0.25)  # never stops exploring: the drafter keeps training


def test_an_unlucky_first_sample_does_not_bury_a_predicted_winner() -> None:
    good, other = Decision("draft_model", 4), Decision("quantized_self", 6)
    bandit = BucketedEpsilonGreedy([AR, good, other], epsilon=1.0, seed=2)
    for _ in range(20):
        bandit.update(1, other, 1.4)
    bandit.update(1, good, 0.4)  # a load spike: 0.4 < half of 1.4
    prior = {AR: 1.0, good: 1.8, other: 1.3}
    explored = Counter(bandit.choose(1, prior.__getitem__)[0] for _ in range(300))
    assert explored[good] > 60, explored  # still among the contenders until it has min_samples measurements


def test_incumbent_proposer_is_kept_within_the_switch_margin() -> None:
    d, q = Decision("draft_model", 4), Decision("quantized_self", 4)
    bandit = BucketedEpsilonGreedy([AR, d, q], epsilon=0.0)
    for _ in range(5):
        bandit.update(1, AR, 1.0)
        bandit.update(1, d, 1.50)
        bandit.update(1, q, 1.55)
    assert bandit.choose(1)[0] == q
    assert bandit.choose(1, incumbent="draft_model", switch_margin=0.05)[0] == d
    assert bandit.choose(1, incumbent="draft_model", switch_margin=0.01)[0] == q


def test_controller_with_switching_costs_stays_near_the_best_proposer() -> None:
    """Two proposers a few percent apart, each paying 3 plain steps of catch-up when switched to: the controller
    must not flap between them (and keep exploring) and still reach 95% of the best fixed arm's goodput."""
    model = memory_bound_model()
    model.draft_step["quantized_self"] = dict(model.draft_step["draft_model"])
    t_ar = model.t_ar(4)
    truth = {AR: 1.0, Decision("draft_model", 2): 1.45, Decision("draft_model", 4): 1.62,
             Decision("draft_model", 6): 1.55, Decision("quantized_self", 2): 1.4, Decision("quantized_self", 4): 1.58,
             Decision("quantized_self", 6): 1.5}
    ctrl = AdaptiveController(["draft_model", "quantized_self"], cost_model=model,
                              settings=AdaptiveSettings(seed=11))
    rng = random.Random(3)
    tokens = seconds = 0.0
    last = None
    for _ in range(3000):
        d = ctrl.decide(4)
        method = d.method if d.method else None
        per_seq = 1 + (d.gamma * 0.6 if d.method else 0)
        step = per_seq * t_ar / truth[d] * (1 + rng.gauss(0, 0.05))
        if method is not None and method != last:
            step += 3 * t_ar  # catch-up on the tokens this proposer did not see
        last = method
        ctrl.observe(d, record(d, 4, round((per_seq - 1) * 4), step))
        tokens += per_seq * 4
        seconds += step
    best = max(truth.values()) * 4 / t_ar
    assert tokens / seconds >= 0.95 * best, (tokens / seconds / best, ctrl.stats())


def test_measured_catch_up_cost_weighs_the_next_switch() -> None:
    model = memory_bound_model()
    model.draft_step["quantized_self"] = dict(model.draft_step["draft_model"])
    d, q = Decision("draft_model", 4), Decision("quantized_self", 4)
    ctrl = AdaptiveController(["draft_model", "quantized_self"], cost_model=model,
                              settings=AdaptiveSettings(epsilon=0.0, switch_horizon=16, switch_margin=0.0,
                                                        draft_length=False, gamma=4))
    t = model.t_ar(1)
    # steady state: quantized_self a little better than draft_model (1.7 vs 1.6 relative goodput)
    for arm, rel in ((q, 1.7), (d, 1.6)):
        for _ in range(10):
            ctrl.observe(arm, record(arm, 1, 3, 4 * t / rel))
    assert ctrl.decide(1) == q  # no catch-up measured yet: the better proposer wins
    # Switches to quantized_self that cost 8 plain steps of catch-up: 8/16 = 0.5 of relative goodput per step.
    for _ in range(3):
        ctrl.observe(q, record(q, 1, 3, 4 * t / 1.7 + 8 * t))
        ctrl.observe(d, record(d, 1, 3, 4 * t / 1.6))
    # (in units of the fitted plain step at batch 1, a few percent off the calibrated point)
    assert ctrl._switch_penalty("quantized_self") == pytest.approx(0.5, rel=0.1)
    ctrl.observe(d, record(d, 1, 3, 4 * t / 1.6))  # back on draft_model (its own switch step, cheap)
    for _ in range(5):
        ctrl.observe(d, record(d, 1, 3, 4 * t / 1.6))
    assert ctrl.decide(1) == d  # 0.1 better does not repay 0.5 per step

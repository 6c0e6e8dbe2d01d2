"""Adaptive speculation: the cost-model math and the argmax policy (hysteresis, probes, running estimates)."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from specrl.runtime.engine.adaptive import (
    AR,
    AdaptiveController,
    AdaptiveSettings,
    CostModel,
    alpha_from_mean_accepted,
    controller_from_spec,
    expected_tokens_per_round,
    is_speculative,
    label,
    predicted_speedup,
    round_alpha_from_record,
    settings_from_spec,
)
from specrl.runtime.engine.control import Decision, FixedController, StepClock, StepRecord, retimed
from specrl.runtime.engine.cost_model import round_lengths


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


def test_round_lengths_per_position() -> None:
    # one α, or the same α at every position: the geometric sum
    assert round_lengths(0.8, (0, 3)) == pytest.approx({0: 1.0, 3: expected_tokens_per_round(0.8, 3)})
    assert round_lengths([0.8], (2, 5)) == pytest.approx(round_lengths(0.8, (2, 5)))
    # later positions accepted less often: each round's expected length is 1 + Σ of the survival products
    assert round_lengths([0.9, 0.9, 0.5], (1, 2, 3, 4)) == pytest.approx(
        {1: 1.9, 2: 2.71, 3: 2.71 + 0.405, 4: 2.71 + 0.405 + 0.2025})
    for bad in ([], [0.5, 1.2]):
        with pytest.raises(ValueError, match="acceptance"):
            round_lengths(bad, (2,))


def test_draft_length_follows_acceptance_per_position() -> None:
    # The first three drafts are accepted 95% of the time, later ones 30%: the pooled α (~0.8) makes the geometric
    # law draft 8 tokens; acceptance per position finds the true best draft length (4 on this machine) and runs at
    # the best fixed option's speed.
    truth = [0.95, 0.95, 0.95, 0.3]
    machine = Machine({"draft_model": truth}, {"draft_model": 0.03}, c=0.02, seed=11)
    model = calibrated(machine, ["draft_model"])
    ctrl = AdaptiveController(["draft_model"], cost_model=model, alpha_priors={"draft_model": 0.9},
                              settings=AdaptiveSettings())
    best = model.best_gamma("draft_model", 1, truth, ctrl.settings.gammas())[0]
    achieved = drive(ctrl, machine, 1, 1500)
    assert ctrl.choose(1) == Decision("draft_model", best) and best == 4, ctrl.stats()
    assert ctrl.stats()["acceptance_by_position"]["draft_model"][:4] == pytest.approx(truth, abs=0.1)
    assert ctrl.costs is not None
    assert ctrl.costs.best_gamma("draft_model", 1, ctrl.alpha["draft_model"], ctrl.settings.gammas())[0] >= 7
    assert achieved >= 0.95 * machine.best_fixed(1, 1500), ctrl.stats()


def test_one_rejected_round_does_not_zero_a_proposers_acceptance() -> None:
    # The draft model's first round at batch 1 rejected its first draft (1 position tested, 0 accepted). Its
    # acceptance per position must stay near the calibrated α (here 0.88 shrunk by one token of evidence), not
    # fall to 0: at 0 the draft model looked like 0.73x plain decoding at batch 1, no probe could win, and the
    # policy decoded plainly there for the rest of the run (measured with two intra-op threads: 0.44-0.54x the
    # wall-clock rate of draft_model γ=4).
    model = memory_bound_model()
    ctrl = AdaptiveController(["draft_model"], cost_model=model, alpha_priors={"draft_model": 0.88},
                              settings=AdaptiveSettings(probe=0.0))
    d = Decision("draft_model", 5)
    ctrl.observe(d, record(d, 1, 0, 8e-3, 0.4e-3, tried=1, tested_at=(1, 0, 0, 0, 0), accepted_at=(0,) * 5))
    acceptance = ctrl.acceptance("draft_model")
    assert isinstance(acceptance, list) and min(acceptance) > 0.8, acceptance
    assert ctrl.decide(1).method == "draft_model"
    # evidence still moves the shape: position 1 rejected every time (2000 rounds), the later ones never tested
    for _ in range(2000):
        ctrl.observe(d, record(d, 1, 0, 8e-3, 0.4e-3, tried=1, tested_at=(1, 0, 0, 0, 0), accepted_at=(0,) * 5))
    acceptance = ctrl.acceptance("draft_model")
    assert isinstance(acceptance, list) and acceptance[0] < 0.05
    # the held argmax stands until its table's refresh (acceptance is read there, not at every step)
    assert [ctrl.decide(1) for _ in range(ctrl.settings.refresh)][-1] == AR


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


def policy(methods: list[str], model: CostModel | None, alpha: float = 0.85, **settings) -> AdaptiveController:
    return AdaptiveController(methods, cost_model=model, alpha_priors={m: alpha for m in methods},
                              settings=AdaptiveSettings(probe=0.0, **settings))


def test_argmax_speculates_at_small_batch_and_not_at_large() -> None:
    model = memory_bound_model()
    on = policy(["draft_model"], model).decide(1)
    assert on.method == "draft_model" and on.gamma >= 3
    assert policy(["draft_model"], model, alpha=0.3).decide(16) == AR
    assert policy(["draft_model"], model).decide(64) == AR
    assert policy(["draft_model"], model, alpha=0.05).decide(1) == AR  # low acceptance: never worth it
    # hysteresis: a predicted 3% gain does not leave plain decoding; with no hysteresis it does
    flat = CostModel(target_step={1: 1.0}, verify_step={1: {1: 1.0, 2: 1.0}}, draft_step={"ngram": {1: 0.0}})
    assert policy(["ngram"], flat, alpha=0.03, max_gamma=1, gamma=1).decide(1) == AR
    assert policy(["ngram"], flat, alpha=0.03, max_gamma=1, gamma=1, hysteresis=0.0).decide(1) == Decision("ngram", 1)


def test_falling_back_to_plain_decoding_is_not_held_back() -> None:
    # n-gram at γ=1 (acceptance 0.2): 1.2x plain at batch 1; at batch 2 verifying 2 tokens costs 1.22 plain steps,
    # 0.98x plain. Entering speculation needs the 5% margin; leaving it for plain decoding does not (it has nothing
    # to catch up), else the incumbent would cost 2% on every step at batch 2.
    costs = CostModel(target_step={1: 1.0, 2: 1.0}, verify_step={1: {1: 1.0, 2: 1.0}, 2: {1: 1.0, 2: 1.2245}},
                      draft_step={"ngram": {1: 0.0, 2: 0.0}})
    ctrl = policy(["ngram"], costs, alpha=0.2, max_gamma=1, gamma=1)
    assert ctrl.decide(1) == Decision("ngram", 1)
    assert ctrl.table(2)["ngram"][0] == pytest.approx(0.98, abs=1e-3)
    assert ctrl.decide(2) == AR
    assert ctrl.decide(1) == Decision("ngram", 1)


def test_a_near_tie_decodes_plainly_even_after_speculation() -> None:
    # Predicted 1.01x plain at batch 16 (a speculative incumbent from the tail before): within the margin, plain
    # decoding runs; predicted 1.05x: speculation runs, and the margin is a setting.
    costs = CostModel(target_step={1: 1.0, 16: 1.0}, verify_step={1: {1: 1.0, 2: 1.0}, 16: {1: 1.0, 2: 1.8}},
                      draft_step={"draft_model": {1: 0.02, 16: 0.02}})
    ctrl = policy(["draft_model"], costs, alpha=0.84, max_gamma=1, gamma=1)
    assert ctrl.decide(1) == Decision("draft_model", 1)
    assert ctrl.table(16)["draft_model"][0] == pytest.approx(1.84 / 1.82)
    assert ctrl.decide(16) == AR
    assert ctrl.per_batch_size_gamma(16) == [[1, 15, 1], [16, 16, 0]]
    assert policy(["draft_model"], costs, alpha=0.84, max_gamma=1, gamma=1, margin=0.0, hysteresis=0.0).decide(16).method \
        == "draft_model"
    faster = CostModel(target_step={16: 1.0}, verify_step={16: {1: 1.0, 2: 1.73}},
                       draft_step={"draft_model": {16: 0.02}})
    assert policy(["draft_model"], faster, alpha=0.84, max_gamma=1, gamma=1, hysteresis=0.0).decide(16).method \
        == "draft_model"
    with pytest.raises(ValueError, match="margin"):
        AdaptiveSettings(margin=-0.1)


def test_draft_length_grows_with_acceptance() -> None:
    model = memory_bound_model()
    gammas = range(1, 11)
    chosen = [model.best_gamma("draft_model", 1, a, gammas)[0] for a in (0.5, 0.7, 0.85, 0.95)]
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    _, s = model.best_gamma("draft_model", 1, 0.85, gammas)
    assert all(model.speedup("draft_model", k, 1, 0.85) <= s + 1e-12 for k in gammas)


def record(d: Decision, batch: int, accepted: int, seconds: float, draft_seconds: float = 0.0,
           tried: int = 0, tested_at: tuple[int, ...] = (), accepted_at: tuple[int, ...] = ()) -> StepRecord:
    drafted = d.gamma * batch if d.method else 0
    return StepRecord(step=0, method=d.method, gamma=d.gamma, batch_size=batch, draft_tokens=drafted,
                      accepted_tokens=accepted, emitted_tokens=batch + accepted, seconds=seconds,
                      draft_seconds=draft_seconds, target_seconds=seconds - draft_seconds, tried_tokens=tried,
                      tested_at=tested_at, accepted_at=accepted_at)


class Machine:
    """A simulated machine: plain step t(b) = t0 + t1*b, verify of k tokens t(b)*(1 + c*(k-1)*b), draft steps
    cost r*t(b) per token, acceptance alpha per proposer (one for every draft position, or one per position, the
    last for the rest), catch-up of `catch_up` plain steps on a switch."""

    def __init__(self, alpha: dict[str, Any], r: dict[str, float], c: float = 0.03, catch_up: float = 0.0,
                 seed: int = 0) -> None:
        self.alpha, self.r, self.c, self.catch_up = alpha, r, c, catch_up
        self.seed = seed
        self.rng = random.Random(seed)
        self.last: str | None = None

    def t(self, b: int) -> float:
        return 2e-3 + 0.5e-3 * b

    def step(self, d: Decision, b: int) -> StepRecord:
        noise = 1 + abs(self.rng.gauss(0, 0.05))
        if d.method is None:
            self.last = None
            return record(d, b, 0, self.t(b) * noise)
        alpha = self.alpha[d.method]
        per_position = [alpha] * d.gamma if isinstance(alpha, float) else \
            [alpha[min(j, len(alpha) - 1)] for j in range(d.gamma)]
        tested, accepted = [0] * d.gamma, [0] * d.gamma
        for _ in range(b):
            n = 0
            while n < d.gamma and self.rng.random() < per_position[n]:
                accepted[n] += 1
                n += 1
            for j in range(min(n + 1, d.gamma)):
                tested[j] += 1
        acc, tried = sum(accepted), sum(tested)
        draft = d.gamma * self.r[d.method] * self.t(b) * noise
        if d.method != self.last:
            draft += self.catch_up * self.t(b)
        self.last = d.method
        verify = self.t(b) * (1 + self.c * d.gamma * b) * noise
        return record(d, b, acc, draft + verify, draft, tried, tuple(tested), tuple(accepted))

    def best_fixed(self, b: int, steps: int) -> float:
        """Tokens/s of the best fixed option at batch b on a fresh copy of this machine (same noise)."""
        best = 0.0
        for m in (None, *self.alpha):
            for g in (range(1, 9) if m else [0]):
                twin = Machine(self.alpha, self.r, self.c, self.catch_up, self.seed)
                best = max(best, drive(FixedController(m, g), twin, b, steps))
        return best


def drive(ctrl: AdaptiveController | FixedController, machine: Machine, batch: int, steps: int) -> float:
    tokens = seconds = 0.0
    for _ in range(steps):
        d = ctrl.decide(batch)
        rec = machine.step(d, batch)
        ctrl.observe(d, rec)
        tokens += rec.emitted_tokens
        seconds += rec.seconds
    return tokens / seconds


def calibrated(machine: Machine, methods: list[str], scale: float = 1.0) -> CostModel:
    """What a start-up calibration would measure, every cost multiplied by `scale` (a wrong calibration)."""
    sizes = (1, 2, 4, 8, 16)
    return CostModel(target_step={b: machine.t(b) * scale for b in sizes},
                     verify_step={b: {k: machine.t(b) * (1 + machine.c * (k - 1) * b) * scale for k in (3, 7)}
                                  for b in sizes},
                     draft_step={m: {b: machine.r[m] * machine.t(b) * scale for b in sizes} for m in methods})


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16])
def test_policy_reaches_the_best_fixed_option_at_every_batch_size(batch: int) -> None:
    machine = Machine({"draft_model": 0.8, "ngram": 0.5}, {"draft_model": 0.08, "ngram": 0.0}, catch_up=2.0,
                      seed=batch)
    ctrl = AdaptiveController(["draft_model", "ngram"], cost_model=calibrated(machine, ["draft_model", "ngram"]),
                              settings=AdaptiveSettings())
    achieved = drive(ctrl, machine, batch, 1500)
    assert achieved >= 0.95 * machine.best_fixed(batch, 1500), (batch, ctrl.stats())


def test_measurements_correct_a_wrong_calibration() -> None:
    # calibration says draft_model is useless (acceptance prior 0.05); the machine says it doubles the speed
    machine = Machine({"draft_model": 0.9}, {"draft_model": 0.05}, seed=3)
    ctrl = AdaptiveController(["draft_model"], cost_model=calibrated(machine, ["draft_model"], scale=1.3),
                              alpha_priors={"draft_model": 0.05}, settings=AdaptiveSettings(probe=0.05))
    assert ctrl.decide(1) == AR
    achieved = drive(ctrl, machine, 1, 2000)
    assert ctrl.stats()["alpha"]["draft_model"] > 0.8  # the probes found out
    assert achieved >= 0.9 * machine.best_fixed(1, 2000), ctrl.stats()


def test_no_probes_at_large_batches() -> None:
    # speculation does not pay at batch 256 on this machine: the argmax keeps plain decoding and no probe of a
    # proposer runs there (each would verify gamma+1 tokens per row); in the tail the probes still come
    machine = Machine({"ngram": 0.2}, {"ngram": 0.0}, seed=6)
    ctrl = AdaptiveController(["ngram"], cost_model=calibrated(machine, ["ngram"]), alpha_priors={"ngram": 0.2},
                              settings=AdaptiveSettings(probe=0.05, probe_max_batch=16))
    big = [ctrl.decide(256) for _ in range(400)]
    assert all(d == AR for d in big), Counter(d.method for d in big)
    small = []
    for _ in range(400):
        d = ctrl.decide(4)
        small.append(d)
        ctrl.observe(d, machine.step(d, 4))
    assert any(d.method == "ngram" for d in small)


def test_without_calibration_it_measures_plain_then_probes_every_proposer() -> None:
    machine = Machine({"draft_model": 0.85, "ngram": 0.3}, {"draft_model": 0.05, "ngram": 0.0}, seed=4)
    ctrl = AdaptiveController(["draft_model", "ngram"], settings=AdaptiveSettings())
    first = []
    for _ in range(40):
        d = ctrl.decide(1)
        first.append(d.method)
        ctrl.observe(d, machine.step(d, 1))
    assert first[0] is None and first[1] == "draft_model" and "ngram" in first
    achieved = drive(ctrl, machine, 1, 1500)
    assert achieved >= 0.95 * machine.best_fixed(1, 1500), ctrl.stats()


def test_hysteresis_keeps_the_incumbent_and_catch_up_steps_are_not_timed_as_drafting() -> None:
    # two proposers within 2% of each other, each paying 3 plain steps of catch-up when switched to
    machine = Machine({"draft_model": 0.8, "quantized_self": 0.8}, {"draft_model": 0.08, "quantized_self": 0.078},
                      catch_up=3.0, seed=5)
    methods = ["draft_model", "quantized_self"]
    ctrl = AdaptiveController(methods, cost_model=calibrated(machine, methods), settings=AdaptiveSettings())
    drive(ctrl, machine, 2, 1000)
    picks: dict[str, int] = {}
    for name, n in ctrl.stats()["decisions_by_batch_size"][2].items():
        picks[name.split(":")[0]] = picks.get(name.split(":")[0], 0) + n
    main = max(picks, key=lambda name: picks[name])
    assert picks[main] > 0.9 * sum(picks.values()), picks  # no flapping
    # the drafting cost of the draft length in use is the steady one, not inflated by the catch-up of switch steps
    assert ctrl.costs is not None
    g = max(ctrl.stats()["decisions_by_batch_size"][2], key=ctrl.stats()["decisions_by_batch_size"][2].get)
    method, gamma = g.split(":")[0], int(g.split(":")[1])
    r = 0.08 if method == "draft_model" else 0.078
    assert ctrl.costs.draft_round[method][2][gamma] == pytest.approx(gamma * r * machine.t(2), rel=0.2)


def driven_with_probes(alpha: dict[str, float], seed: int) -> AdaptiveController:
    """draft_model and n-gram at batch 1 for 1000 steps, 5% probes, priors equal to the machine's acceptance."""
    machine = Machine(alpha, {"draft_model": 0.05, "ngram": 0.0}, seed=seed)
    methods = ["draft_model", "ngram"]
    ctrl = AdaptiveController(methods, cost_model=calibrated(machine, methods), settings=AdaptiveSettings(probe=0.05),
                              alpha_priors=alpha)
    drive(ctrl, machine, 1, 1000)
    return ctrl


def test_probes_refresh_unused_options_at_the_configured_rate() -> None:
    ctrl = driven_with_probes({"draft_model": 0.9, "ngram": 0.2}, seed=6)
    stats = ctrl.stats()
    assert 40 <= stats["probe_steps"] <= 60  # 5% of 1000
    assert {"ar", "draft_model"} <= {k.split(":")[0] for k in stats["decisions_by_batch_size"][1]}
    # n-gram could not win even at acceptance 0.2 + probe_optimism: never probed (each probe would be slow steps)
    assert not any(k.startswith("ngram") for k in stats["decisions_by_batch_size"][1])
    assert ctrl.current.method == "draft_model"


def test_an_option_that_could_win_is_probed() -> None:
    # n-gram is predicted below draft_model (1.7x vs 2.35x plain), but with acceptance 0.25 higher it would be the
    # best: probed, while the argmax stays on draft_model
    ctrl = driven_with_probes({"draft_model": 0.75, "ngram": 0.5}, seed=7)
    assert any(k.startswith("ngram") for k in ctrl.stats()["decisions_by_batch_size"][1])
    assert ctrl.current.method == "draft_model"


def test_alpha_is_estimated_from_step_records() -> None:
    d = Decision("ngram", 4)
    assert round_alpha_from_record(record(d, 2, 8, 0.01)) == 1.0
    assert round_alpha_from_record(record(AR, 2, 0, 0.01)) is None
    half = 8 / math.log(2)  # 8 draft tokens weigh one half
    ctrl = AdaptiveController(["ngram"], alpha_priors={"ngram": 0.5}, settings=AdaptiveSettings(alpha_memory=half))
    ctrl.observe(d, record(d, 2, 8, 0.01))  # totals only: α from inverting E[accepted]
    assert ctrl.alpha["ngram"] == pytest.approx(0.75)
    ctrl = AdaptiveController(["ngram"], alpha_priors={"ngram": 0.9}, settings=AdaptiveSettings(alpha_memory=half))
    for _ in range(30):  # rows accepted 1 of 2 tried: α -> 0.5 whatever the prior
        ctrl.observe(d, record(d, 2, 2, 0.01, tried=4))
    assert ctrl.alpha["ngram"] == pytest.approx(0.5, abs=1e-3)


def test_metrics_stats_and_the_per_batch_size_table() -> None:
    from specrl.runtime.metrics import RuntimeMetrics

    metrics = RuntimeMetrics(job="j", namespace="n", role="rollout", worker="j-rollout-0")
    model = memory_bound_model()
    ctrl = AdaptiveController(["draft_model"], cost_model=model, metrics=metrics,
                              alpha_priors={"draft_model": 0.85}, settings=AdaptiveSettings(probe=0.0))
    d1 = ctrl.decide(1)
    assert d1.method == "draft_model"
    assert metrics.spec_decode_enabled._value.get() == 1
    assert metrics.spec_decode_draft_length._value.get() == d1.gamma
    assert ctrl.decide(64) == AR and metrics.spec_decode_enabled._value.get() == 0
    stats = ctrl.stats()
    assert stats["decisions_by_batch_size"] == {1: {label(d1): 1}, 64: {"ar": 1}}
    assert stats["sd_share"] == 0.5 and stats["current_gamma"] == 0
    table = ctrl.per_batch_size_gamma(max_batch=64)
    assert table[0][0] == 1 and table[0][2] > 0 and table[-1][1] == 64 and table[-1][2] == 0
    for (_, e0, _), (s1, _, _) in itertools.pairwise(table):
        assert s1 == e0 + 1
    # the gauges follow every change of the decision (they are set on a change, not at every step)
    assert ctrl.decide(1) == d1 and metrics.spec_decode_enabled._value.get() == 1
    assert metrics.spec_decode_draft_length._value.get() == d1.gamma


def test_switches_off_what_the_settings_switch_off() -> None:
    assert AdaptiveController([], cost_model=memory_bound_model()).decide(1) == AR
    ctrl = AdaptiveController(["ngram"], settings=AdaptiveSettings(toggle=False, draft_length=False, strategy=False,
                                                                   gamma=3))
    assert all(ctrl.decide(b) == Decision("ngram", 3) for b in (1, 2, 30))
    # toggle only: on/off by the cost model, γ stays fixed
    ctrl = policy(["draft_model"], memory_bound_model(), draft_length=False, gamma=3)
    assert ctrl.decide(1) == Decision("draft_model", 3) and ctrl.decide(64) == AR
    # strategy off: only the first proposer is an option
    assert policy(["ngram", "draft_model"], memory_bound_model(), strategy=False).methods == ["ngram"]
    fixed = FixedController("ngram", 2, clock="wall")
    fixed.observe(fixed.decide(4), record(Decision("ngram", 2), 4, 3, 0.1))
    assert fixed.stats() == {"adaptive": False, "decision": "ngram:2"}
    assert fixed.records is not None and len(fixed.records) == 1
    assert FixedController("none", 4).decision == AR and FixedController("ngram", 2).records is None


def test_settings_from_the_rljob_section() -> None:
    spec = {"method": "ngram", "numSpeculativeTokens": 6,
            "adaptive": {"maxDraftTokens": 6, "epsilon": 0.2, "window": 50, "strategy": False}}
    s = settings_from_spec(spec, hysteresis=0.1)
    assert (s.hysteresis, s.gamma, s.max_gamma, s.probe, s.window, s.strategy) == (0.1, 6, 6, 0.2, 50, False)
    assert settings_from_spec(None).gamma == 4
    with pytest.raises(ValueError, match="minDraftTokens"):
        settings_from_spec({"adaptive": {"minDraftTokens": 5, "maxDraftTokens": 2}})
    ctrl = controller_from_spec({"method": "ngram", "adaptive": {"epsilon": 0.0}}, methods=["ngram", "draft_model"])
    assert ctrl.methods == ["ngram", "draft_model"] and ctrl.settings.probe == 0.0
    assert controller_from_spec({"method": "ngram"}).methods == ["ngram"]


def test_cost_model_roundtrips_and_interpolates() -> None:
    model = memory_bound_model()
    again = CostModel.from_dict(model.to_dict())
    assert again.v(4, 4) == pytest.approx(model.v(4, 4))
    assert model.t_ar(1) < model.t_ar(4) < model.t_ar(16)
    assert model.v(1, 2) < model.v(1, 4) and model.v(1, 4) < model.v(16, 4)
    # a measured batch size reads its own value, bit for bit what the interpolation gives there (it skips sorting
    # the keys), and clamps at the ends
    from specrl.runtime.engine.cost_model import interp_log_batch

    steps = {1: 1.3e-3, 3: 1.7e-3, 4: 2.1e-3, 16: 3.9e-3, 384: 0.031}
    odd = CostModel(target_step=steps, verify_step={})
    for b in (*steps, 2, 5, 12, 17, 200, 500):
        assert odd.t_ar(b) == interp_log_batch(steps, b)
    assert odd.t_ar(3) == 1.7e-3 and odd.t_ar(500) == 0.031


def test_round_seconds_reads_measured_entries_as_round_cost_computes_them() -> None:
    # the policy's per-step surprise check reads a measured option's costs directly; it must equal the interpolating
    # path wherever both apply, and fall back to it where an entry is missing
    model = CostModel(target_step={2: 2e-3, 8: 4e-3}, verify_step={2: {3: 3e-3, 5: 1.5e-3}, 8: {3: 9e-3}},
                      draft_round={"draft_model": {2: {2: 4e-4, 4: 9e-4}, 8: {2: 5e-4}}})
    for b, g in ((2, 2), (2, 4), (8, 2)):
        assert model.round_seconds("draft_model", g, b) == pytest.approx(model.round_cost("draft_model", g, b)
                                                                         * model.plain_step(b))
    # a verification timed below the plain step caps the plain step (the unit) instead of being raised to it
    assert model.plain_step(2) == 1.5e-3 and model.plain_step(8) == 4e-3
    assert model.round_seconds("draft_model", 4, 2) == pytest.approx(9e-4 + 1.5e-3)
    for b, g in ((4, 2), (2, 3), (8, 4)):  # interpolated: no entry at b, γ or γ+1
        assert model.round_seconds("draft_model", g, b) == model.round_cost("draft_model", g, b) * model.plain_step(b)


def test_a_stale_plain_step_leaves_each_draft_length_its_own_cost() -> None:
    # the plain step timed under load (3.6 ms) against verifications of 3 and 4 tokens measured since (2.5, 3.4 ms):
    # clamping each verification up to the plain step made both cost one plain step, and γ=3 won on its longer
    # rounds; capping the plain step at the cheapest verification keeps γ=3's extra cost, and γ=2 wins as it does
    # with a fresh plain step
    def model(t: float) -> CostModel:
        return CostModel(target_step={2: t}, verify_step={2: {1: 2.4e-3, 3: 2.5e-3, 4: 3.4e-3}},
                         draft_round={"draft_model": {2: {2: 3e-4, 3: 4.5e-4}}})

    stale, fresh = model(3.6e-3), model(2.4e-3)
    assert stale.plain_step(2) == 2.5e-3  # the calibration's 1-token entry is the plain step's, not a verification
    assert stale.verify_ratios(2, (2, 3)) == pytest.approx({2: 1.0, 3: 3.4 / 2.5})
    best = [m.best_gamma("draft_model", 2, 0.75, (2, 3))[0] for m in (stale, fresh)]
    assert best == [2, 2]


def test_the_shortest_draft_length_within_a_tie_runs() -> None:
    # The bench's draft model at batch 1 (calibration of the eleventh session's L1): verifying 5..8 tokens costs
    # 1.11..1.48 plain steps and at α = 0.88 γ = 4..7 are predicted within 2% of each other; the plain argmax
    # takes γ=5. The tie takes the shortest of them: where acceptance was overestimated it keeps most of the
    # speed (at 0.80 the longest runs 9% slower than γ=4), where underestimated it gives up little (5% at 0.92).
    t = 2.9e-3
    v = {5: 1.114, 6: 1.235, 7: 1.357, 8: 1.478}
    model = CostModel(target_step={1: t}, verify_step={1: {1: t} | {k: x * t for k, x in v.items()}},
                      draft_round={"draft_model": {1: {g: (0.034 * g + 0.038) * t for g in range(4, 8)}}})
    gammas = range(4, 8)
    speeds = {g: model.speedup("draft_model", g, 1, 0.88) for g in gammas}
    assert max(speeds.values()) / min(speeds.values()) < 1.02
    assert model.best_gamma("draft_model", 1, 0.88, gammas)[0] == 5
    g, s = model.best_gamma("draft_model", 1, 0.88, gammas, tie=0.02)
    assert (g, s) == (4, pytest.approx(speeds[4]))
    assert model.speedup("draft_model", 7, 1, 0.80) < 0.92 * model.speedup("draft_model", 4, 1, 0.80)
    assert model.speedup("draft_model", 7, 1, 0.92) < 1.06 * model.speedup("draft_model", 4, 1, 0.92)
    # a clear optimum is not moved: at α = 0.5 every longer draft is more than 2% slower
    assert model.best_gamma("draft_model", 1, 0.5, gammas, tie=0.02) == model.best_gamma("draft_model", 1, 0.5, gammas)
    # the policy drafts the tie's γ (its setting, `length_tie`), and with no tie the argmax
    for tie, want in ((0.02, 4), (0.0, 5)):
        ctrl = AdaptiveController(["draft_model"], cost_model=model, alpha_priors={"draft_model": 0.88},
                                  settings=AdaptiveSettings(min_gamma=4, max_gamma=7, probe=0.0, length_tie=tie))
        assert ctrl.table(1)["draft_model"][1] == Decision("draft_model", want)
    with pytest.raises(ValueError, match="length_tie"):
        AdaptiveSettings(length_tie=1.0)


def test_cpu_clock_restamps_step_seconds() -> None:
    clock = StepClock("cpu")
    clock.start()
    sum(i * i for i in range(200_000))  # burn some CPU
    rec = clock.restamp(record(Decision("ngram", 2), 4, 2, seconds=100.0))
    assert 0 < rec.seconds < 5.0 and rec.draft_seconds == 0.0
    assert StepClock("wall").restamp(record(AR, 4, 0, 1.5)).seconds == 1.5
    with pytest.raises(ValueError, match="clock"):
        AdaptiveSettings(clock="sundial")


def test_verify_cost_never_extrapolates_below_a_plain_step():
    # the calibration a loaded machine produced (job tiny-local): verifying 5 tokens timed cheaper than 3
    noisy = CostModel(target_step={4: 1.0}, verify_step={4: {3: 4.155, 5: 1.681}}, draft_step={"ngram": {4: 0.0}})
    assert noisy.v(4, 4) == pytest.approx(1.681)
    assert noisy.v(4, 6) == noisy.v(4, 8) == pytest.approx(1.681)  # not 0: the last segment is not extended downhill
    cheap = CostModel(target_step={1: 1.0}, verify_step={1: {5: 0.7}}, draft_step={"ngram": {1: 0.0}})
    assert cheap.v(1, 4) == 1.0


def test_warm_proposers_are_the_running_one_and_the_tail_choice() -> None:
    # The engine prefills only these on admission; the others catch up from the prompt when first run.
    model = memory_bound_model()
    assert AdaptiveController(["draft_model", "ngram"]).warm_proposers(8) == ["draft_model", "ngram"]  # unmeasured
    ctrl = AdaptiveController(["draft_model", "ngram"], cost_model=model, alpha_priors={"draft_model": 0.85,
                              "ngram": 0.2}, settings=AdaptiveSettings(probe=0.0))
    assert ctrl.decide(64) == AR  # plain decoding runs at a full batch; the tail will want the drafter
    assert ctrl.warm_proposers(64) == ["draft_model"]
    # the tail's table as last computed, however old: a server-style batch admits at every finish
    tail = ctrl._tables[1]
    ctrl.steps += 10 * ctrl.settings.refresh
    assert ctrl.warm_proposers(64) == ["draft_model"] and ctrl._tables[1] is tail
    ctrl.alpha["ngram"] = 1.0  # a free drafter accepting everything wins the tail, the one to run stays warm
    ctrl._tables.clear()
    ctrl.current = Decision("draft_model", 4)
    assert ctrl.warm_proposers(1) == ["ngram"]  # at batch 1 the policy switches to n-gram: draft_model not needed
    assert policy(["draft_model", "ngram"], model, toggle=False, draft_length=False,
                  strategy=False).warm_proposers(64) == ["draft_model"]
    assert FixedController(None).warm_proposers(4) == ()
    assert FixedController("ngram", 3).warm_proposers(4) == ("ngram",)


def test_a_costly_tail_drafter_is_not_prefilled_on_every_admission() -> None:
    # quantized_self, a 4-bit copy of the whole policy, drafts a token for ~0.25 plain steps: prefilling it for
    # every admitted prompt would add about that to every admission, for the few rows that reach the tail
    model = memory_bound_model()
    model.draft_step["quantized_self"] = {b: 0.25 * t for b, t in model.target_step.items()}
    ctrl = AdaptiveController(["draft_model", "quantized_self"], cost_model=model,
                              alpha_priors={"draft_model": 0.5, "quantized_self": 0.95},
                              settings=AdaptiveSettings(probe=0.0))
    assert ctrl.table(1)["quantized_self"][0] > ctrl.table(1)["draft_model"][0]  # the tail's choice
    assert ctrl.decide(64) == AR
    assert ctrl.warm_proposers(64) == []
    ctrl.settings.warm_max_draft_cost = 0.3
    assert ctrl.warm_proposers(64) == ["quantized_self"]
    ctrl.settings.warm_max_draft_cost = 0.15
    ctrl.current = Decision("quantized_self", 4)  # what a tail ran: warm only where the policy would run it
    assert ctrl.warm_proposers(1) == ["quantized_self"]
    assert ctrl.warm_proposers(64) == []  # a refilled full batch decodes plainly


def test_a_choice_that_runs_slower_than_predicted_is_left_within_a_few_steps() -> None:
    # The calibration (short sequences) priced quantized_self's drafting at a sixth of what it costs in the workload:
    # the policy picks it, and the measured steps must correct the estimate, and the choice, at once (on the
    # benchmark it ran 23 steps at batch 16 when the calibration counted as three samples and the table waited for
    # its refresh).
    alpha = {"draft_model": 0.8, "quantized_self": 0.97}
    machine = Machine(alpha, {"draft_model": 0.08, "quantized_self": 0.6}, seed=4)
    methods = list(alpha)
    model = calibrated(machine, methods)
    model.draft_step["quantized_self"] = {b: 0.1 * machine.t(b) for b in (1, 2, 4, 8, 16)}
    ctrl = AdaptiveController(methods, cost_model=model, alpha_priors=alpha, settings=AdaptiveSettings(probe=0.0))
    first = ctrl.decide(4)
    assert first.method == "quantized_self"
    ctrl.observe(first, machine.step(first, 4))
    ran: list[str | None] = [first.method]
    for _ in range(19):
        d = ctrl.decide(4)
        ctrl.observe(d, machine.step(d, 4))
        ran.append(d.method)
    assert ran.count("quantized_self") <= 4 and ran[-1] == "draft_model", ran


def fed(ctrl: AdaptiveController, b: int, seconds: Callable[[Decision], float], steps: int,
        draft_seconds: float = 0.02) -> list[Decision]:
    """`steps` decisions at batch b, each observed as a step of `seconds(decision)` seconds (every draft accepted
    with chance 0.84 at γ=1: 1.84 tokens a round)."""
    ran = []
    for i in range(steps):
        d = ctrl.decide(b)
        accepted = round(0.84 * b * (i + 1)) - round(0.84 * b * i) if d.method else 0
        draft = draft_seconds if d.method else 0.0
        ctrl.observe(d, record(d, b, accepted, seconds(d) + draft, draft, tried=b if d.method else 0))
        ran.append(d)
    return ran


def test_old_timings_leave_the_estimate() -> None:
    # Costs move with the rows' context lengths: plain decoding's estimate reads the samples of the last `horizon`
    # steps (at least three), so a cost measured a hundred steps earlier, on other rows, is replaced by three new
    # samples; within the horizon the low quantile over the window still smooths single steps.
    ctrl = policy(["draft_model"], CostModel(target_step={1: 1.0, 4: 1.0}, verify_step={1: {1: 1.0}, 4: {1: 1.0}}))
    for b, n in ((4, 32), (1, 100)):
        for _ in range(n):
            ctrl.observe(AR, record(AR, b, 0, 1.0))
            ctrl.steps += 1
    assert ctrl.costs is not None and ctrl.costs.target_step[4] == 1.0
    for i in range(3):
        ctrl.observe(AR, record(AR, 4, 0, 1.3))
        ctrl.steps += 1
        assert ctrl.costs.target_step[4] == pytest.approx(1.0 if i < 2 else 1.3)
    for _ in range(3):  # within the horizon: three dearer steps among 35 are not the low quantile
        ctrl.observe(AR, record(AR, 1, 0, 1.3))
        ctrl.steps += 1
    assert ctrl.costs.target_step[1] == 1.0
    # a proposer's costs keep their whole window (its few new samples would make it the argmax when lucky)
    dm = Decision("draft_model", 1)
    for seconds, n in ((1.0, 32), (1.3, 3)):
        for _ in range(n):
            ctrl.observe(dm, record(dm, 4, 1, seconds))
            ctrl.steps += 100
    assert ctrl.costs.verify_step[4][2] == 1.0


def test_plain_decoding_is_rechecked_while_speculation_runs_at_a_near_tie() -> None:
    # Batch 16 of a rollout: plain steps measured on long contexts (1.10) make a γ=1 round (1.84 tokens for 1.90)
    # look 1.07x faster on the next rows, where a plain step costs 1.0 and the round is 0.97x plain decoding. One
    # plain step now and then finds it out; where speculation wins by far (1.7x at batch 1 here) the rechecks are
    # rarer: every (1.7 - 1) / 0.005 = 140 steps.
    costs = CostModel(target_step={1: 1.0, 16: 1.1}, verify_step={1: {1: 1.0, 2: 1.05}, 16: {1: 1.1, 2: 1.88}},
                      draft_step={"draft_model": {1: 0.02, 16: 0.02}})
    ctrl = policy(["draft_model"], costs, alpha=0.84, max_gamma=1, gamma=1)
    truth = {1: lambda d: 1.05 if d.method else 1.0, 16: lambda d: 1.88 if d.method else 1.0}
    for b in [16] * 40 + [1]:  # before: plain steps on the long contexts
        ctrl.observe(AR, record(AR, b, 0, 1.1 if b == 16 else 1.0))
        ctrl.steps += 1
    ran = fed(ctrl, 1, truth[1], 200)
    assert ran.count(AR) == 1 and 140 < ran.index(AR) < 150 and ctrl.table(1)["draft_model"][0] > 1.6
    assert ctrl.table(16)["draft_model"][0] == pytest.approx(1.84 / 1.90 * 1.1, rel=0.02)
    first = ctrl.decide(16)
    assert first == AR and ctrl.current == Decision("draft_model", 1)  # the recheck: plain runs, speculation stands
    ctrl.observe(first, record(AR, 16, 0, 1.0))
    ran = fed(ctrl, 16, truth[16], 100)
    # plain decoding within its table's refresh (8 steps), and then in every step but one: the speculation recheck,
    # once nothing has speculated at batch 16 for `horizon` steps (the table is a near tie, not settled)
    assert [d for d in ran[10:] if d != AR] == [Decision("draft_model", 1)], Counter(map(label, ran))
    with pytest.raises(ValueError, match="recheck"):
        AdaptiveSettings(recheck=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_verification_the_calibration_overprices_is_rechecked_where_plain_decoding_runs(seed: int) -> None:
    # The calibration timed its plain steps 25% fast against its verifications (back to back, in warm caches): at
    # batch 4 every verification is priced a third over its cost, and draft_model γ=2 (1.25x plain decoding here)
    # is predicted at 0.93x. Plain steps time only themselves, so nothing the policy chose ever corrected it: it ran
    # at 0.80-0.89x the best fixed configuration. A speculation recheck times a verification at its cost now; from
    # then on the verifications' own level prices every length there.
    machine = Machine({"draft_model": 0.85}, {"draft_model": 0.05}, c=0.12, catch_up=1.0, seed=seed)
    cal = calibrated(machine, ["draft_model"])
    cal.target_step = {b: 0.75 * t for b, t in cal.target_step.items()}
    ctrl = AdaptiveController(["draft_model"], cost_model=cal, alpha_priors={"draft_model": 0.85},
                              settings=AdaptiveSettings())
    assert ctrl.choose(4) == AR  # what the calibration alone says
    achieved = drive(ctrl, machine, 4, 1500)
    assert achieved >= 0.95 * machine.best_fixed(4, 1500), ctrl.stats()
    # plain decoding until the first recheck (`horizon` steps), then in plain rechecks only
    assert ctrl.stats()["decisions_by_batch_size"][4].get("ar", 0) < 0.15 * 1500


def test_verifications_set_their_own_level_where_they_ran() -> None:
    # Where only plain steps ran, a verification moves with them (their cost against the calibration's plain step);
    # once a verification ran there, its own cost against the calibration's does, whatever plain steps measure.
    t = 1e-3
    cal = CostModel(target_step={4: t}, verify_step={4: {3: 2 * t, 5: 3 * t}},
                    draft_round={"draft_model": {4: {2: 0.1 * t, 4: 0.2 * t}}})
    ctrl = AdaptiveController(["draft_model"], cost_model=cal, alpha_priors={"draft_model": 0.8},
                              settings=AdaptiveSettings(probe=0.0, neighbour=0))
    for _ in range(8):
        ctrl.observe(AR, record(AR, 4, 0, 1.3 * t))
    assert ctrl.costs is not None and ctrl.costs.verify_step[4][3] == pytest.approx(2.6 * t)
    d = Decision("draft_model", 2)
    for _ in range(3):
        ctrl.observe(d, record(d, 4, accepted=6, seconds=2.1 * t, draft_seconds=0.1 * t, tried=8))
    for _ in range(8):
        ctrl.observe(AR, record(AR, 4, 0, 1.3 * t))
    costs = ctrl.costs
    assert costs.t_ar(4) == pytest.approx(1.3 * t)
    assert costs.verify_step[4][3] == pytest.approx(2 * t) and costs.verify_step[4][5] == pytest.approx(3 * t)


def test_a_held_choice_defers_its_records_and_loses_none() -> None:
    # Between two computations of the argmax the steps only keep their records (the estimation runs on the next
    # step that computes anything): two controllers fed the same steps, one made to fold after every step by reading
    # its estimates, must end with the same estimates and have made the same choices.
    machine = Machine({"draft_model": 0.8, "ngram": 0.5}, {"draft_model": 0.08, "ngram": 0.0}, seed=11)
    methods = ["draft_model", "ngram"]
    lazy, eager = (AdaptiveController(methods, cost_model=calibrated(machine, methods),
                                      alpha_priors={"draft_model": 0.8, "ngram": 0.5},
                                      settings=AdaptiveSettings(probe=0.0)) for _ in range(2))
    for i in range(300):
        b = 4 if i < 150 else 1
        d = lazy.decide(b)
        assert eager.decide(b) == d
        rec = machine.step(d, b)
        lazy.observe(d, rec)
        eager.observe(d, rec)
        assert eager.alpha is not None  # reading an estimate folds what is pending
        if i == 5:
            assert lazy._pending, "observe folded its record at once"
    assert lazy.alpha == eager.alpha
    assert lazy.costs is not None and eager.costs is not None
    assert lazy.costs.to_dict() == eager.costs.to_dict()
    assert lazy.stats() == eager.stats()


def tables_computed(ctrl: AdaptiveController) -> list[tuple[int, int, int]]:
    """(batch, step, period) of every table `ctrl` computes from now on (not of the ones it reads while they
    stand), appended as they are computed."""
    compute, computed = ctrl._table, []

    def counted(batch: int) -> Any:
        before = ctrl._tables.get(batch)
        table = compute(batch)
        if table is not before:
            computed.append((batch, ctrl.steps, table.period))
        return table

    ctrl._table = counted  # type: ignore[method-assign]
    return computed


def test_a_table_the_recomputations_confirm_stands_longer_and_a_change_still_shows() -> None:
    # Computing a table (and folding the records it reads) cost 2.5% of the decode time at batch 2 when it ran every
    # `refresh` steps: each recomputation that names the leader of the table before it doubles the steps until the
    # next, up to `stable_refresh`. When the drafter's acceptance collapses, its rounds cost what they did (no
    # surprise ends the hold) and the policy sees it at the next table: at most `stable_refresh` steps later than
    # with a table every `refresh` steps.
    first_plain: dict[int, int] = {}
    for stable in (8, 32):
        machine = Machine({"draft_model": 0.85}, {"draft_model": 0.2}, seed=5)
        ctrl = AdaptiveController(["draft_model"], cost_model=calibrated(machine, ["draft_model"]),
                                  alpha_priors={"draft_model": 0.85},
                                  settings=AdaptiveSettings(probe=0.0, neighbour=0, stable_refresh=stable))
        tables = tables_computed(ctrl)
        for _ in range(300):
            d = ctrl.decide(2)
            ctrl.observe(d, machine.step(d, 2))
        assert is_speculative(ctrl.current)
        if stable == 32:
            computed = [period for _, _, period in tables]
            assert set(computed) == {8, 16, 32} and computed[-4:] == [32] * 4 and len(computed) < 300 / 16, computed
        machine.alpha["draft_model"] = 0.0
        ran = []
        for _ in range(300):
            d = ctrl.decide(2)
            ctrl.observe(d, machine.step(d, 2))
            ran.append(d)
        first_plain[stable] = ran.index(AR)
        # plain decoding, but for a speculation recheck once nothing speculated here for `horizon` steps
        assert sum(d != AR for d in ran[-100:]) <= 100 // (ctrl.settings.horizon + 1) + 1, Counter(map(label, ran))
    assert first_plain[32] <= first_plain[8] + 32, first_plain
    with pytest.raises(ValueError, match="stable_refresh"):
        AdaptiveSettings(refresh=16, stable_refresh=8)


def test_a_table_lives_in_the_steps_at_its_batch_size_and_at_most_max_table_age_steps() -> None:
    # A rollout's tail visits most batch sizes for a step or two, dozens of steps apart: counted in all steps, each
    # visit found its table expired and computed one. Here batch 2 runs 30 steps between single steps at batch 9.
    for age, expect in ((512, 1), (64, 3)):
        machine = Machine({"draft_model": 0.85}, {"draft_model": 0.2}, seed=5)
        ctrl = AdaptiveController(["draft_model"], cost_model=calibrated(machine, ["draft_model"]),
                                  alpha_priors={"draft_model": 0.85},
                                  settings=AdaptiveSettings(probe=0.0, neighbour=0, max_table_age=age))
        tables = tables_computed(ctrl)
        for visit in range(7):  # 7 steps at batch 9, under `refresh`
            for _ in range(30):
                d = ctrl.decide(2)
                ctrl.observe(d, machine.step(d, 2))
            d = ctrl.decide(9)
            ctrl.observe(d, machine.step(d, 9))
        computed = [step for batch, step, _ in tables if batch == 9]
        assert len(computed) == expect, computed  # age 64: visits 31 steps apart, every third one computes
    with pytest.raises(ValueError, match="max_table_age"):
        AdaptiveSettings(max_table_age=0)


def hopeless_ngram() -> tuple[Machine, AdaptiveController]:
    """n-gram at α=0.1 where verifying costs like the tiny model's: plain decoding wins at every batch size by more
    than 25 points more acceptance could make up (every table is settled)."""
    machine = Machine({"ngram": 0.1}, {"ngram": 0.1}, c=0.3, seed=3)
    return machine, AdaptiveController(["ngram"], cost_model=calibrated(machine, ["ngram"]),
                                       alpha_priors={"ngram": 0.1}, settings=AdaptiveSettings(probe=0.0))


def test_plain_decoding_carries_through_settled_tables_of_a_shrinking_batch() -> None:
    # tiny-local's rollouts shrink to one row with a new batch size almost every step, and speculation loses at all
    # of them. Once a pass has computed every size's table, the next pass computes nothing: its records wait (one
    # fold later), and each step is counted at its own batch size.
    machine, ctrl = hopeless_ngram()
    sizes = list(range(24, 0, -1))

    def rollout() -> set[Decision]:
        out = set()
        for b in sizes:
            d = ctrl.decide(b)
            ctrl.observe(d, machine.step(d, b))
            out.add(d)
        return out

    assert rollout() == {AR}
    tables = dict(ctrl._tables)
    assert tables and all(t.settled for t in tables.values())
    pending = len(ctrl._pending)
    assert rollout() == {AR}
    assert len(ctrl._pending) == pending + len(sizes)
    assert all(ctrl._tables[k] is t for k, t in tables.items())
    assert ctrl.stats()["decisions_by_batch_size"] == {b: {"ar": 2} for b in sorted(sizes)}


def test_plain_decoding_on_a_settled_table_keeps_one_record_per_visit_and_every_surprise() -> None:
    # Folding every plain step's record was most of what the policy cost tiny-local's rollouts: on a settled table
    # only a visit's first step is kept, unless a step costs `SURPRISE` times its prediction (then it is kept, and
    # the hold ends: the next step folds it and holds anew, keeping its own record).
    machine, ctrl = hopeless_ngram()
    visits = [16, 8, 4, 2, 1]  # the calibrated sizes: no step is a surprise but the one made so
    learned: list[int] = []
    learn = ctrl.estimates.learn

    def counted(rec: StepRecord, step: int) -> float:
        learned.append(rec.batch_size)
        return learn(rec, step)

    ctrl.estimates.learn = counted  # type: ignore[method-assign,assignment]

    def rollout(slow_at: int | None = None) -> list[int]:
        learned.clear()
        for b in visits:
            for i in range(3):
                d = ctrl.decide(b)
                rec = machine.step(d, b)
                ctrl.observe(d, record(AR, b, 0, 3 * rec.seconds) if (b, i) == (slow_at, 1) else rec)
        ctrl._fold()
        return learned

    rollout()
    assert all(t.settled for t in ctrl._tables.values())
    assert rollout() == visits
    assert ctrl.stats()["decisions_by_batch_size"][4] == {"ar": 6}  # every step is still counted
    assert rollout(slow_at=4) == [16, 8, 4, 4, 4, 2, 1]


def test_a_settled_table_settled_again_stands_twice_as_long() -> None:
    # Every settled table of a rollout's batch sizes came due together every `settled_refresh` steps, and the wave
    # of recomputations (each folding what was kept) was a third of the policy's time on tiny-local.
    machine = Machine({"ngram": 0.1}, {"ngram": 0.1}, c=0.3, seed=3)
    ctrl = AdaptiveController(["ngram"], cost_model=calibrated(machine, ["ngram"]), alpha_priors={"ngram": 0.1},
                              settings=AdaptiveSettings(probe=0.0, settled_refresh=8, settled_stable_refresh=32))
    periods: list[tuple[int, int]] = []
    for _ in range(200):
        d = ctrl.decide(4)
        ctrl.observe(d, machine.step(d, 4))
        table = ctrl._tables[4]
        if not periods or table.step != periods[-1][0]:
            periods.append((table.step, table.period))
    assert [p for _, p in periods][:4] == [8, 16, 32, 32] and ctrl._tables[4].settled
    with pytest.raises(ValueError, match="settled_stable_refresh"):
        AdaptiveSettings(settled_refresh=64, settled_stable_refresh=32)


def test_a_shrinking_batch_leaves_settled_tables_for_speculation_where_it_pays() -> None:
    # Plain decoding carried through the settled tables of large batches stops where a table is not settled: the
    # tail speculates as a controller that folds and recomputes at every step decides. (The tail's speculative
    # steps then drop the settled tables: each rollout settles them again.)
    machine = Machine({"draft_model": 0.8}, {"draft_model": 0.05}, c=0.1, seed=5)
    lazy, eager = (AdaptiveController(["draft_model"], cost_model=calibrated(machine, ["draft_model"]),
                                      alpha_priors={"draft_model": 0.8}, settings=AdaptiveSettings(probe=0.0))
                   for _ in range(2))
    sizes = [64] * 4 + list(range(63, 0, -1)) + [1] * 8
    decided: list[tuple[int, Decision]] = []
    settled = []
    for _ in range(2):
        for b in sizes:
            d = lazy.decide(b)
            assert eager.decide(b) == d
            rec = machine.step(d, b)
            lazy.observe(d, rec)
            eager.observe(d, rec)
            eager._fold()  # the eager policy folds every record at once
            decided.append((b, d))
            if b == 40:
                settled.append(sum(t.settled for t in lazy._tables.values()))
    assert min(settled) > 0
    assert all(d == AR for b, d in decided if b >= 48)
    assert all(d.method == "draft_model" for b, d in decided if b <= 2)


def test_a_settled_table_stands_the_cost_moves_its_margin_covers() -> None:
    machine, ctrl = hopeless_ngram()
    t4 = machine.t(4)
    ctrl.observe(ctrl.decide(4), record(AR, 4, 0, t4))
    table = ctrl._tables[4]
    assert table.settled and table.optimistic < 1 / 1.15
    ctrl.observe(AR, record(AR, 4, 0, 1.3 * t4))  # the estimate moves 15% (with the calibration's): within the margin
    ctrl._fold()
    assert ctrl._tables[4] is table
    ctrl.observe(AR, record(AR, 4, 0, 0.3 * t4))  # 3.8x cheaper: the margin does not cover that
    ctrl._fold()
    assert 4 not in ctrl._tables
    ctrl.table(4)
    assert ctrl._tables[4].settled
    ngram = Decision("ngram", 2)  # a speculative step moves acceptance, which every settled table rests on
    ctrl.observe(ngram, machine.step(ngram, 4))
    ctrl._fold()
    assert not ctrl._tables


def test_stop_hazard_shortens_drafts_of_a_drafter_that_agrees_past_the_end() -> None:
    # A drafter accepted 99% of the time, cheap to run: with sequences that never end it drafts the longest γ;
    # when one emitted token in five ends its sequence, drafts past that point are waste and a short γ wins.
    model = memory_bound_model()
    ctrl = AdaptiveController(["draft_model"], cost_model=model, alpha_priors={"draft_model": 0.99},
                              settings=AdaptiveSettings(probe=0.0))
    assert ctrl.stop_hazard(1) == 0.0
    long_gamma = ctrl.table(1)["draft_model"][1].gamma
    assert long_gamma == 8
    d = Decision("draft_model", 2)
    for i in range(40):  # 3 tokens a step, one stop in five tokens
        ctrl.observe(d, StepRecord(step=0, method="draft_model", gamma=2, batch_size=1, draft_tokens=2,
                                   accepted_tokens=2, emitted_tokens=3, seconds=9e-3, draft_seconds=1e-3,
                                   target_seconds=8e-3, tried_tokens=2, tested_at=(1, 1), accepted_at=(1, 1),
                                   stopped=1 if i % 5 < 3 else 0))
    # 24 stops in 120 tokens, behind 64 tokens of the no-stop prior (decayed over `stop_memory` tokens)
    assert 0.1 < ctrl.stop_hazard(1) < 24 / 120
    assert ctrl.stop_hazard(16) == 0.0  # another batch size: its own evidence
    ctrl._tables.clear()
    short = ctrl.table(1)["draft_model"]
    assert short[1].gamma < long_gamma
    assert ctrl.costs is not None
    keep = 1 - ctrl.stop_hazard(1)
    continuing = ctrl.continuing("draft_model", 1)
    assert continuing == pytest.approx([p * keep for p in ctrl.acceptance("draft_model")])  # type: ignore[union-attr]
    assert short[0] == pytest.approx(ctrl.costs.best_gamma("draft_model", 1, continuing, ctrl.settings.gammas(),
                                                           tie=ctrl.settings.length_tie)[1])
    assert ctrl.stats()["stop_hazard_by_batch_size"] == {1: round(ctrl.stop_hazard(1), 4)}


def test_unmeasured_lengths_keep_the_calibrations_shape_under_noisy_measurements() -> None:
    # Only γ=4 and γ=5 (5 and 6 tokens) run at batch 2; their timings are noisy. The calibrated 3- and 7-token
    # verifies never run: they must keep the calibration's shape (its line over lengths, `verify_line`), moved by
    # the batch size's level alone.
    from specrl.runtime.engine.estimates import rescale_unmeasured, verify_line

    cal = CostModel(target_step={2: 8e-3}, verify_step={2: {3: 9e-3, 5: 10e-3, 7: 13e-3}},
                    draft_step={"draft_model": {2: 1e-3}})
    ctrl = AdaptiveController(["draft_model"], cost_model=cal, alpha_priors={"draft_model": 0.8},
                              settings=AdaptiveSettings(probe=0.0, window=4))
    rng = random.Random(0)
    for i in range(600):  # γ=4 and γ=5 and plain steps in turn, each timing noisy
        d = (Decision("draft_model", 4), Decision("draft_model", 5), AR)[i % 3]
        seconds = (12e-3, 13e-3, 8e-3)[i % 3] * (1 + rng.random())
        if d.method:
            ctrl.observe(d, record(d, 2, accepted=6, seconds=seconds + 1e-3, draft_seconds=1e-3, tried=8))
        else:
            ctrl.observe(d, record(d, 2, accepted=0, seconds=seconds))
    assert ctrl.costs is not None
    verify = ctrl.costs.verify_step[2]
    line = verify_line({1: 8e-3, 3: 9e-3, 5: 10e-3, 7: 13e-3}, [3, 7])
    assert line[3] == pytest.approx(26e-3 / 3) and line[7] == pytest.approx(38e-3 / 3)  # least squares, slope 1e-3
    assert verify[7] / verify[3] == pytest.approx(line[7] / line[3])
    assert verify[7] / verify[5] != pytest.approx(13 / 10)  # a measured length moves with its own samples too
    # a free drafter's (n-gram's) lengths: the nearest measured one anchors each; its zero prediction scales nothing
    assert rescale_unmeasured({1: 2.0, 5: 30.0}, {1: 1.0, 3: 2.0, 9: 6.0}, {1, 5}, {1: 1.0, 5: 10.0}.__getitem__) \
        == {3: 4.0, 9: 18.0}
    assert rescale_unmeasured({2: 1.0}, {1: 0.0, 2: 0.0}, {2}, lambda k: 0.0) == {}


def test_verify_line_smooths_the_calibrations_lengths_and_never_falls() -> None:
    from specrl.runtime.engine.estimates import verify_line

    # noise at the longest timed length no longer sets the slope beyond it: 9 tokens on the line through 3, 5, 7
    timed = {1: 1.0, 3: 1.25, 5: 1.33, 7: 1.32}
    line = verify_line(timed, [1, 3, 7, 9])
    assert line[1] == 1.0 and line[3] < line[7] < line[9] < 1.45
    assert verify_line({1: 1.0, 3: 1.4, 7: 1.2}, [3, 9]) == {3: pytest.approx(1.3), 9: pytest.approx(1.3)}  # flat
    assert verify_line({1: 1.0, 3: 1.5}, [2, 5]) == {2: pytest.approx(1.25), 5: pytest.approx(2.0)}  # one timed


def test_one_slow_step_of_one_length_does_not_reprice_the_others() -> None:
    # In a rollout's tail a batch size is visited for a few steps. On the benchmark, at batch 16, the policy ran γ=2
    # for most of them and γ=4 once, in a slow step; priced per length, that one sample rescaled every longer length
    # with it (γ=6 at 4.65 plain steps where its rounds cost about 2.6) and the policy kept drafting γ=2. Here the
    # slow step costs 1.7x its calibration.
    from specrl.runtime.engine.estimates import LENGTH_PRIOR, pooled_lengths

    lengths = range(1, 10)
    cal = CostModel(target_step={8: 8e-3, 16: 9e-3},
                    verify_step={b: {k: t * (1 + 0.3 * (k - 1)) for k in lengths if k > 1}
                                 for b, t in ((8, 8e-3), (16, 9e-3))},
                    draft_step={"draft_model": {8: 1e-3, 16: 1.2e-3}})
    ctrl = AdaptiveController(["draft_model"], cost_model=cal, alpha_priors={"draft_model": 0.85},
                              settings=AdaptiveSettings(probe=0.0))
    two, four = Decision("draft_model", 2), Decision("draft_model", 4)
    for i in range(12):
        d, slow = (four, 1.7) if i == 6 else (two, 1.0 + 0.01 * (i % 3))
        verify = cal.verify_step[16][d.gamma + 1] * slow
        ctrl.observe(d, record(d, 16, accepted=d.gamma, seconds=verify + 2e-3, draft_seconds=2e-3, tried=d.gamma))
    assert ctrl.costs is not None
    at16 = ctrl.costs.verify_step[16]
    assert at16[7] == pytest.approx(cal.verify_step[16][7], rel=0.02)  # γ=6 keeps its calibrated cost
    assert at16[5] / cal.verify_step[16][5] == pytest.approx((1.7 + LENGTH_PRIOR) / (1 + LENGTH_PRIOR), rel=0.02)
    # a batch size without a calibration of its own reads the shape interpolated between its neighbours
    d = Decision("draft_model", 3)
    ctrl.observe(d, record(d, 12, accepted=3, seconds=12e-3, draft_seconds=1e-3, tried=3))
    at12 = ctrl.costs.verify_step[12]
    assert at12[9] / at12[2] == pytest.approx(cal.verify_seconds(12, [9])[9] / cal.verify_seconds(12, [2])[2])
    # the level is a low quantile of the ratios (one sample: its mean with the calibration)
    assert pooled_lengths({1: 1.0, 2: 2.0}, [], {}) == {1: 1.0, 2: 2.0}
    assert pooled_lengths({1: 1.0, 2: 2.0}, [3.0], {}) == {1: 2.0, 2: 4.0}
    assert pooled_lengths({1: 1.0}, [1.0, 1.0, 1.0, 5.0], {1: (1, 5.0)}) == \
        {1: pytest.approx((5.0 + LENGTH_PRIOR) / (1 + LENGTH_PRIOR))}


def test_one_plain_step_at_a_batch_size_the_tail_visits_briefly_does_not_set_its_cost() -> None:
    # Batch sizes 9-15 get a step or two per rollout; one slow plain step at batch 12 (a probe, a recheck) used to
    # be its plain cost alone, and every proposer there was priced against it (the draft model at 1.75x plain
    # decoding where it ran at 1.34x). Its own samples are weighed against the neighbours' plain steps.
    from specrl.runtime.engine.estimates import PLAIN_PRIOR, shrunk_plain

    cal = CostModel(target_step={4: 7e-3, 8: 8e-3, 16: 9e-3}, verify_step={8: {3: 12e-3}, 16: {3: 14e-3}},
                    draft_step={"draft_model": {8: 1e-3, 16: 1.2e-3}})
    ctrl = AdaptiveController(["draft_model"], cost_model=cal, alpha_priors={"draft_model": 0.85},
                              settings=AdaptiveSettings(probe=0.0))
    neighbours = cal.t_ar(12)  # 8.58 ms, log-interpolated
    ctrl.observe(AR, record(AR, 12, 0, 2 * neighbours))
    assert ctrl.costs is not None
    assert ctrl.costs.t_ar(12) == pytest.approx((2 + PLAIN_PRIOR) / (1 + PLAIN_PRIOR) * neighbours)
    for _ in range(30):  # a steady cost of its own wins out
        ctrl.observe(AR, record(AR, 12, 0, 1.5 * neighbours))
    assert ctrl.costs.t_ar(12) == pytest.approx(1.5 * neighbours, rel=0.15)
    # calibrated sizes, and sizes beyond the others' range, keep their own samples' estimate
    ctrl.observe(AR, record(AR, 16, 0, 2 * 9e-3))
    ctrl.observe(AR, record(AR, 16, 0, 2 * 9e-3))
    assert ctrl.costs.t_ar(16) == pytest.approx(2 * 9e-3)
    ctrl.observe(AR, record(AR, 8, 0, 2 * 8e-3))  # calibrated, between 4 and 12: no prior either
    ctrl.observe(AR, record(AR, 8, 0, 2 * 8e-3))
    assert ctrl.costs.t_ar(8) == pytest.approx(2 * 8e-3)
    assert shrunk_plain(5.0, 1, {8: 1.0, 16: 2.0}, 32) == 5.0
    assert shrunk_plain(5.0, 1, {}, 12) == 5.0
    assert shrunk_plain(5.0, 1, {8: 1.0, 12: 7.0, 16: 1.0}, 12) == pytest.approx((5.0 + PLAIN_PRIOR) / (1 + PLAIN_PRIOR))


def test_a_calibrated_batch_sizes_draft_lengths_are_pooled_too() -> None:
    # The calibration times drafting at γ=2 and γ=6 at every batch size it calibrates. Priced per length there,
    # the lengths the steps timed moved alone: on the benchmark at batch 2 drafting γ=3 stood at 0.56 plain steps and
    # γ=4 at 0.43 (calibration: 0.24 and 0.28), and the policy flipped between γ=4, 5 and 6 at 0.93x fixed γ=6.
    # Here the steps' drafting costs 1.5x the calibration at every length, γ=4 runs, and γ=3 runs twice in a slow
    # minute.
    from specrl.runtime.engine.estimates import LENGTH_PRIOR

    t = 8e-3
    cal = CostModel(target_step={2: t}, verify_step={2: {k: t * (1 + 0.1 * (k - 1)) for k in (3, 7)}},
                    draft_round={"draft_model": {2: {2: 0.2 * t, 6: 0.4 * t}}})
    ctrl = AdaptiveController(["draft_model"], cost_model=cal, alpha_priors={"draft_model": 0.85},
                              settings=AdaptiveSettings(probe=0.0))
    calibrated_draft = {g: x * t for g, x in cal.draft_ratios("draft_model", 2, range(1, 9)).items()}
    for i in range(24):
        d, slow = (Decision("draft_model", 3), 2.5) if i in (5, 6) else (Decision("draft_model", 4), 1.5)
        drafting = calibrated_draft[d.gamma] * slow
        ctrl.observe(d, record(d, 2, accepted=d.gamma, seconds=drafting + 1.2 * t, draft_seconds=drafting,
                               tried=d.gamma))
    assert ctrl.costs is not None
    drafts = ctrl.costs.draft_round["draft_model"][2]
    assert sorted(drafts) == list(range(1, 9))
    assert all(drafts[g] < drafts[g + 1] for g in range(1, 8)), drafts  # the calibration's shape kept
    for g in (1, 2, 5, 6, 7, 8):  # lengths no step timed: the batch size's level, 1.5x
        assert drafts[g] / calibrated_draft[g] == pytest.approx(1.5, rel=0.02)
    assert drafts[3] / calibrated_draft[3] == pytest.approx((2 * 2.5 + LENGTH_PRIOR * 1.5) / (2 + LENGTH_PRIOR),
                                                            rel=0.02)
    # below the shortest calibrated length, drafting never extrapolates under its proportional share
    noisy = CostModel(target_step={2: t}, verify_step={2: {3: 1.2 * t}},
                      draft_round={"draft_model": {2: {2: 0.1 * t, 6: 0.9 * t}}})
    assert noisy.draft_ratios("draft_model", 2, [1])[1] == pytest.approx(0.05)


def test_plain_decoding_never_timed_at_a_batch_size_moves_with_its_verifications() -> None:
    # The bench's sweep at batch 4 speculated in every step: a plain step kept the calibration's cost (short
    # contexts, another minute), 11% under what the fixed plain configuration beside it measured, while every
    # verification was measured at its cost, so every proposer was predicted slower against plain decoding than it
    # ran. Here the machine runs every forward 1.15x its calibration.
    t = 8e-3
    cal = CostModel(target_step={4: t}, verify_step={4: {3: 1.3 * t, 5: 1.6 * t, 7: 1.9 * t}},
                    draft_round={"draft_model": {4: {2: 0.2 * t, 6: 0.5 * t}}})

    def policy_on(model: CostModel) -> AdaptiveController:
        return AdaptiveController(["draft_model"], cost_model=model, alpha_priors={"draft_model": 0.8},
                                  settings=AdaptiveSettings(probe=0.0, neighbour=0))

    ctrl, d = policy_on(cal), Decision("draft_model", 4)
    drafting = cal.draft_ratios("draft_model", 4, [4])[4] * t
    for _ in range(12):
        ctrl.observe(d, record(d, 4, accepted=3, seconds=1.15 * (1.6 * t + drafting), draft_seconds=1.15 * drafting,
                               tried=4))
    costs = ctrl.costs
    assert costs is not None
    assert costs.t_ar(4) == pytest.approx(1.15 * t, rel=0.01)
    # a level that moves every forward alike leaves the ratios, and the predicted speeds, where the calibration had
    # them (acceptance aside)
    fresh = policy_on(cal)
    fresh.estimates.alpha["draft_model"] = ctrl.alpha["draft_model"]
    assert ctrl.table(4)["draft_model"][0] == pytest.approx(fresh.table(4)["draft_model"][0], rel=0.01)
    # once a plain step is timed there, its own samples rule
    for _ in range(3):
        ctrl.observe(AR, record(AR, 4, accepted=0, seconds=1.3 * t))
    assert ctrl.costs is not None and ctrl.costs.t_ar(4) == pytest.approx(1.3 * t)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_draft_length_timed_in_a_slow_minute_runs_again(seed: int) -> None:
    # The best draft length at batch 16 (γ=4 or 5 on this machine, 3-4% ahead of γ=3) was timed in a minute when
    # the machine ran 1.6x slower, γ=3 in a normal one. Priced on those timings γ=3 wins the argmax: the
    # neighbouring lengths run one step in `neighbour`, and the policy finds its way back. Without them
    # (neighbour=0) γ=3 ran every step while a length the calibration had not timed (here γ=4 and γ=5: it timed 3
    # and 7 tokens) was priced by its own samples alone; in the base of every length the policy may verify
    # (`Estimates._verify_base_at`), the slow samples count against the batch size's level, and γ=3 no longer
    # holds every step even without them.
    def run(neighbour: int) -> tuple[AdaptiveController, Counter[str]]:
        machine = Machine({"draft_model": 0.85}, {"draft_model": 0.02}, c=0.012, seed=seed)
        ctrl = AdaptiveController(["draft_model"], cost_model=calibrated(machine, ["draft_model"]),
                                  alpha_priors={"draft_model": 0.85},
                                  settings=AdaptiveSettings(probe=0.0, neighbour=neighbour))
        for d, slow, n in ((Decision("draft_model", 5), 1.6, 4), (Decision("draft_model", 3), 1.0, 6)):
            for _ in range(n):
                rec = machine.step(d, 16)
                ctrl.observe(d, retimed(rec, rec.seconds * slow))
        drive(ctrl, machine, 16, 600)
        return ctrl, Counter(ctrl.stats()["decisions_by_batch_size"][16])

    ctrl, ran = run(16)
    assert ran["draft_model:4"] + ran["draft_model:5"] > 0.6 * 600, ran
    assert ctrl.stats()["neighbour_steps"] == pytest.approx(600 / 16, abs=1)
    assert run(0)[1]["draft_model:3"] < 0.5 * 600
    with pytest.raises(ValueError, match="neighbour"):
        AdaptiveSettings(neighbour=-1)

"""Adaptive speculation: when to speculate, how far, and with which proposer.

Three layers, each a small pure object, combined by `AdaptiveController` (the engine's per-decode-step hook):

(a) **System-aware toggle** (EfficientRollout's roofline toggle, DESIGN §5). A `CostModel` calibrated on the running
    machine gives, per active batch size b, the cost of one round of speculation relative to one plain target step:
    ``c(b, m, γ) = γ·r(b, m) + v(b, γ)`` with r the draft-step / target-step cost ratio of proposer m and v the
    verify(γ+1 tokens) / target-step ratio. With acceptance α the expected tokens per round are
    ``L = (1 − α^(γ+1)) / (1 − α)``, so the predicted speedup is ``L / c``. Speculate only when the best predicted
    speedup exceeds ``1 + margin`` for the current batch size: at large batch the target step stops being
    memory-bound, verify cost grows with γ+1 and speculation loses.
(b) **Acceptance-aware draft length**. `AcceptanceTracker` keeps an EWMA of α per proposer from the engine's
    accepted counts; γ is the argmax of the predicted speedup in ``[min_gamma, max_gamma]``.
(c) **Per batch-size bucket bandit** (TLT's Bucketed ε-Greedy, "BEG"). Buckets start at the thresholds
    (default ``[1, 2, 5, 21]``); inside a bucket, ε-greedy over (proposer, γ) arms — plain AR included, so the
    bandit can also switch speculation off — scored by the **median measured goodput** over a sliding window.
    Goodput is emitted tokens per second, normalised by the calibrated AR throughput of that batch size
    (``tokens/s ÷ (b / t_AR(b))``), so steps taken at b=5 and b=20 inside one bucket are comparable; 1.0 means
    "as fast as plain decoding". Arms never measured are scored by the cost model (a)+(b), so exploitation starts
    where the model points and measurements correct it.

**Switching costs.** A proposer with its own KV cache (draft model, quantized copy) catches up on every token it
did not see while another arm ran, inside the first step after a switch. That step measures the switch, not the
arm, so it is not scored (one unlucky catch-up would otherwise bury the best arm for good), and exploration runs
in short bursts of `explore_run` steps on one arm at ε/`explore_run`: as many exploratory steps, a third of the
switches, and every burst yields scored steady-state steps.

Nothing here touches the engine's sampling RNG: exploration draws from the controller's own `random.Random`, so
the choice of arm never changes the sampled tokens' distribution (speculation is lossless for any arm).

The engine (`control.py`) calls ``decide(active_batch_size) -> Decision`` before each decode step and
``observe(decision, record: StepRecord)`` after it; ``stats()`` is merged into ``engine.stats``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .control import Decision, StepRecord

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 5, 21)
DEFAULT_GAMMAS: tuple[int, ...] = (2, 4, 6)
DEFAULT_CALIBRATION_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)


# ---------------------------------------------------------------------------------------------------------------
# decisions


AR = Decision(None, 0)


def is_speculative(decision: Decision) -> bool:
    return decision.method is not None and decision.gamma > 0


def label(decision: Decision) -> str:
    return f"{decision.method}:{decision.gamma}" if is_speculative(decision) else "ar"


# ---------------------------------------------------------------------------------------------------------------
# (a) the cost model


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """L = (1 − α^(γ+1)) / (1 − α): expected tokens emitted by one round with γ drafts (bonus token included)."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, r: float, v: float) -> float:
    """Speedup of one speculative round over plain decoding: L / (γ·r + v)."""
    cost = gamma * r + v
    if cost <= 0:
        raise ValueError(f"round cost γ·r + v must be > 0, got {cost} (r={r}, v={v}, γ={gamma})")
    return expected_tokens_per_round(alpha, gamma) / cost


def alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """Invert E[accepted drafts] = α(1 − α^γ)/(1 − α) for α (bisection; the map is increasing in α)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    target = min(max(mean_accepted, 0.0), float(gamma))
    if target <= 0.0:
        return 0.0
    if target >= gamma:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(24):  # 6e-8 resolution: far below the noise of one round's estimate
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, gamma) - 1.0 < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _interp(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear in log(batch size), clamped at the ends: step costs grow smoothly with b."""
    keys = sorted(points)
    if not keys:
        raise ValueError("no calibration points")
    if x <= keys[0]:
        return points[keys[0]]
    if x >= keys[-1]:
        return points[keys[-1]]
    i = bisect.bisect_right(keys, x)
    a, b = keys[i - 1], keys[i]
    w = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
    return points[a] * (1 - w) + points[b] * w


@dataclass
class CostModel:
    """Measured step costs on this machine (seconds), interpolated between calibrated batch sizes.

    ``target_step[b]``: one plain decode step of the target at batch b.
    ``verify_step[b][k]``: one target forward over k new tokens per sequence at batch b (k = γ+1 when verifying).
    ``draft_step[m][b]``: one draft step of proposer m at batch b (0 for model-free proposers that cost ~nothing).
    ``overhead[m][b]``: fixed per-round cost of proposer m beyond γ draft steps + verify (sampling, rollback,
    draft catch-up), measured end to end; counted in units of target steps like r and v.
    """

    target_step: dict[int, float]
    verify_step: dict[int, dict[int, float]]
    draft_step: dict[str, dict[int, float]] = field(default_factory=dict)
    overhead: dict[str, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.target_step:
            raise ValueError("CostModel.target_step: needs at least one calibrated batch size")
        for b, t in self.target_step.items():
            if b < 1 or not t > 0:
                raise ValueError(f"CostModel.target_step[{b}]: batch must be >= 1 and cost > 0, got {t}")

    @property
    def methods(self) -> list[str]:
        return sorted(self.draft_step)

    def t_ar(self, batch: int) -> float:
        return _interp(self.target_step, batch)

    def v(self, batch: int, gamma: int) -> float:
        """verify(γ+1 tokens) / target step at this batch size (linear in tokens between calibrated k)."""
        tokens = gamma + 1
        per_b: dict[int, float] = {}
        for b, by_k in self.verify_step.items():
            ks = sorted(by_k)
            if not ks:
                continue
            if tokens in by_k:
                cost = by_k[tokens]
            elif len(ks) == 1:
                cost = by_k[ks[0]] * tokens / ks[0]
            else:
                lo = max([k for k in ks if k <= tokens] or [ks[0]])
                hi = min([k for k in ks if k >= tokens] or [ks[-1]])
                if lo == hi:  # outside the measured range: extend the last segment linearly
                    lo, hi = (ks[-2], ks[-1]) if tokens > ks[-1] else (ks[0], ks[1])
                slope = (by_k[hi] - by_k[lo]) / (hi - lo)
                cost = by_k[lo] + slope * (tokens - lo)
            per_b[b] = cost / self.target_step.get(b, _interp(self.target_step, b))
        if not per_b:
            return 1.0 + 0.0 * gamma
        return max(_interp(per_b, batch), 1e-6)

    def r(self, method: str, batch: int) -> float:
        if method not in self.draft_step:
            raise KeyError(f"CostModel: proposer {method!r} was not calibrated (have {self.methods})")
        ratios = {b: t / _interp(self.target_step, b) for b, t in self.draft_step[method].items()}
        return max(_interp(ratios, batch), 0.0)

    def round_overhead(self, method: str, batch: int) -> float:
        by_b = self.overhead.get(method)
        if not by_b:
            return 0.0
        ratios = {b: t / _interp(self.target_step, b) for b, t in by_b.items()}
        return max(_interp(ratios, batch), 0.0)

    def round_cost(self, method: str, gamma: int, batch: int) -> float:
        """Cost of one speculative round in target steps: γ·r + v (+ measured per-round overhead)."""
        return gamma * self.r(method, batch) + self.v(batch, gamma) + self.round_overhead(method, batch)

    def speedup(self, method: str, gamma: int, batch: int, alpha: float) -> float:
        return expected_tokens_per_round(alpha, gamma) / self.round_cost(method, gamma, batch)

    def best_gamma(self, method: str, batch: int, alpha: float, gammas: Iterable[int]) -> tuple[int, float]:
        """(b): the γ in `gammas` with the highest predicted speedup, and that speedup."""
        best = max(gammas, key=lambda g: (self.speedup(method, g, batch, alpha), -g))
        return best, self.speedup(method, best, batch, alpha)

    def crossover_batch_size(self, method: str, gamma: int, alpha: float, margin: float = 0.0,
                             max_batch: int = 4096) -> int:
        """Largest batch size at which speculation is still predicted to win by `margin` (0 when never)."""
        last = 0
        for b in range(1, max_batch + 1):
            if self.speedup(method, gamma, b, alpha) > 1.0 + margin:
                last = b
            elif b > max(self.target_step):
                break
        return last

    def to_dict(self) -> dict[str, Any]:
        return {"target_step": self.target_step, "verify_step": self.verify_step,
                "draft_step": self.draft_step, "overhead": self.overhead}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        def ints(d: Mapping[Any, Any]) -> dict[int, Any]:
            return {int(k): v for k, v in d.items()}
        return cls(target_step={int(k): float(v) for k, v in data["target_step"].items()},
                   verify_step={int(b): {int(k): float(t) for k, t in by_k.items()}
                                for b, by_k in data["verify_step"].items()},
                   draft_step={m: ints(v) for m, v in data.get("draft_step", {}).items()},
                   overhead={m: ints(v) for m, v in data.get("overhead", {}).items()})


def toggle(model: CostModel, batch: int, alphas: Mapping[str, float], gammas: Iterable[int],
           margin: float = 0.05) -> Decision:
    """(a)+(b): the best (proposer, γ) by predicted speedup, or AR when nothing beats 1 + margin."""
    gammas = list(gammas)
    best: tuple[float, Decision] = (1.0 + margin, AR)
    for method, alpha in sorted(alphas.items()):
        if method not in model.draft_step:
            continue
        gamma, s = model.best_gamma(method, batch, alpha, gammas)
        if s > best[0]:
            best = (s, Decision(method, gamma))
    return best[1]


# ---------------------------------------------------------------------------------------------------------------
# (b) acceptance tracking


class AcceptanceTracker:
    """EWMA of the per-draft acceptance probability α, per proposer.

    With per-sequence accepted counts n_i of a round with γ drafts, each sequence tried ``min(n_i + 1, γ)``
    drafts and accepted n_i of them, so α̂ = Σn / Σtried for that round (the MLE of a truncated geometric).
    With only a total, α is recovered from the mean by inverting E[n] = α(1 − α^γ)/(1 − α).
    """

    def __init__(self, prior: float = 0.6, decay: float = 0.9, priors: Mapping[str, float] | None = None) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"AcceptanceTracker: decay must lie in (0, 1), got {decay}")
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"AcceptanceTracker: prior must lie in [0, 1], got {prior}")
        self.prior = prior
        self.decay = decay
        self._alpha: dict[str, float] = dict(priors or {})
        self.rounds: dict[str, int] = {}

    def alpha(self, method: str) -> float:
        return self._alpha.get(method, self.prior)

    def alphas(self, methods: Iterable[str]) -> dict[str, float]:
        return {m: self.alpha(m) for m in methods}

    @staticmethod
    def round_alpha(accepted: int | Sequence[int], gamma: int, batch: int) -> float:
        if isinstance(accepted, int):
            return alpha_from_mean_accepted(accepted / max(batch, 1), gamma)
        counts = [min(max(int(n), 0), gamma) for n in accepted]
        tried = sum(min(n + 1, gamma) for n in counts)
        return sum(counts) / tried if tried else 0.0

    def update(self, method: str, gamma: int, accepted: int | Sequence[int], batch: int) -> float:
        return self.observe(method, self.round_alpha(accepted, gamma, batch))

    def observe(self, method: str, observed: float) -> float:
        old = self._alpha.get(method)
        self._alpha[method] = observed if old is None else self.decay * old + (1 - self.decay) * observed
        self.rounds[method] = self.rounds.get(method, 0) + 1
        return self._alpha[method]


# ---------------------------------------------------------------------------------------------------------------
# (c) the bucketed ε-greedy bandit


def bucket_of(batch: int, thresholds: Sequence[int]) -> int:
    """Index of the bucket holding `batch`: the last threshold <= batch (thresholds ascending, first = 1)."""
    if batch < 1:
        raise ValueError(f"active batch size must be >= 1, got {batch}")
    return max(bisect.bisect_right(thresholds, batch) - 1, 0)  # no copy: called every decode step


class BucketedEpsilonGreedy:
    """Per batch-size bucket, ε-greedy over arms by the median of a sliding window of rewards."""

    def __init__(self, arms: Sequence[Decision], thresholds: Sequence[int] = DEFAULT_BUCKETS, epsilon: float = 0.1,
                 window: int = 100, seed: int = 0, min_samples: int = 3, explore_gap: float = 0.25,
                 min_exact: int = 8, decay_steps: int = 0, min_epsilon_fraction: float = 0.25) -> None:
        if not arms:
            raise ValueError("BucketedEpsilonGreedy: needs at least one arm")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"BucketedEpsilonGreedy: epsilon must lie in [0, 1], got {epsilon}")
        if window < 1:
            raise ValueError(f"BucketedEpsilonGreedy: window must be >= 1, got {window}")
        thresholds = list(thresholds)
        if not thresholds or thresholds[0] != 1 or sorted(set(thresholds)) != thresholds:
            raise ValueError(f"BucketedEpsilonGreedy: thresholds must be strictly ascending and start at 1, "
                             f"got {thresholds}")
        self.arms = list(dict.fromkeys(arms))
        self.thresholds = thresholds
        self.epsilon = epsilon
        # ε decays per bucket as ε·sqrt(d / (d + n)) over its n decisions, down to a floor: a bucket that has
        # seen hundreds of steps knows its arms, yet the drafter keeps training, so exploration never stops.
        self.decay_steps = decay_steps
        self.min_epsilon_fraction = min_epsilon_fraction
        self._decisions: dict[int, int] = {}
        self.window = window
        self.min_samples = min_samples
        self.explore_gap = explore_gap
        self.min_exact = min_exact
        self._rng = random.Random(seed)
        self._rewards: dict[tuple[int, Decision], deque[float]] = {}
        self._medians: dict[tuple[int, Decision], float] = {}
        self._exact: dict[tuple[int, Decision], deque[float]] = {}
        self._exact_medians: dict[tuple[int, Decision], float] = {}

    def bucket(self, batch: int) -> int:
        return bucket_of(batch, self.thresholds)

    def bucket_label(self, index: int) -> str:
        lo = self.thresholds[index]
        hi = self.thresholds[index + 1] - 1 if index + 1 < len(self.thresholds) else None
        return f"{lo}+" if hi is None else (str(lo) if hi == lo else f"{lo}-{hi}")

    def score(self, bucket: int, arm: Decision) -> float | None:
        # cached: choose() reads every arm's score every decode step, update() changes one window
        return self._medians.get((bucket, arm))

    def samples(self, bucket: int, arm: Decision) -> int:
        window = self._rewards.get((bucket, arm))
        return len(window) if window else 0

    def choose(self, batch: int, prior: Callable[[Decision], float] | None = None, incumbent: str | None = None,
               switch_margin: float = 0.0, switch_cost: Callable[[str], float] | None = None
               ) -> tuple[Decision, bool]:
        """(arm, explored). Unmeasured arms are scored by `prior` (the cost model), else tried first.

        Exploitation keeps the `incumbent` proposer (the one that ran last; None = plain decoding) unless another
        proposer's arm is better by more than `switch_margin` plus `switch_cost(method)` (the catch-up a switch to
        that proposer costs, in relative goodput over the switching horizon): a switch makes the new proposer catch
        up on the tokens it missed, so flapping between two near-equal proposers costs more than either.

        Exploration is uniform over the arms still in contention: those whose median (or, unmeasured, prior)
        is within `explore_gap` of the best arm's (without a prior, also those with fewer than `min_samples`
        measurements). Other arms are re-explored
        only at a tenth of the rate and in proportion to their value squared, so exploring 16 arms does not
        cost 10% of goodput for ever, yet a drafter that improves (it is trained during the job) is noticed.
        """
        b = self.bucket(batch)

        def value(arm: Decision) -> float:
            # Measurements at exactly this batch size win once there are enough of them; the bucket pools the
            # neighbouring sizes until then (what the bucket is for: little data per size in a long tail).
            exact = self._exact_medians.get((batch, arm))
            if exact is not None and len(self._exact[(batch, arm)]) >= self.min_exact:
                return exact
            s = self.score(b, arm)
            if s is not None:
                return s
            return prior(arm) if prior is not None else math.inf

        def sticky(arm: Decision) -> float:
            v = value(arm)
            method = arm.method if is_speculative(arm) else None
            if method == incumbent:
                return v * (1.0 + switch_margin)
            return v - switch_cost(method) if switch_cost is not None and method is not None else v

        best = max(self.arms, key=lambda a: (sticky(a), not is_speculative(a), -a.gamma))
        n = self._decisions[b] = self._decisions.get(b, 0) + 1
        if self._rng.random() < self.epsilon_at(b, n):
            top = value(best)
            # With a prior, unmeasured arms compete on their predicted value (a proposer the cost model says is
            # 10x too slow is not worth three trial steps); without one, every arm gets `min_samples` tries.
            # Predictions from a start-up calibration on a noisy machine are trusted within 2x only.
            # An arm with fewer than `min_samples` measurements stays in contention on its prediction too: one
            # unlucky step (a load spike, a catch-up) must not bury an arm the cost model rates highly.
            contenders = [a for a in self.arms
                          if value(a) >= (1 - self.explore_gap) * top
                          or (self.samples(b, a) < self.min_samples
                              and (prior is None or max(value(a), prior(a)) >= 0.5 * top))]
            if contenders and self._rng.random() >= 0.1:
                return self._rng.choice(contenders), True
            # Rarely, any arm — weighted by its value squared: one step of an arm measured 20x slower than plain
            # decoding costs as much as 20 plain steps, so it is re-checked (for a drafter that got better)
            # about 400x less often than a close contender.
            weights = [1.0 if not (math.isfinite(value(a)) and math.isfinite(top) and top > 0)
                       else max(min(value(a) / top, 1.0), 0.0) ** 2 + 1e-9 for a in self.arms]
            return self._rng.choices(self.arms, weights)[0], True
        return best, False

    def epsilon_at(self, bucket: int, decisions: int | None = None) -> float:
        n = self._decisions.get(bucket, 0) if decisions is None else decisions
        if not self.decay_steps:
            return self.epsilon
        return self.epsilon * max(self.min_epsilon_fraction, math.sqrt(self.decay_steps / (self.decay_steps + n)))

    def update(self, batch: int, arm: Decision, reward: float) -> None:
        key = (self.bucket(batch), arm)
        if key not in self._rewards:
            self._rewards[key] = deque(maxlen=self.window)
        self._rewards[key].append(float(reward))
        self._medians[key] = statistics.median(self._rewards[key])
        exact = (batch, arm)
        if exact not in self._exact:
            self._exact[exact] = deque(maxlen=self.window)
        self._exact[exact].append(float(reward))
        self._exact_medians[exact] = statistics.median(self._exact[exact])


# ---------------------------------------------------------------------------------------------------------------
# the controller


@dataclass
class AdaptiveSettings:
    """Knobs of the controller; `settings_from_spec` maps the RLJob's ``spec.speculative.adaptive`` onto them.

    toggle: AR is an option (cost-model toggle, and an arm of the bandit); draft_length: γ adapts (else fixed at
    `gamma`); strategy: the bucketed bandit picks (proposer, γ) by measured goodput (else the cost model decides).
    """

    toggle: bool = True
    draft_length: bool = True
    strategy: bool = True
    gamma: int = 4  # starting / fixed draft length (spec.speculative.numSpeculativeTokens)
    min_gamma: int = 1
    max_gamma: int = 8
    gammas: tuple[int, ...] | None = None  # bandit arms; default: {2, 4, 6, gamma} clipped to [min, max]
    margin: float = 0.05
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    epsilon: float = 0.1
    explore_run: int = 3  # exploratory steps in a row on one arm (the first, a switch, is not scored)
    switch_margin: float = 0.05  # another proposer must look this much better to switch to it
    switch_horizon: int = 16  # steps over which a switch must repay the proposer's measured catch-up
    epsilon_decay_steps: int = 200  # per bucket: ε·sqrt(d/(d+n)) after n decisions, floored at ε/4 (0 = constant)
    window: int = 100
    ewma_decay: float = 0.9
    prior_alpha: float = 0.6
    seed: int = 0
    clock: str = "wall"  # "cpu" on shared CPU machines, see StepClock

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {self.clock!r}")
        if self.min_gamma < 1 or self.max_gamma < self.min_gamma:
            raise ValueError(f"minDraftTokens/maxDraftTokens: need 1 <= min <= max, got {self.min_gamma}, "
                             f"{self.max_gamma}")
        if not self.min_gamma <= self.gamma <= self.max_gamma:
            raise ValueError(f"numSpeculativeTokens: {self.gamma} outside [minDraftTokens, maxDraftTokens] = "
                             f"[{self.min_gamma}, {self.max_gamma}]")
        if self.margin < 0:
            raise ValueError(f"margin: must be >= 0, got {self.margin}")
        if self.explore_run < 1:
            raise ValueError(f"explore_run: must be >= 1, got {self.explore_run}")

    @property
    def adaptive(self) -> bool:
        return self.toggle or self.draft_length or self.strategy

    def gamma_range(self) -> list[int]:
        return list(range(self.min_gamma, self.max_gamma + 1)) if self.draft_length else [self.gamma]

    def arm_gammas(self) -> list[int]:
        if not self.draft_length:
            return [self.gamma]
        if self.gammas:
            bad = [g for g in self.gammas if not self.min_gamma <= g <= self.max_gamma]
            if bad:
                raise ValueError(f"gammas: {bad} outside [minDraftTokens, maxDraftTokens] = "
                                 f"[{self.min_gamma}, {self.max_gamma}]")
            return sorted(set(self.gammas))
        return sorted({min(max(g, self.min_gamma), self.max_gamma) for g in (*DEFAULT_GAMMAS, self.gamma)})


class StepClock:
    """Which seconds a step costs: "wall" (the engine's own timing; right on a dedicated machine or GPU) or
    "cpu" (this process's CPU time between decide and observe; on a shared CPU machine other processes
    stretch wall time by up to 5x within minutes, which would drown 10-20% differences between arms)."""

    def __init__(self, clock: str = "wall") -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {clock!r}")
        self.clock = clock
        self._t0: float | None = None

    def start(self) -> None:
        if self.clock == "cpu":
            self._t0 = time.process_time()

    def restamp(self, record: StepRecord) -> StepRecord:
        if self.clock != "cpu" or self._t0 is None:
            return record
        seconds = max(time.process_time() - self._t0, 1e-9)
        self._t0 = None
        share = record.draft_seconds / record.seconds if record.seconds > 0 else 0.0
        return dataclasses.replace(record, seconds=seconds, draft_seconds=seconds * share,
                                   target_seconds=seconds * (1 - share))


class FixedController:
    """Always the same decision (benchmarks and the cost-model calibration); records what it measured."""

    def __init__(self, decision: Decision, clock: str = "wall") -> None:
        self.decision = decision
        self.records: list[StepRecord] = []
        self._clock = StepClock(clock)

    def decide(self, active_batch_size: int) -> Decision:
        self._clock.start()
        return self.decision

    def observe(self, decision: Decision, record: StepRecord) -> None:
        self.records.append(self._clock.restamp(record))

    def stats(self) -> dict[str, Any]:
        return {"adaptive": False, "decision": label(self.decision), "steps": len(self.records)}


def round_alpha_from_record(record: StepRecord) -> float | None:
    """α of one speculative step from the engine's totals (None when nothing was drafted)."""
    if record.gamma < 1 or record.draft_tokens <= 0:
        return None
    drafting = max(record.draft_tokens / record.gamma, 1e-9)  # sequences that drafted (ragged proposers: fewer)
    return alpha_from_mean_accepted(record.accepted_tokens / drafting, record.gamma)


class ArCostFit:
    """Seconds of one plain decode step as a function of batch size: t(b) = c0 + c1·b, least squares over the
    calibration points and the AR steps measured while running (a low quantile per batch size).

    Rewards inside a bucket are normalised by t(b)/b so steps taken at b=5 and b=20 compare; a straight line
    keeps that normalisation monotone even when individual measurements are noisy.
    """

    def __init__(self, calibrated: Mapping[int, float] | None = None, window: int = 64, refit_every: int = 32) -> None:
        self._samples: dict[int, deque[float]] = {}
        for b, t in (calibrated or {}).items():
            self._samples[int(b)] = deque([float(t)] * 3, maxlen=window)
        self.window = window
        self.refit_every = refit_every
        self._since = 0
        self._fit: tuple[float, float] | None = None
        self._refit()

    def add(self, batch: int, seconds: float) -> None:
        self._samples.setdefault(batch, deque(maxlen=self.window)).append(seconds)
        self._since += 1
        if self._fit is None or self._since >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        self._since = 0
        # weighted by the number of samples: runtime measurements soon outweigh the start-up calibration
        pts = [(float(b), low_percentile(list(xs)), float(len(xs))) for b, xs in self._samples.items() if xs]
        if not pts:
            self._fit = None
            return
        if len(pts) == 1:
            b, t, _ = pts[0]
            self._fit = (0.0, t / b)
            return
        wsum = sum(w for _, _, w in pts)
        mb = sum(b * w for b, _, w in pts) / wsum
        mt = sum(t * w for _, t, w in pts) / wsum
        var = sum(w * (b - mb) ** 2 for b, _, w in pts)
        c1 = max(sum(w * (b - mb) * (t - mt) for b, t, w in pts) / var, 0.0) if var > 0 else 0.0
        c0 = mt - c1 * mb
        floor = min(t for _, t, _ in pts) * 0.5  # a line fitted through noise must not predict ~0 s at b=1
        self._fit = (max(c0, floor), c1)

    def seconds(self, batch: int) -> float | None:
        if self._fit is None:
            return None
        c0, c1 = self._fit
        return c0 + c1 * batch


class AdaptiveController:
    """(a) toggle + (b) draft length + (c) bucketed bandit; see the module docstring.

    `methods` are the proposers the engine built; `cost_model` comes from `calibrate(...)`. Without a cost model
    the controller is a plain bandit whose untried arms are tried first.
    """

    def __init__(self, methods: Sequence[str], cost_model: CostModel | None = None,
                 settings: AdaptiveSettings | None = None, metrics: Any | None = None,
                 alpha_priors: Mapping[str, float] | None = None) -> None:
        self.settings = settings or AdaptiveSettings()
        self.methods = list(dict.fromkeys(m for m in methods if m and m != "none"))
        self.cost_model = cost_model
        self.metrics = metrics
        s = self.settings
        self.acceptance = AcceptanceTracker(prior=s.prior_alpha, decay=s.ewma_decay, priors=alpha_priors)
        arms = ([AR] if s.toggle else []) + [Decision(m, g) for m in self.methods for g in s.arm_gammas()]
        self.bandit = BucketedEpsilonGreedy(arms or [AR], thresholds=s.buckets, epsilon=s.epsilon / s.explore_run,
                                            window=s.window, seed=s.seed, decay_steps=s.epsilon_decay_steps)
        self._burst: tuple[Decision, int, int] | None = None  # (arm, bucket, steps left) of an exploration burst
        self._last_method: str | None = None  # proposer of the previous step (None: plain decoding)
        # per proposer: recent switch steps' cost beyond a steady step, in plain-decode steps
        self._switch_costs: dict[str, deque[float]] = {}
        self._prior_cache: dict[int, tuple[int, dict[Decision, float]]] = {}
        self._clock = StepClock(s.clock)
        self._bucket_labels = [self.bandit.bucket_label(i) for i in range(len(self.bandit.thresholds))]
        self.ar_cost = ArCostFit(cost_model.target_step if cost_model is not None else None)
        self.current: Decision = AR
        self._counts: dict[str, dict[str, int]] = {}
        self.steps = 0
        self.sd_steps = 0
        self.explored = 0

    # -- decisions ------------------------------------------------------------------------------------------

    def predicted(self, arm: Decision, batch: int) -> float:
        """The cost model's relative goodput for `arm` at `batch` (1.0 = plain decoding)."""
        if not is_speculative(arm) or self.cost_model is None:
            return 1.0
        if arm.method not in self.cost_model.draft_step:
            return 0.0
        return self.cost_model.speedup(arm.method, arm.gamma, batch, self.acceptance.alpha(arm.method))

    def _priors(self, batch: int) -> dict[Decision, float]:
        """Predicted relative goodput of every arm at `batch`, recomputed every 16 decisions (α moves slowly;
        this keeps the controller's per-step cost in the tens of microseconds)."""
        cached = self._prior_cache.get(batch)
        if cached is not None and self.steps - cached[0] < 16:
            return cached[1]
        margin = 1.0 + self.settings.margin
        # The toggle's margin applies to predictions only: a measured win is a win.
        values = {arm: (self.predicted(arm, batch) / (margin if is_speculative(arm) else 1.0))
                  for arm in self.bandit.arms}
        self._prior_cache[batch] = (self.steps, values)
        return values

    def _model_decision(self, batch: int) -> Decision:
        """(a)+(b) without the bandit: the cost model's best proposer and γ, AR unless it wins by the margin."""
        s = self.settings
        if self.cost_model is None:
            return Decision(self.methods[0], s.gamma)
        alphas = self.acceptance.alphas(self.methods)
        if s.toggle:
            return toggle(self.cost_model, batch, alphas, s.gamma_range(), margin=s.margin)
        return max((Decision(m, self.cost_model.best_gamma(m, batch, alphas[m], s.gamma_range())[0])
                    for m in self.methods if m in self.cost_model.draft_step),
                   key=lambda d: self.predicted(d, batch), default=Decision(self.methods[0], s.gamma))

    def decide(self, active_batch_size: int) -> Decision:
        s = self.settings
        explored = False
        if not self.methods or active_batch_size < 1:
            decision = AR
        elif not s.adaptive:
            decision = Decision(self.methods[0], s.gamma)
        elif not s.strategy:
            decision = self._model_decision(active_batch_size)
        elif self._burst is not None and self._burst[1] == self.bandit.bucket(active_batch_size):
            arm, bucket, left = self._burst
            decision, explored = arm, True
            self._burst = (arm, bucket, left - 1) if left > 1 else None
        else:
            priors = self._priors(active_batch_size) if self.cost_model is not None else None
            decision, explored = self.bandit.choose(active_batch_size,
                                                    priors.__getitem__ if priors is not None else None,
                                                    incumbent=self._last_method, switch_margin=s.switch_margin,
                                                    switch_cost=self._switch_penalty)
            self._burst = (decision, self.bandit.bucket(active_batch_size), s.explore_run - 1) \
                if explored and s.explore_run > 1 else None
        self.current = decision
        self._record(active_batch_size, decision, explored)
        self._clock.start()
        return decision

    def observe(self, decision: Decision, record: StepRecord) -> None:
        record = self._clock.restamp(record)
        batch, seconds = record.batch_size, record.seconds
        if batch < 1 or seconds <= 0:
            return
        if is_speculative(decision) and decision.method:
            alpha = round_alpha_from_record(record)
            if alpha is not None:
                self.acceptance.observe(decision.method, alpha)
        # Goodput counts every token the step produced for its sequences; a sequence that stopped early emits
        # fewer, which is the same for every arm, so it does not bias the comparison.
        if not is_speculative(decision):
            self.ar_cost.add(batch, seconds)
        method = decision.method if is_speculative(decision) else None
        switched, self._last_method = method is not None and method != self._last_method, method
        t_ar = self.ar_cost.seconds(batch)
        if switched:
            # This step paid the proposer's catch-up on tokens it missed: a switching cost, not the arm's. What it
            # cost beyond a steady step of the arm is remembered to weigh the next switch to this proposer.
            if t_ar is not None:
                steady = self.bandit.score(self.bandit.bucket(batch), decision) or self.predicted(decision, batch)
                per_seq = max(record.emitted_tokens, 0) / batch
                baseline = per_seq / steady if steady > 0 else 1.0
                costs = self._switch_costs.setdefault(method, deque(maxlen=32))  # type: ignore[arg-type]
                costs.append(max(seconds / t_ar - baseline, 0.0))
            return
        tokens_per_s = max(record.emitted_tokens, 0) / seconds
        reward = tokens_per_s * t_ar / batch if t_ar is not None else tokens_per_s
        self.bandit.update(batch, decision, reward)

    def _switch_penalty(self, method: str) -> float:
        """Relative goodput a switch to `method` must gain per step to repay its catch-up within the horizon."""
        costs = self._switch_costs.get(method)
        return statistics.median(costs) / self.settings.switch_horizon if costs else 0.0

    # -- visibility -----------------------------------------------------------------------------------------

    def _record(self, batch: int, decision: Decision, explored: bool) -> None:
        bucket = self._bucket_labels[self.bandit.bucket(batch)]
        per = self._counts.setdefault(bucket, {})
        per[label(decision)] = per.get(label(decision), 0) + 1
        self.steps += 1
        self.sd_steps += int(is_speculative(decision))
        self.explored += int(explored)
        if self.metrics is not None:
            self.metrics.spec_decode_enabled.set(1 if is_speculative(decision) else 0)
            self.metrics.spec_decode_draft_length.set(decision.gamma if is_speculative(decision) else 0)

    def stats(self) -> dict[str, Any]:
        return {
            "adaptive": True,
            "current_method": self.current.method,
            "current_gamma": self.current.gamma,
            "sd_enabled": is_speculative(self.current),
            "sd_share": self.sd_steps / self.steps if self.steps else 0.0,
            "steps": self.steps,
            "explored_steps": self.explored,
            "decisions_by_bucket": {k: dict(v) for k, v in self._counts.items()},
            "alpha": {m: round(self.acceptance.alpha(m), 4) for m in self.methods},
            "scores_by_bucket": {
                self.bandit.bucket_label(i): {
                    label(arm): round(score, 4) for arm in self.bandit.arms
                    if (score := self.bandit.score(i, arm)) is not None}
                for i in range(len(self.bandit.thresholds))},
        }

    def per_batch_size_gamma(self, max_batch: int = 256) -> list[list[int]]:
        """vLLM's ``num_speculative_tokens_per_batch_size`` ([[start_bs, end_bs, K], ...], inclusive, K=0 off)
        derived from the toggle's decisions with the current acceptance estimates."""
        if not self.methods:
            return [[1, max_batch, 0]]
        ranges: list[list[int]] = []
        for b in range(1, max_batch + 1):
            k = self._model_decision(b).gamma
            if ranges and ranges[-1][2] == k:
                ranges[-1][1] = b
            else:
                ranges.append([b, b, k])
        return ranges


# ---------------------------------------------------------------------------------------------------------------
# building a controller from the RLJob


def settings_from_spec(speculative: Any, **overrides: Any) -> AdaptiveSettings:
    """Map the RLJob's ``spec.speculative`` (`specrl.runtime.api.SpeculativeSpec`, or its YAML mapping) onto
    `AdaptiveSettings`; `overrides` set fields the API does not carry (margin, seed, ...)."""
    from specrl.runtime.api import SpeculativeSpec  # pydantic only; keeps this module importable alone

    try:
        spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.model_validate(
            speculative or {})
    except ValueError as exc:
        raise ValueError(f"spec.speculative: {exc}") from None
    a = spec.adaptive
    return AdaptiveSettings(toggle=a.toggle, draft_length=a.draft_length, strategy=a.strategy,
                            gamma=spec.num_speculative_tokens, min_gamma=a.min_draft_tokens,
                            max_gamma=a.max_draft_tokens, epsilon=a.epsilon, window=a.window,
                            buckets=tuple(a.batch_size_buckets), **overrides)


def controller_from_spec(speculative: Any, methods: Sequence[str] | None = None, cost_model: CostModel | None = None,
                         metrics: Any | None = None, **overrides: Any) -> AdaptiveController:
    """An `AdaptiveController` for the RLJob's ``spec.speculative`` section.

    `methods`: the proposers the engine built (default: the spec's method only).
    """
    from specrl.runtime.api import SpeculativeSpec

    spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.model_validate(
        speculative or {})
    settings = settings_from_spec(spec, **overrides)
    if methods is None:
        methods = [] if spec.method == "none" else [spec.method]
    return AdaptiveController(methods, cost_model=cost_model, settings=settings, metrics=metrics)


# ---------------------------------------------------------------------------------------------------------------
# calibration


StepTimer = Callable[[int, int], float]  # (batch, tokens per sequence) -> seconds of one forward


def calibrate_from_timers(target: StepTimer, drafts: Mapping[str, Callable[[int], float]],
                          batch_sizes: Sequence[int] = DEFAULT_CALIBRATION_BATCH_SIZES,
                          verify_tokens: Sequence[int] = (1, 3, 5, 7), repeats: int = 5) -> CostModel:
    """Build a `CostModel` from timing callables (median of `repeats` calls after one warm-up call each)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    def med(fn: Callable[[], float]) -> float:
        fn()
        return statistics.median(fn() for _ in range(repeats))

    target_step: dict[int, float] = {}
    verify: dict[int, dict[int, float]] = {}
    draft: dict[str, dict[int, float]] = {m: {} for m in drafts}
    for b in batch_sizes:
        verify[b] = {k: med(lambda k=k, b=b: target(b, k)) for k in sorted(set(verify_tokens) | {1})}
        target_step[b] = verify[b][1]
        for m, timer in drafts.items():
            draft[m][b] = med(lambda timer=timer, b=b: timer(b))
    return CostModel(target_step=target_step, verify_step=verify, draft_step=draft)


@dataclass
class Calibration:
    """What `calibrate` measured: the cost model plus per-proposer acceptance seen while measuring."""

    cost_model: CostModel
    alpha: dict[str, float]
    seconds: float

    def summary(self) -> dict[str, Any]:
        cm = self.cost_model
        return {
            "seconds": round(self.seconds, 2),
            "target_step_ms": {b: round(t * 1e3, 3) for b, t in sorted(cm.target_step.items())},
            "v": {b: {g: round(cm.v(b, g), 3) for g in (2, 4, 6)} for b in sorted(cm.target_step)},
            "r": {m: {b: round(cm.r(m, b), 3) for b in sorted(cm.target_step)} for m in cm.methods},
            "overhead": {m: {b: round(cm.round_overhead(m, b), 3) for b in sorted(cm.target_step)}
                         for m in cm.methods},
            "alpha": {m: round(a, 3) for m, a in self.alpha.items()},
        }


def low_percentile(xs: Sequence[float], q: float = 0.2) -> float:
    """The q-quantile of timings: on a shared machine other processes only ever add time, so a low quantile
    estimates the intrinsic cost far more stably than the median (the minimum would be too optimistic)."""
    ordered = sorted(xs)
    if not ordered:
        raise ValueError("no samples")
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def calibrate(engine: Any, prompts: Sequence[Sequence[int]], methods: Sequence[str] | None = None,
              batch_sizes: Sequence[int] = DEFAULT_CALIBRATION_BATCH_SIZES, gammas: Sequence[int] = (2, 6),
              steps: int = 10, rounds: int = 2, seed: int = 0, clock: str = "wall",
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure the cost model on this machine by running the engine itself, pinned to one decision at a time.

    For every batch size b (prompts are cycled to fill it) the engine decodes with plain steps (-> the target
    step cost t(b)) and with every proposer at every γ in `gammas` (-> the verify cost of γ+1 tokens from the
    target part of the step, and the draft cost split into a per-token part r and a fixed per-round part from
    the two γ). Only steps that ran at exactly batch b count; a low quantile of the samples resists the noise of a
    shared machine. The engine's
    controller is restored afterwards; its stats keep the calibration steps (they are real decode steps).
    """
    from specrl.runtime.engine.sampling import SamplingParams

    if len(gammas) < 1 or any(g < 1 for g in gammas):
        raise ValueError(f"calibrate: gammas must be >= 1, got {list(gammas)}")
    if not prompts:
        raise ValueError("calibrate: needs at least one prompt")
    methods = list(methods if methods is not None else getattr(engine, "proposers", {}))
    sizes = sorted({min(b, engine.max_batch_size) for b in batch_sizes})
    gammas = sorted(set(gammas))
    saved = engine.controller
    start = time.perf_counter()
    target_step: dict[int, float] = {}
    verify: dict[int, dict[int, list[float]]] = {}
    draft_by: dict[str, dict[int, dict[int, float]]] = {m: {} for m in methods}
    alphas: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}

    def run(b: int, decision: Decision, new_tokens: int) -> list[StepRecord]:
        batch = [list(prompts[i % len(prompts)]) for i in range(b)]
        fixed = FixedController(decision, clock=clock)
        engine.controller = fixed
        params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed + i) for i in range(b)]
        engine.generate(batch, params)
        return [r for r in fixed.records if r.batch_size == b]

    ar_samples: dict[int, list[float]] = {b: [] for b in sizes}
    draft_samples: dict[str, dict[int, dict[int, list[float]]]] = {m: {} for m in methods}
    try:
        # Interleave (rounds × batch sizes × decisions) so a burst of load from other processes spreads over
        # every measurement instead of skewing one of them.
        for _ in range(max(rounds, 1)):
            for b in sizes:
                if progress:
                    progress(f"calibrate: batch {b} AR")
                ar_samples[b] += [r.seconds for r in run(b, AR, steps + 2)[1:]]  # step 1 warms caches
                for m in methods:
                    for g in gammas:
                        if progress:
                            progress(f"calibrate: batch {b} {m} γ={g}")
                        recs = run(b, Decision(m, g), (g + 1) * max(2, steps // 3) + 2)
                        verify.setdefault(b, {}).setdefault(g + 1, []).extend(r.target_seconds for r in recs)
                        draft_samples[m].setdefault(b, {}).setdefault(g, []).extend(r.draft_seconds for r in recs)
                        alphas[m] += [(a, r.batch_size) for r in recs
                                      if (a := round_alpha_from_record(r)) is not None]
        for b in sizes:
            target_step[b] = low_percentile(ar_samples[b])
            verify.setdefault(b, {})[1] = [target_step[b]]
        for m, by_b in draft_samples.items():
            for b, by_g in by_b.items():
                for g, xs in by_g.items():
                    if xs:
                        draft_by[m].setdefault(b, {})[g] = low_percentile(xs)
    finally:
        engine.controller = saved

    draft_step: dict[str, dict[int, float]] = {}
    overhead: dict[str, dict[int, float]] = {}
    for m, by_b in draft_by.items():
        draft_step[m], overhead[m] = {}, {}
        for b, by_g in by_b.items():
            gs = sorted(by_g)
            if len(gs) >= 2:  # draft(γ) = a + γ·c: c per draft token, a per round (e.g. a draft model's catch-up)
                c = max((by_g[gs[-1]] - by_g[gs[0]]) / (gs[-1] - gs[0]), 0.0)
                a = max(by_g[gs[0]] - c * gs[0], 0.0)
            else:
                c, a = by_g[gs[0]] / gs[0], 0.0
            draft_step[m][b], overhead[m][b] = c, a
    model = CostModel(target_step=target_step,
                      verify_step={b: {k: low_percentile(v) for k, v in by_k.items() if v}
                                   for b, by_k in verify.items()},
                      draft_step={m: d for m, d in draft_step.items() if d},
                      overhead={m: o for m, o in overhead.items() if o})
    alpha = {m: sum(a * w for a, w in obs) / sum(w for _, w in obs) for m, obs in alphas.items() if obs}
    return Calibration(model, alpha, time.perf_counter() - start)


def timed(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> float:
    """Wall seconds of one call of `fn` (with a device sync before and after when given)."""
    if sync:
        sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - start

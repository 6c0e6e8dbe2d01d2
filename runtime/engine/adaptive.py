"""Adaptive speculation: one cost-model argmax per decode step (DESIGN §5).

At active batch size b, plain decoding emits b tokens per plain step t(b). A speculative round with proposer m and
draft length γ emits b·L(α_m, γ) tokens, L = (1 − α^(γ+1)) / (1 − α), and costs
``γ·d_m(b) + a_m(b) + t_v(b, γ+1)``: γ draft steps, the proposer's fixed per-round work, and one target forward
over γ+1 tokens. Its speed relative to plain decoding is ``L / (γ·r + a + v)`` in units of t(b). Every step the
controller takes the argmax over {plain} ∪ {(m, γ)} of that ratio — that is all of the policy — with:

* **running estimates**: t(b), t_v(b, k) and d_m(b) start from the start-up calibration (`calibrate`) and are
  replaced by what the steps themselves measure (a low quantile of the last `window` samples per batch size: on a
  shared machine other processes only ever add time); α_m is an exponential average of per-round acceptance;
* **hysteresis**: a different choice must beat the current one by `hysteresis` (a proposer with its own KV cache
  pays a catch-up on every token it missed when it is switched back in, and a flapping policy pays it often);
* **probes**: a share `probe` of the steps runs the option that has gone longest without a measurement — plain
  decoding included — so a drafter that improves (it is trained while the job runs) or a machine that got slower
  is noticed. Options never measured at all and without a calibration are probed first.

Switch steps (the first step of a proposer after another option ran) measure the catch-up, not the proposer, so
their draft time is not recorded; their verify time and acceptance are. Nothing here touches the sampling RNG:
the choice never changes the distribution of the sampled tokens (every option is lossless).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .control import Decision, FixedController, StepClock, StepRecord

AR = Decision(None, 0)
MIN_TRIED = 32  # draft tokens of acceptance evidence before a proposer's α is trusted (probed until then)
DEFAULT_CALIBRATION_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)


def is_speculative(decision: Decision) -> bool:
    return decision.method is not None and decision.gamma > 0


def label(decision: Decision) -> str:
    return f"{decision.method}:{decision.gamma}" if is_speculative(decision) else "ar"


# ---------------------------------------------------------------------------------------------------------------
# the math


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


def round_alpha_from_record(record: StepRecord) -> float | None:
    """α of one speculative step from the engine's totals (None when nothing was drafted)."""
    if record.gamma < 1 or record.draft_tokens <= 0:
        return None
    drafting = max(record.draft_tokens / record.gamma, 1e-9)  # sequences that drafted (ragged proposers: fewer)
    return alpha_from_mean_accepted(record.accepted_tokens / drafting, record.gamma)


def low_percentile(xs: Iterable[float], q: float = 0.2) -> float:
    """The q-quantile of timings: other processes only ever add time, so a low quantile estimates the intrinsic
    cost far more stably than the mean (the minimum would be too optimistic)."""
    ordered = sorted(xs)
    if not ordered:
        raise ValueError("no samples")
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


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


def _linear_in_tokens(by_k: Mapping[int, float], tokens: int) -> float:
    ks = sorted(by_k)
    if tokens in by_k:
        return by_k[tokens]
    if len(ks) == 1:
        return by_k[ks[0]] * tokens / ks[0]
    lo = max([k for k in ks if k <= tokens] or [ks[0]])
    hi = min([k for k in ks if k >= tokens] or [ks[-1]])
    if lo == hi:  # outside the measured range: extend the nearest segment, never downhill (a noisy pair of
        # timings under load once extrapolated the verify cost of 7 tokens to 0, and the toggle then speculated
        # at α≈0.2 and ran at 0.76x plain decoding)
        lo, hi = (ks[-2], ks[-1]) if tokens > ks[-1] else (ks[0], ks[1])
        slope = max(by_k[hi] - by_k[lo], 0.0) / (hi - lo)
        return by_k[hi] + slope * (tokens - hi) if tokens > ks[-1] else by_k[lo] - slope * (lo - tokens)
    return by_k[lo] + (by_k[hi] - by_k[lo]) / (hi - lo) * (tokens - lo)


@dataclass
class CostModel:
    """Step costs on this machine (seconds) at measured batch sizes, interpolated in between.

    ``target_step[b]``: one plain decode step at batch b. ``verify_step[b][k]``: one target forward over k new
    tokens per sequence (k = γ+1 when verifying). ``draft_step[m][b]``: proposer m's cost per draft token;
    ``overhead[m][b]``: its fixed cost per round (e.g. a draft model's forward over the last accepted tokens).
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
        """verify(γ+1 tokens) / plain step at this batch size (linear in tokens between measured k)."""
        per_b = {}
        for b, by_k in self.verify_step.items():
            t = self.target_step.get(b) or self.t_ar(b)
            per_b[b] = _linear_in_tokens({**by_k, 1: t}, gamma + 1) / t
        # verifying γ+1 tokens is never cheaper than the one-token plain step it replaces
        return max(_interp(per_b, batch), 1.0) if per_b else float(gamma + 1)

    def r(self, method: str, batch: int) -> float:
        if method not in self.draft_step:
            raise KeyError(f"CostModel: proposer {method!r} was not calibrated (have {self.methods})")
        return max(_interp({b: t / self.t_ar(b) for b, t in self.draft_step[method].items()}, batch), 0.0)

    def round_overhead(self, method: str, batch: int) -> float:
        by_b = self.overhead.get(method)
        return max(_interp({b: t / self.t_ar(b) for b, t in by_b.items()}, batch), 0.0) if by_b else 0.0

    def round_cost(self, method: str, gamma: int, batch: int) -> float:
        """Cost of one speculative round in plain steps: γ·r + v (+ the proposer's per-round overhead)."""
        return gamma * self.r(method, batch) + self.v(batch, gamma) + self.round_overhead(method, batch)

    def speedup(self, method: str, gamma: int, batch: int, alpha: float) -> float:
        return expected_tokens_per_round(alpha, gamma) / self.round_cost(method, gamma, batch)

    def best_gamma(self, method: str, batch: int, alpha: float, gammas: Iterable[int]) -> tuple[int, float]:
        """The γ in `gammas` with the highest predicted speedup (shorter on ties), and that speedup."""
        r, a = self.r(method, batch), self.round_overhead(method, batch)
        best = (-1.0, 0)
        for g in sorted(gammas):
            s = expected_tokens_per_round(alpha, g) / (g * r + a + self.v(batch, g))
            if s > best[0]:
                best = (s, g)
        return best[1], best[0]

    def to_dict(self) -> dict[str, Any]:
        return {"target_step": self.target_step, "verify_step": self.verify_step,
                "draft_step": self.draft_step, "overhead": self.overhead}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        def ints(d: Mapping[Any, Any]) -> dict[int, float]:
            return {int(k): float(v) for k, v in d.items()}

        return cls(target_step=ints(data["target_step"]),
                   verify_step={int(b): ints(by_k) for b, by_k in data["verify_step"].items()},
                   draft_step={m: ints(v) for m, v in data.get("draft_step", {}).items()},
                   overhead={m: ints(v) for m, v in data.get("overhead", {}).items()})


# ---------------------------------------------------------------------------------------------------------------
# the policy


@dataclass
class AdaptiveSettings:
    """`settings_from_spec` maps the RLJob's ``spec.speculative.adaptive`` onto these.

    toggle: plain decoding is an option; draft_length: γ ranges over [min_gamma, max_gamma] (else fixed at
    `gamma`); strategy: every proposer the engine built is an option (else only the first).
    """

    toggle: bool = True
    draft_length: bool = True
    strategy: bool = True
    gamma: int = 4  # fixed draft length when draft_length is off (spec.speculative.numSpeculativeTokens)
    min_gamma: int = 1
    max_gamma: int = 8
    hysteresis: float = 0.05
    probe: float = 0.01  # share of steps that refresh the stalest option (spec.speculative.adaptive.epsilon)
    probe_run: int = 4  # steps in a row per probe (one round says little about acceptance at batch 1)
    window: int = 32  # timing samples kept per (quantity, batch size)
    alpha_weight: float = 0.02  # decay per round of the acceptance counts (a window of ~50 rounds)
    prior_alpha: float = 0.6
    refresh: int = 8  # steps between recomputations of one batch size's table of options
    clock: str = "wall"  # "cpu" on shared CPU machines, see control.StepClock

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {self.clock!r}")
        if self.min_gamma < 1 or self.max_gamma < self.min_gamma:
            raise ValueError(f"minDraftTokens/maxDraftTokens: need 1 <= min <= max, got {self.min_gamma}, "
                             f"{self.max_gamma}")
        if not self.min_gamma <= self.gamma <= self.max_gamma:
            raise ValueError(f"numSpeculativeTokens: {self.gamma} outside [minDraftTokens, maxDraftTokens] = "
                             f"[{self.min_gamma}, {self.max_gamma}]")
        if self.hysteresis < 0 or not 0 <= self.probe <= 1:
            raise ValueError(f"hysteresis must be >= 0 and probe in [0, 1], got {self.hysteresis}, {self.probe}")
        if self.window < 1 or self.refresh < 1 or self.probe_run < 1:
            raise ValueError(f"window, refresh and probe_run must be >= 1, got {self.window}, {self.refresh}, "
                             f"{self.probe_run}")

    @property
    def adaptive(self) -> bool:
        return self.toggle or self.draft_length or self.strategy

    def gammas(self) -> list[int]:
        return list(range(self.min_gamma, self.max_gamma + 1)) if self.draft_length else [self.gamma]


class AdaptiveController:
    """The engine's per-step hook (`control.Controller`); see the module docstring.

    `methods`: the proposers the engine built; `cost_model`: from `calibrate(...)` (optional: without one the
    controller measures plain decoding first and probes every proposer once before choosing).
    """

    def __init__(self, methods: Sequence[str], cost_model: CostModel | None = None,
                 settings: AdaptiveSettings | None = None, metrics: Any | None = None,
                 alpha_priors: Mapping[str, float] | None = None) -> None:
        self.settings = s = settings or AdaptiveSettings()
        names = list(dict.fromkeys(m for m in methods if m and m != "none"))
        self.methods = names if s.strategy else names[:1]
        self.metrics = metrics
        priors = alpha_priors or {}
        self.alpha = {m: float(priors.get(m, s.prior_alpha)) for m in self.methods}
        # decayed (accepted, tried) draft tokens; a calibrated α counts as `MIN_TRIED` tokens of evidence
        self._acceptance = {m: (MIN_TRIED * self.alpha[m], float(MIN_TRIED)) if m in priors else (0.0, 0.0)
                            for m in self.methods}
        self._probing: tuple[Decision, int] | None = None  # a probe burst in progress: (option, steps left)
        self.costs = CostModel.from_dict(cost_model.to_dict()) if cost_model is not None else None
        self._samples: dict[tuple, deque[float]] = {}
        self._tables: dict[int, tuple[int, dict[str | None, tuple[float, Decision]]]] = {}
        self._last_run: dict[str | None, int] = {}  # option (None: plain) -> step it last ran
        self._last_method: str | None = None
        self._clock = StepClock(s.clock)
        self.current = AR
        self.steps = self.sd_steps = self.probes = 0
        self._counts: dict[int, Counter[str]] = {}

    # -- the argmax ------------------------------------------------------------------------------------------

    def table(self, batch: int) -> dict[str | None, tuple[float, Decision]]:
        """Per option (None: plain decoding), its predicted speed relative to plain decoding and its best γ."""
        cached = self._tables.get(batch)
        if cached is not None and self.steps - cached[0] < self.settings.refresh:
            return cached[1]
        out: dict[str | None, tuple[float, Decision]] = {}
        if self.settings.toggle or not self.methods:
            out[None] = (1.0, AR)
        if self.costs is not None:
            for m in self.methods:
                if m in self.costs.draft_step:
                    g, s = self.costs.best_gamma(m, batch, self.alpha[m], self.settings.gammas())
                    out[m] = (s, Decision(m, g))
        self._tables[batch] = (self.steps, out)
        return out

    def choose(self, batch: int) -> Decision:
        """The argmax with hysteresis (no probes): what the policy exploits at this batch size."""
        options = self.table(batch)
        if not options:  # plain decoding excluded and nothing measured yet: try the first proposer
            return Decision(self.methods[0], self.settings.gamma)
        best = max(options, key=lambda k: options[k][0])
        incumbent = self.current.method if is_speculative(self.current) else None
        if incumbent in options and options[best][0] < options[incumbent][0] * (1 + self.settings.hysteresis):
            best = incumbent
        return options[best][1]

    def _probe(self, batch: int) -> Decision | None:
        """An option to measure this step instead of the argmax, or None."""
        s = self.settings
        if self.costs is None:  # nothing measured yet: plain decoding first, it is the baseline of everything
            return AR if s.toggle else Decision(self.methods[0], s.gamma)
        for m in self.methods:  # proposers without a draft cost or enough acceptance evidence come first
            if m not in self.costs.draft_step or self._acceptance[m][1] < MIN_TRIED:
                return Decision(m, s.gamma)
        if self._probing is not None:
            option, left = self._probing
            self._probing = (option, left - 1) if left > 1 else None
            return option
        if s.probe <= 0 or self.steps % max(round(s.probe_run / s.probe), 1):
            return None
        options = self.table(batch)
        current = self.current.method if is_speculative(self.current) else None
        stale = min((k for k in options if k != current), key=lambda k: self._last_run.get(k, -1), default=current)
        if stale == current:
            return None
        option = options[stale][1]
        if is_speculative(option):  # draft at least `gamma` tokens: a probe is for evidence, 1 token says little
            option = Decision(option.method, max(option.gamma, s.gamma))
        self._probing = (option, s.probe_run - 1) if s.probe_run > 1 else None
        return option

    def decide(self, active_batch_size: int) -> Decision:
        s = self.settings
        self.steps += 1
        probe = None
        if not self.methods or active_batch_size < 1:
            decision = AR
        elif not s.adaptive:
            decision = Decision(self.methods[0], s.gamma)
        else:
            probe = self._probe(active_batch_size)
            decision = probe or self.choose(active_batch_size)
        if probe is None:
            self.current = decision
        self.probes += probe is not None
        self.sd_steps += is_speculative(decision)
        self._counts.setdefault(active_batch_size, Counter())[label(decision)] += 1
        if self.metrics is not None:
            self.metrics.spec_decode_enabled.set(1 if is_speculative(decision) else 0)
            self.metrics.spec_decode_draft_length.set(decision.gamma if is_speculative(decision) else 0)
        self._clock.start()
        return decision

    # -- estimates -------------------------------------------------------------------------------------------

    def _sample(self, key: tuple, x: float, seed: float | None) -> float:
        """Add one timing sample; the estimate is a low quantile of the window (seeded by the calibration)."""
        window = self._samples.get(key)
        if window is None:
            window = self._samples[key] = deque([seed] * 3 if seed is not None else [], maxlen=self.settings.window)
        window.append(x)
        return low_percentile(window, 0.25)

    def observe(self, decision: Decision, record: StepRecord) -> None:
        record = self._clock.restamp(record)
        b = record.batch_size
        if b < 1 or record.seconds <= 0:
            return
        # what ran (the engine decodes plainly when every row ends within one token, and caps γ at the budget)
        decision = Decision(record.method, record.gamma) if record.method and record.gamma > 0 else AR
        method = decision.method
        switched, self._last_method = method != self._last_method, method
        self._last_run[method] = self.steps
        if method is None:
            old = self.costs.target_step.get(b) if self.costs is not None else None
            t = self._sample(("ar", b), record.seconds, old)
            if self.costs is None:
                self.costs = CostModel(target_step={b: t}, verify_step={})
            self.costs.target_step[b] = t
            self._follow(b, t / old if old else 1.0, None)
            return
        if record.tried_tokens > 0:  # α = accepted / tried over a decaying window of rounds (the MLE)
            keep = 1 - self.settings.alpha_weight
            acc, tried = self._acceptance[method]
            acc, tried = keep * acc + record.accepted_tokens, keep * tried + record.tried_tokens
            self._acceptance[method] = (acc, tried)
            self.alpha[method] = min(max(acc / tried, 0.0), 1.0)
        elif (alpha := round_alpha_from_record(record)) is not None:
            self.alpha[method] += self.settings.alpha_weight * (alpha - self.alpha[method])
        c = self.costs
        if c is None:
            return
        k = decision.gamma + 1
        by_k = c.verify_step.setdefault(b, {})
        old = by_k.get(k)
        by_k[k] = self._sample(("verify", b, k), record.target_seconds, old)
        self._follow(b, by_k[k] / old if old else 1.0, k)
        if not switched:
            per_round = _interp(c.overhead[method], b) if c.overhead.get(method) else 0.0
            per_token = max(record.draft_seconds - per_round, 0.0) / decision.gamma
            by_b = c.draft_step.setdefault(method, {})
            by_b[b] = self._sample(("draft", method, b), per_token, by_b.get(b))
        elif method not in c.draft_step:  # first ever measurement: an upper bound until a steady step comes
            c.draft_step[method] = {b: record.draft_seconds / decision.gamma}

    def _follow(self, b: int, factor: float, measured_k: int | None) -> None:
        """Scale the verify costs at batch b that no step has measured yet by what the measured one moved: they
        come from the calibration, and the machine's load moves every forward alike (else a calibrated γ that
        never runs would look dearer, or cheaper, than the one running, for ever)."""
        if factor == 1.0 or self.costs is None:
            return
        for k, t in self.costs.verify_step.get(b, {}).items():
            if k != measured_k and ("verify", b, k) not in self._samples:
                self.costs.verify_step[b][k] = t * factor

    # -- visibility ------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            "adaptive": True,
            "current_method": self.current.method,
            "current_gamma": self.current.gamma,
            "sd_enabled": is_speculative(self.current),
            "sd_share": self.sd_steps / self.steps if self.steps else 0.0,
            "steps": self.steps,
            "probe_steps": self.probes,
            "decisions_by_batch_size": {b: dict(c) for b, c in sorted(self._counts.items())},
            "alpha": {m: round(a, 4) for m, a in self.alpha.items()},
        }

    def per_batch_size_gamma(self, max_batch: int = 256) -> list[list[int]]:
        """vLLM's ``num_speculative_tokens_per_batch_size`` ([[start_bs, end_bs, K], ...], inclusive, K=0 off):
        the argmax's γ at every batch size with the current estimates (no hysteresis, no probes)."""
        ranges: list[list[int]] = []
        for b in range(1, max_batch + 1):
            options: dict[str | None, tuple[float, Decision]] = \
                self.table(b) if self.methods else {None: (1.0, AR)}
            k = options[max(options, key=lambda o: options[o][0])][1].gamma if options else self.settings.gamma
            if ranges and ranges[-1][2] == k:
                ranges[-1][1] = b
            else:
                ranges.append([b, b, k])
        return ranges


# ---------------------------------------------------------------------------------------------------------------
# building a controller from the RLJob


def settings_from_spec(speculative: Any, **overrides: Any) -> AdaptiveSettings:
    """Map the RLJob's ``spec.speculative`` (`specrl.runtime.api.SpeculativeSpec`, or its YAML mapping) onto
    `AdaptiveSettings`; `overrides` set fields the API does not carry (hysteresis, clock, ...)."""
    from ..api import SpeculativeSpec  # pydantic only; keeps this module importable alone

    try:
        spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.model_validate(
            speculative or {})
    except ValueError as exc:
        raise ValueError(f"spec.speculative: {exc}") from None
    a = spec.adaptive
    fields = {"toggle": a.toggle, "draft_length": a.draft_length, "strategy": a.strategy,
              "gamma": spec.num_speculative_tokens, "min_gamma": a.min_draft_tokens, "max_gamma": a.max_draft_tokens,
              "probe": a.epsilon, "window": a.window}
    return AdaptiveSettings(**{**fields, **overrides})


def controller_from_spec(speculative: Any, methods: Sequence[str] | None = None, cost_model: CostModel | None = None,
                         metrics: Any | None = None, **overrides: Any) -> AdaptiveController:
    """An `AdaptiveController` for the RLJob's ``spec.speculative`` (`methods`: the proposers the engine built;
    default: the spec's method only)."""
    from ..api import SpeculativeSpec

    spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.model_validate(
        speculative or {})
    if methods is None:
        methods = [] if spec.method == "none" else [spec.method]
    return AdaptiveController(methods, cost_model=cost_model, settings=settings_from_spec(spec, **overrides),
                              metrics=metrics)


# ---------------------------------------------------------------------------------------------------------------
# calibration


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


def calibrate(engine: Any, prompts: Sequence[Sequence[int]], methods: Sequence[str] | None = None,
              batch_sizes: Sequence[int] = DEFAULT_CALIBRATION_BATCH_SIZES, gammas: Sequence[int] = (2, 6),
              steps: int = 10, rounds: int = 2, seed: int = 0, clock: str = "wall",
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure the cost model on this machine by running the engine itself, pinned to one decision at a time.

    For every batch size b (prompts are cycled to fill it) the engine decodes with plain steps (-> t(b)) and with
    every proposer at every γ in `gammas` (-> the verify cost of γ+1 tokens from the target part of the step, and
    the draft cost split into a per-token and a per-round part from two γ). Only steps at exactly batch b count;
    rounds are interleaved so a burst of load spreads over every measurement. The engine's controller is
    restored afterwards; its stats keep the calibration steps (they are real decode steps).
    """
    from .sampling import SamplingParams

    if len(gammas) < 1 or any(g < 1 for g in gammas):
        raise ValueError(f"calibrate: gammas must be >= 1, got {list(gammas)}")
    if not prompts:
        raise ValueError("calibrate: needs at least one prompt")
    methods = list(methods if methods is not None else getattr(engine, "proposers", {}))
    sizes = sorted({min(b, engine.max_batch_size) for b in batch_sizes})
    gammas = sorted(set(gammas))
    saved = engine.controller
    start = time.perf_counter()
    ar: dict[int, list[float]] = {b: [] for b in sizes}
    verify: dict[int, dict[int, list[float]]] = {b: {} for b in sizes}
    draft: dict[tuple[str, int, int], list[float]] = {}
    alphas: dict[str, list[float]] = {m: [] for m in methods}

    def run(b: int, decision: Decision, new_tokens: int) -> list[StepRecord]:
        fixed = FixedController(decision.method, decision.gamma, clock=clock)
        engine.controller = fixed
        engine.generate([list(prompts[i % len(prompts)]) for i in range(b)],
                        [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed + i) for i in range(b)])
        assert fixed.records is not None  # a controller with a clock records every step
        return [r for r in fixed.records if r.batch_size == b]

    try:
        for _ in range(max(rounds, 1)):
            for b in sizes:
                if progress:
                    progress(f"calibrate: batch {b} AR")
                ar[b] += [r.seconds for r in run(b, AR, steps + 2)[1:]]  # step 1 warms caches
                for m in methods:
                    for g in gammas:
                        if progress:
                            progress(f"calibrate: batch {b} {m} γ={g}")
                        recs = run(b, Decision(m, g), (g + 1) * max(2, steps // 3) + 2)
                        verify[b].setdefault(g + 1, []).extend(r.target_seconds for r in recs)
                        draft.setdefault((m, b, g), []).extend(r.draft_seconds for r in recs)
                        alphas[m] += [a for r in recs if (a := round_alpha_from_record(r)) is not None]
    finally:
        engine.controller = saved
    draft_step: dict[str, dict[int, float]] = {}
    overhead: dict[str, dict[int, float]] = {}
    for m in methods:
        for b in sizes:
            by_g = {g: low_percentile(draft[(m, b, g)]) for g in gammas if draft.get((m, b, g))}
            if not by_g:
                continue
            gs = sorted(by_g)
            if len(gs) >= 2:  # draft(γ) = a + γ·c: c per draft token, a per round
                c = max((by_g[gs[-1]] - by_g[gs[0]]) / (gs[-1] - gs[0]), 0.0)
                a = max(by_g[gs[0]] - c * gs[0], 0.0)
            else:
                c, a = by_g[gs[0]] / gs[0], 0.0
            draft_step.setdefault(m, {})[b] = c
            overhead.setdefault(m, {})[b] = a
    target = {b: low_percentile(xs) for b, xs in ar.items() if xs}
    model = CostModel(target_step=target,
                      verify_step={b: {1: target[b], **{k: low_percentile(v) for k, v in by_k.items() if v}}
                                   for b, by_k in verify.items() if b in target},
                      draft_step=draft_step, overhead=overhead)
    alpha = {m: sum(xs) / len(xs) for m, xs in alphas.items() if xs}
    return Calibration(model, alpha, time.perf_counter() - start)
